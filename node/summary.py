"""The few lines a person reads when a node exits, made from the same summary dict that goes to
stdout as JSON (`{"summary": {...}}`, for scripts and tests).

`human_summary` never fails on a summary it does not fully recognise: a missing or null field
leaves out its phrase, so an older or partial summary (a node stopped before it trained) still
gives a readable line.
"""

from __future__ import annotations

from typing import Any, Optional

from node.timefmt import duration


def human_summary(role: str, summary: dict, *, uptime_s: Optional[float] = None) -> str:
    """A short multi-line summary of `summary` (a role's `summary()`); `uptime_s` is how long
    the node ran, if the caller knows it better than the summary does."""
    if role == "trainer":
        lines = _trainer(summary, uptime_s)
    elif role == "worker":
        lines = _worker(summary, uptime_s)
    else:
        lines = [f"{role} done" + (f" after {duration(uptime_s)}" if uptime_s is not None else "")]
    return "\n".join([lines[0], *("  " + line for line in lines[1:] if line)])


def _trainer(s: dict, uptime_s: Optional[float]) -> list[str]:
    completed, dropped, tokens = _int(s, "samples_completed"), _int(s, "samples_dropped"), _int(s, "tokens")
    head = "trainer done"
    wall = _num(s, "wall_s")
    if wall is not None and wall > 0:
        head += f" after {duration(wall)} of training"
    elif uptime_s is not None:
        head += f" after {duration(uptime_s)}"
    facts = []
    if completed is not None:
        facts.append(f"{completed} samples completed" + (f" ({tokens} tokens)" if tokens else ""))
    if dropped is not None:
        facts.append(f"{dropped} dropped")
    in_flight = _int(s, "samples_in_flight")
    if in_flight:
        facts.append(f"{in_flight} still in flight")
    lines = [head + (": " + ", ".join(facts) if facts else "")]

    progress = []
    first, last = _num(s, "first_loss"), _num(s, "last_loss")
    if first is not None and last is not None:
        change = f" ({(1 - last / first) * 100:.0f}% lower)" if first > 0 and last <= first else ""
        progress.append(f"loss {first:.3f} -> {last:.3f}{change}")
    elif last is not None:
        progress.append(f"loss {last:.3f}")
    evaluations = [e for e in s.get("eval") or [] if isinstance(e, dict) and _num(e, "loss") is not None]
    if evaluations:
        held_out = evaluations[-1]
        progress.append(f"held-out loss {_num(held_out, 'loss'):.3f}" + (
            f" at step {held_out['step']}" if _int(held_out, "step") is not None else ""))
    rate = _num(s, "tokens_per_s")
    if rate:
        progress.append(f"{rate:.0f} tokens/s")
    step = _int(s, "last_step")
    if step is not None:
        progress.append(f"last step {step}")
    lines.append(", ".join(progress))

    routing = []
    served = s.get("served")
    if isinstance(served, dict) and served:
        stages = sorted(served, key=lambda k: int(k) if str(k).isdigit() else 0)
        per_stage = [len(served[k]) if isinstance(served[k], dict) else 0 for k in stages]
        routing.append(f"workers used per stage {per_stage}")
    retries, fallbacks = _int(s, "forward_retries"), _int(s, "backward_fallbacks")
    if retries:
        routing.append(f"{retries} forward retries")
    if fallbacks:
        routing.append(f"{fallbacks} backward fallbacks")
    skipped = s.get("skipped_stages")
    if isinstance(skipped, dict) and skipped:
        per_stage = ", ".join(
            f"stage {stage} for {sum(v for v in passes.values() if isinstance(v, int))} samples"
            for stage, passes in sorted(skipped.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0)
            if isinstance(passes, dict))
        if per_stage:
            routing.append(f"skipped {per_stage}")
    lines.append(", ".join(routing))
    by_reason = _counts(s.get("dropped_by_reason"))
    if by_reason:
        lines.append(f"dropped: {by_reason}")
    return lines


def _worker(s: dict, uptime_s: Optional[float]) -> list[str]:
    head = "worker" + (f" of stage {s['stage']}" if s.get("stage") is not None else "") + " done"
    if uptime_s is not None:
        head += f" after {duration(uptime_s)}"
    steps = s.get("steps") if isinstance(s.get("steps"), dict) else {}
    facts = []
    local_step = _int(s, "local_step")
    taken = _int(steps, "taken")
    if taken is not None:
        facts.append(f"{taken} steps taken" + (f" (at step {local_step})" if local_step not in (None, taken) else ""))
    elif local_step is not None:
        facts.append(f"at step {local_step}")
    if s.get("phase"):
        facts.append(f"phase {s['phase']}")
    compute = _num(s, "compute_s")
    if compute:
        facts.append(f"{duration(compute)} computing")
    lines = [head + (": " + ", ".join(facts) if facts else "")]

    counters = s.get("counters") if isinstance(s.get("counters"), dict) else {}
    work = []
    for kind in ("forward", "backward"):
        requests, batches = _int(counters, f"{kind}_requests"), _int(counters, f"{kind}_batches")
        if requests:
            work.append(f"{requests} {kind} samples" + (f" in {batches} batches" if batches else ""))
    mean_batch = _num(s, "mean_batch_size")
    if mean_batch:
        work.append(f"mean batch {mean_batch:.2f}")
    lines.append(", ".join(work))

    step_facts = []
    per_step = _num(steps, "samples_per_step_mean")
    if per_step is not None:
        low, high = _int(steps, "samples_per_step_min"), _int(steps, "samples_per_step_max")
        spread = f" ({low}..{high})" if low is not None and high is not None and low != high else ""
        step_facts.append(f"{per_step:g} samples per step{spread}")
    closed = _counts(steps.get("closed_by"))
    if closed:
        step_facts.append(f"steps closed: {closed}")
    for key, label in (("late_samples", "late samples"), ("abandoned_samples", "abandoned samples"),
                       ("steps_skipped", "steps skipped"), ("discarded_at_shutdown", "discarded at shutdown")):
        n = _int(steps, key)
        if n:
            step_facts.append(f"{n} {label}")
    lines.append("; ".join(step_facts))

    lines.append(_sparseloco(s["sparseloco"]) if "sparseloco" in s else _averaging(s.get("averaging")))
    lines.append(_staleness(s.get("staleness")))
    by_call = s.get("rejected_calls")
    if isinstance(by_call, dict) and by_call:  # "1 tags not_ready": which exchange refused, not just why
        by_call = {str(k).removeprefix("agora/v1/"): v for k, v in by_call.items()}
    rejected = _counts({**((by_call or s.get("rejected")) or {}), **(s.get("auth_rejected") or {})})
    if rejected:
        lines.append(f"rejected requests: {rejected}")
    return lines


def _sparseloco(slc: Any) -> str:
    if not isinstance(slc, dict):
        return ""
    rounds = {k: v for k, v in (slc.get("rounds") or {}).items() if isinstance(v, int) and v}
    if not rounds:
        return "sparseloco: no rounds"
    parts = [f"{v} {k}" for k, v in rounds.items()]
    total = sum(rounds.values())
    text = (f"sparseloco: {total} round{'s' if total != 1 else ''} ({', '.join(parts)}), "
            f"{_int(slc, 'bytes_sent') or 0:,} bytes sent at {100 * (_num(slc, 'density') or 0):.2f}% density, "
            f"{_num(slc, 'wait_s') or 0:.1f}s waited")
    refused = sum(v for v in (slc.get("refused") or {}).values() if isinstance(v, int))
    if refused:
        text += f", {refused} fragment(s) refused"
    evidence = {k: v for k, v in (slc.get("evidence") or {}).items() if isinstance(v, int) and v}
    if evidence:
        text += ", evidence reported: " + ", ".join(f"{v} {k}" for k, v in sorted(evidence.items()))
    if _int(slc, "anchor_mismatches"):
        text += f", parted from the stage {_int(slc, 'anchor_mismatches')} time(s)"
    return text


def _averaging(a: Any) -> str:
    if not isinstance(a, dict):
        return ""
    counters = a.get("counters") if isinstance(a.get("counters"), dict) else {}
    rounds = {k.removeprefix("rounds_"): v for k, v in counters.items()
              if k.startswith("rounds_") and isinstance(v, int) and v}
    if not rounds:
        return "averaging: no rounds"
    order = ["complete", "partial", "failed", "skipped", "crashed"]
    parts = [f"{rounds[k]} {k}" for k in order if k in rounds]
    parts += [f"{v} {k}" for k, v in rounds.items() if k not in order]
    total = sum(rounds.values())
    text = f"averaging: {total} round{'s' if total != 1 else ''} ({', '.join(parts)})" + (
        ", as a reducer" if a.get("reducer") else "")
    evidence = {k: v for k, v in (a.get("evidence") or {}).items() if isinstance(v, int) and v}
    if evidence:
        text += ", evidence reported: " + ", ".join(f"{v} {k}" for k, v in sorted(evidence.items()))
    return text


def _staleness(st: Any) -> str:
    if not isinstance(st, dict) or not st.get("samples"):
        return ""
    parts = []
    mean_delay, max_delay, share = _num(st, "mean_delay"), _int(st, "max_delay"), _num(st, "delayed_share")
    if mean_delay is not None:
        parts.append(f"gradient delay {mean_delay:.2f} steps on average" + (
            f" (max {max_delay})" if max_delay is not None else ""))
    if share:
        parts.append(f"{share * 100:.0f}% of samples delayed")
    stale = _num(st, "stale_share")
    if stale:
        parts.append(f"{stale * 100:.0f}% stale")
    return "staleness: " + ", ".join(parts) if parts else ""


def _counts(counts: Any) -> str:
    """"97 no_workers, 12 timeout", largest first; nonzero integer entries only."""
    if not isinstance(counts, dict):
        return ""
    items = [(k, v) for k, v in counts.items() if isinstance(v, int) and v]
    return ", ".join(f"{v} {k}" for k, v in sorted(items, key=lambda kv: -kv[1]))


def _num(d: Any, key: str) -> Optional[float]:
    value = d.get(key) if isinstance(d, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(d: Any, key: str) -> Optional[int]:
    value = d.get(key) if isinstance(d, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def process_uptime_s() -> Optional[float]:
    """How long this process has run, or None if the system will not say."""
    import time

    import psutil

    try:
        return max(0.0, time.time() - psutil.Process().create_time())
    except psutil.Error:
        return None
