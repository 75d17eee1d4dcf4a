"""Held-out evaluation during the run (run config `evaluation:`).

Trainer 0 evaluates: the trainer whose data shard is 0 of n (`--shard-index 0`, the default), so a
run has one evaluator without electing one, and the held-out loss comes from one fixed sample set.
Every `evaluation.every_steps` stage steps (and at the first step it sees, for a baseline) it
sends `evaluation.samples` held-out samples (corpus/heldout.py) forward through the live stages
with `agora/v1/evaluate`: no backward, no step tag, nothing any worker counts towards a step or
an optimizer. The stage step is what the tail tagged this trainer's samples with (the highest tag
seen), so an evaluation is reported at the step whose multiple it crossed, not at a trainer clock.

An evaluation runs in the background beside the lanes, one at a time, a few samples in flight;
a sample whose hop fails on every worker tried is left out and counted. The result (mean loss
over samples, its standard error, perplexity exp(loss), the step, samples used, seconds) goes to
the trainer's metrics, its DHT record (hence `agora-node status` and the dashboard) and its
summary.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from corpus.heldout import HeldOutUnavailable, packed_heldout, prepared_heldout, prepared_heldout_missing
from corpus.sample import Sample
from corpus.shards import PreparedCorpus, is_prepared_location
from corpus.tokenizers import load_tokenizer
from protocol.run_config import EvaluationConfig
from roles.trainer.data import SyntheticCorpus
from roles.trainer.pipeline import EvaluatedSample, PipelineDriver, SampleDropped

logger = logging.getLogger(__name__)

SAMPLES_IN_FLIGHT = 4
"""Held-out samples an evaluation keeps in flight: enough to hide a hop's latency, few enough that
the lanes' samples hardly wait behind them."""
RESULTS_KEPT = 1000
"""Evaluations kept for the summary; the first (the baseline) always stays."""

HeldOutLoader = Callable[[], list[Sample]]


def heldout_loader(data: str, *, tokenizer_path: Optional[str], seq_len: int, seed: int, count: int,
                   data_dir: str, corpus: Optional[PreparedCorpus] = None) -> tuple[HeldOutLoader, str]:
    """How this trainer's held-out samples are loaded (blocking: call the loader in a thread), and
    a description of them. `data` is what the trainer trains on; `corpus`, its prepared corpus if
    already opened. Raises HeldOutUnavailable when the data has no held-out split."""
    if is_prepared_location(data):
        prepared = corpus if corpus is not None else PreparedCorpus(data)
        missing = prepared_heldout_missing(prepared, seq_len)
        if missing is not None:
            raise HeldOutUnavailable(missing)
        cache = Path(data_dir).expanduser() / prepared.sha256[:16]
        return (lambda: prepared_heldout(prepared, seq_len, count, cache),
                f"the held-out split of {prepared.location}")
    if data == "synthetic":
        # A seed of its own: the training stream's seed is an int, so no training document is drawn this way.
        source = SyntheticCorpus(f"heldout:{seed}")
        return (lambda: packed_heldout(source.iter_text(), load_tokenizer(tokenizer_path), seq_len, count),
                f"{source.name} text")
    raise HeldOutUnavailable(f"{data} is plain text with no held-out split; prepare it with `agora-node data "
                             "prepare` (which holds documents out) to evaluate on it")


@dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation: the mean over samples of each sample's mean next-token loss (all
    samples have the same length, so this is the token-weighted mean too)."""

    step: int
    """The stage step it was due at: the highest step tag this trainer had seen when it started."""
    loss: float
    perplexity: float
    stderr: Optional[float]
    """The standard error of `loss` over the samples (their losses' standard deviation over the
    square root of their count): how far another draw of as many held-out samples could put it.
    None with a single sample."""
    samples: int
    """Held-out samples that got through every stage."""
    dropped: int
    seconds: float
    versions: tuple[int, int]
    """The lowest and highest weight version (steps applied) of the tail the samples met: the stages
    go on stepping while an evaluation runs."""

    def as_json(self) -> dict:
        return {"step": self.step, "loss": round(self.loss, 6), "perplexity": round(self.perplexity, 4),
                "stderr": None if self.stderr is None else round(self.stderr, 6),
                "samples": self.samples, "dropped": self.dropped, "seconds": round(self.seconds, 3),
                "versions": list(self.versions)}


def standard_error(values: list[float]) -> Optional[float]:
    """The standard error of the mean of `values`; None for fewer than two."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class HeldOutEvaluator:
    """Schedules and runs the evaluations of one trainer. Event-loop only: `saw_step` is called by
    the lanes with each completed sample's step tag, and starts an evaluation when one is due."""

    def __init__(self, config: EvaluationConfig, driver: PipelineDriver, load: HeldOutLoader, *,
                 on_result: Optional[Callable[["Evaluation"], None]] = None, in_flight: int = SAMPLES_IN_FLIGHT):
        if config.every_steps < 1:
            raise ValueError("evaluation is off (every_steps 0): build no evaluator")
        self.every_steps = config.every_steps
        self.samples_wanted = config.samples
        self.driver = driver
        self._load = load
        self.on_result = on_result
        self.in_flight = in_flight
        self.results: list[Evaluation] = []
        self.evaluations = 0
        """Evaluations that produced a result (`results` keeps only the last RESULTS_KEPT)."""
        self.failed = 0
        """Evaluations that gave no result: no sample got through, or the samples could not be loaded."""
        self.highest_step: Optional[int] = None
        self._next_due = 0
        self._samples: Optional[list[Sample]] = None
        self._task: Optional[asyncio.Task] = None
        self._off: Optional[str] = None
        """Why evaluation stopped for good (the data has no held-out samples after all)."""
        self._closed = False

    @property
    def latest(self) -> Optional[Evaluation]:
        return self.results[-1] if self.results else None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def saw_step(self, step: Optional[int]) -> None:
        """A sample completed with step tag `step`: start an evaluation if one is due and none runs."""
        if step is None:
            return
        self.highest_step = step if self.highest_step is None else max(self.highest_step, step)
        if self.running or self._closed or self._off is not None or self.highest_step < self._next_due:
            return
        self._start(self.highest_step)

    def _start(self, step: int) -> None:
        self._next_due = (step // self.every_steps + 1) * self.every_steps
        self._task = asyncio.create_task(self._evaluate(step), name="evaluation")

    async def conclude(self, stop: asyncio.Event, timeout_s: float) -> None:
        """Training ended on its own (`--max-samples`): let the running evaluation finish, then take
        one more at the last step seen unless that step was evaluated already. Gives up (cancels)
        after `timeout_s` or when `stop` is set."""
        deadline = time.monotonic() + timeout_s
        if self.running and not await self._wait(stop, deadline):
            return
        latest = self.latest
        if (self._off is None and not self._closed and self.highest_step is not None
                and (latest is None or latest.step < self.highest_step)):
            self._start(self.highest_step)
            await self._wait(stop, deadline)

    async def _wait(self, stop: asyncio.Event, deadline: float) -> bool:
        stopped = asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait([self._task, stopped], timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if self._task in done:
            return True
        logger.info("held-out evaluation cancelled: %s", "the trainer is stopping" if stop.is_set()
                    else "it did not finish in time")
        await self.close()
        return False

    async def close(self) -> None:
        """Cancel a running evaluation and start none after it (the trainer is stopping). Idempotent."""
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _evaluate(self, step: int) -> None:
        try:
            await self._run(step)
        except Exception:  # a bug must cost one evaluation, logged, not go unnoticed in a task
            self.failed += 1
            logger.exception("held-out evaluation at step %d failed", step)

    async def _run(self, step: int) -> None:
        started = time.monotonic()
        try:
            samples = await self._heldout()
        except HeldOutUnavailable as exc:
            self._off = str(exc)
            logger.warning("held-out evaluation is off from now on: %s", exc)
            return
        except Exception as exc:  # noqa: BLE001 - a shard fetch that failed: the next evaluation tries again
            self.failed += 1
            logger.warning("could not load the held-out samples (%s: %s); trying again at the next evaluation",
                           type(exc).__name__, exc)
            return
        semaphore = asyncio.Semaphore(self.in_flight)
        dropped: collections.Counter[str] = collections.Counter()
        number = self.evaluations + self.failed

        async def one(index: int, sample: Sample) -> Optional[EvaluatedSample]:
            async with semaphore:
                try:
                    return await self.driver.evaluate_sample(f"eval{number}-{index}", sample.tokens)
                except SampleDropped as exc:
                    dropped[exc.reason] += 1
                    logger.debug("held-out sample %d left out of the evaluation at step %d: %s", index, step, exc)
                except Exception:  # a bug must cost one sample, not the evaluation
                    dropped["error"] += 1
                    logger.exception("held-out sample %d failed unexpectedly", index)
                return None

        answers = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
        used = [a for a in answers if a is not None]
        seconds = time.monotonic() - started
        if not used:
            self.failed += 1
            hint = ("" if "no_workers" in dropped else
                    "; workers of a release before agora/v1/evaluate cannot serve it")
            logger.warning("held-out evaluation at step %d: none of its %d samples got through the stages (%s)%s",
                           step, len(samples), ", ".join(f"{n} {why}" for why, n in dropped.most_common()), hint)
            return
        losses = [a.loss for a in used]
        loss = sum(losses) / len(losses)
        versions = [a.version for a in used]
        result = Evaluation(step=step, loss=loss, perplexity=perplexity(loss), stderr=standard_error(losses),
                            samples=len(used), dropped=len(samples) - len(used), seconds=seconds,
                            versions=(min(versions), max(versions)))
        self._record(result)
        logger.info("held-out loss %.4f%s (perplexity %.2f) at step %d: %d of %d samples in %.1fs", loss,
                    "" if result.stderr is None else f" +- {result.stderr:.4f}", result.perplexity, step,
                    result.samples, len(samples), seconds)

    async def _heldout(self) -> list[Sample]:
        if self._samples is None:
            samples = await asyncio.to_thread(self._load)
            if not samples:
                raise HeldOutUnavailable("the held-out data gave no sample")
            if len(samples) < self.samples_wanted:
                logger.info("held-out evaluation: the held-out split holds %d samples, fewer than "
                            "evaluation.samples (%d); every evaluation uses all of them", len(samples),
                            self.samples_wanted)
            self._samples = samples
        return self._samples

    def _record(self, result: Evaluation) -> None:
        self.results.append(result)
        if len(self.results) > RESULTS_KEPT:
            del self.results[1]
        self.evaluations += 1
        if self.on_result is not None:
            self.on_result(result)

    def summary(self) -> list[dict]:
        return [r.as_json() for r in self.results]
