"""Attacks on a worker's compute, patched into `StageRuntime` from outside (tests and benchmarks
only): what a cheating worker sends is altered, while the worker's own training state (its
weights, accumulated gradients, kept activations, step ledger) stays honest.

Every result a worker sends comes out of four `StageRuntime` methods, on both routing paths:
the handlers (roles/worker/serving/handlers.py: forward, backward, evaluate) and the chain handler
(roles/worker/serving/chain.py: its forward, its backward, the tail's fused backward) all queue
work for the compute thread, which calls `_forward_batch` (forward outputs, kept or not),
`_backward_batch` (recomputed backwards and the tail's loss) or `_backward_through` (backwards
through kept activations), all three defined on the runtime's `BatchCompute` part
(roles/worker/serving/batches.py); held-out evaluations call `evaluate` in a thread of their own.
The compute loop looks these methods up on the instance at every batch, so wrapping them on the
class that defines them reaches every runtime, including one built before `install`.

Not altered: what else a worker sends that is not a sample's result. The weight version in its
replies stays the one the honest forward saw (a `stale:N` worker claims its current weights),
and its state served to joining replicas and its averaging and gradient-exchange contributions
are its honest training state, but for the two attacks on averaging: `sloco_scale:K` sends, in
every SparseLoCo round, its pseudo-gradient fragment times K, compressed and signed as the honest
one would be (the capture, roles/worker/sparseloco/outer.py `SparseLoCoState.capture`, is wrapped
to compress the scaled lie beside the honest fragment, and the service's `encode_fragment` signs
the lie in its place). Its own anchor, error buffer and applied update stay honest.
`spart_scale:K` sends, in every AsyncSPARTA round, each all-reduce part it sends another reducer
times K, sealed as the honest one would be (the averager process's runner,
roles/worker/averaging/allreduce.py `InstrumentedRunner`, is wrapped to scale its outgoing parts
before the round starts; the seal covers what is sent). The slice it reduces itself, and the
average it applies, stay honest. It counts rounds, in the averager process (whose log lines go to
the node's log; the total at stop is the worker process's, which never counts them).

The alterations are out of place: a forward's output rows can share storage with the graph kept
for its backward, and must not change under it.

The attack specs and their directions are listed in tests/support/adversary_node.py.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import threading
from typing import Callable, Iterator, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

FORWARD, GRAD, LOSS, FRAGMENT, PART = "forward", "grad", "loss", "fragment", "part"
"""Directions: forward outputs (and held-out coordinates), input gradients sent backwards,
losses reported by the tail (in backward replies and held-out evaluations), SparseLoCo fragments
sent to the stage's other replicas, AsyncSPARTA all-reduce parts sent to its reducers."""

NOISE_SEED = 0x5EED
BIAS_SEED = 0xB1A5
LOG_EVERY_SAMPLES = 100


class Attack:
    """One `--attack` spec: which samples it cheats on (`every`), whether it also answers
    held-out evaluations falsely (`evaluations`), and how many samples it altered."""

    direction: str

    def __init__(self, spec: str, *, every: int = 1, evaluations: bool = True):
        self.spec = spec
        self.every = every
        self.evaluations = evaluations
        self.altered = 0
        self._seen = 0
        self._lock = threading.Lock()
        """Forwards run on the compute thread, evaluations beside it: counters and RNGs are shared."""

    def chosen(self, n: int) -> list[bool]:
        """Which of the next `n` samples of this attack's direction to cheat on: the first of
        every `every`, by a counter over the process's life."""
        with self._lock:
            picks = [(self._seen + i) % self.every == 0 for i in range(n)]
            self._seen += n
        return picks

    def count(self, n: int) -> None:
        """Record `n` altered samples; log the first and then one line per 100."""
        if n <= 0:
            return
        with self._lock:
            before, self.altered = self.altered, self.altered + n
            total = self.altered
        if before == 0 or before // LOG_EVERY_SAMPLES != total // LOG_EVERY_SAMPLES:
            logger.info("adversary: altered %d samples (%s)", total, self.spec)


class OutputAttack(Attack):
    direction = FORWARD

    def alter(self, ctx: "ForwardContext", rows: list[torch.Tensor], chosen: list[bool]) -> list[torch.Tensor]:
        """New rows for the chosen samples (others as they are); counts what it changed."""
        out = list(rows)
        for i, pick in enumerate(chosen):
            if pick:
                out[i] = self.alter_row(rows[i].float()).to(rows[i].dtype)
        self.count(sum(chosen))
        return out

    def alter_row(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Scale(OutputAttack):
    def __init__(self, spec: str, k: float, **modifiers):
        super().__init__(spec, **modifiers)
        self.k = k

    def alter_row(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class Noise(OutputAttack):
    """Gaussian noise of std(output)/SNR, per sample, from a seeded generator (reproducible runs)."""

    def __init__(self, spec: str, snr: float, **modifiers):
        super().__init__(spec, **modifiers)
        self.snr = snr
        self._rng = torch.Generator().manual_seed(NOISE_SEED)

    def alter_row(self, x: torch.Tensor) -> torch.Tensor:
        with self._lock:
            noise = torch.randn(x.shape, generator=self._rng)
        return x + noise.to(x.device) * (x.std() / self.snr)


class Bias(OutputAttack):
    """A fixed unit direction u of the boundary's coordinate space added at every position, scaled
    so that the added tensor's RMS is EPS times the output's (EPS * RMS * sqrt(rank) * u): a size
    relative to the output like noise's 1/SNR, the same for any rank."""

    def __init__(self, spec: str, eps: float, **modifiers):
        super().__init__(spec, **modifiers)
        self.eps = eps
        self._directions: dict[int, torch.Tensor] = {}

    def direction_for(self, rank: int) -> torch.Tensor:
        if rank not in self._directions:
            u = torch.randn(rank, generator=torch.Generator().manual_seed(BIAS_SEED))
            self._directions[rank] = u / u.norm()
        return self._directions[rank]

    def alter_row(self, x: torch.Tensor) -> torch.Tensor:
        rank = x.shape[-1]
        rms = x.pow(2).mean().sqrt()
        return x + self.direction_for(rank).to(x.device) * (self.eps * rms * math.sqrt(rank))


class Swap(OutputAttack):
    """Another sample's output: the batch rolled by one; a batch of one gets the previous batch's
    last honest output of the same shape (none yet: sent honestly, not counted)."""

    def alter(self, ctx: "ForwardContext", rows: list[torch.Tensor], chosen: list[bool]) -> list[torch.Tensor]:
        out = list(rows)
        n = len(rows)
        altered = 0
        for i, pick in enumerate(chosen):
            if not pick:
                continue
            other = ctx.honest[i - 1] if n > 1 else ctx.previous_output(tuple(rows[i].shape))
            if other is not None:
                out[i] = other.to(rows[i].dtype).clone()
                altered += 1
        self.count(altered)
        return out


class Stale(OutputAttack):
    """A replay on old weights: the chosen samples' outputs computed again with the stage's
    weights of `steps` optimizer steps ago (the oldest kept, until that many steps were taken).
    Not counted while those are the current weights."""

    def __init__(self, spec: str, steps: int, **modifiers):
        super().__init__(spec, **modifiers)
        self.steps = steps

    def alter(self, ctx: "ForwardContext", rows: list[torch.Tensor], chosen: list[bool]) -> list[torch.Tensor]:
        replay = ctx.replay(self.steps)
        if replay is None:
            return rows
        out = [replay[i].to(rows[i].dtype) if pick else rows[i] for i, pick in enumerate(chosen)]
        self.count(sum(chosen))
        return out


class GradAttack(Attack):
    direction = GRAD

    def __init__(self, spec: str, flip: bool, **modifiers):
        super().__init__(spec, **modifiers)
        self.flip = flip

    def alter_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return -grad if self.flip else torch.zeros_like(grad)


class LossAttack(Attack):
    direction = LOSS

    def __init__(self, spec: str, *, factor: Optional[float] = None, const: Optional[float] = None, **modifiers):
        super().__init__(spec, **modifiers)
        self.factor, self.const = factor, const

    def alter_loss(self, loss: float) -> float:
        return float(self.const) if self.const is not None else float(loss) * self.factor


class FragmentScale(Attack):
    """SparseLoCo: the pseudo-gradient fragment sent, times K before compression (then signed)."""

    direction = FRAGMENT

    def __init__(self, spec: str, k: float, **modifiers):
        super().__init__(spec, **modifiers)
        self.k = k
        self._lies: dict[int, object] = {}
        """The lie to send in place of each honest capture's fragment, by id of the honest one."""

    def after_capture(self, pseudo_gradient: torch.Tensor, cap) -> None:
        """Compress `pseudo_gradient` (what the honest capture compressed) times K as this capture's lie."""
        from roles.worker.sparseloco.codec import compress

        if self.chosen(1)[0]:
            with self._lock:
                self._lies[id(cap.own)] = compress(pseudo_gradient * self.k, cap.fragment, cap.own.bits)

    def lie_for(self, own):
        with self._lock:
            lie = self._lies.pop(id(own), None)
        if lie is not None:
            self.count(1)
        return lie


class PartScale(Attack):
    """AsyncSPARTA: every all-reduce part sent to another reducer, times K (then sealed)."""

    direction = PART

    def __init__(self, spec: str, k: float, **modifiers):
        super().__init__(spec, **modifiers)
        self.k = k

    def before_round(self, runner) -> None:
        """Scale the parts `runner` (a new round's InstrumentedRunner) will send, if this round is chosen."""
        if self.chosen(1)[0]:
            k = self.k
            runner.map_outgoing_parts(lambda part: part.mul_(k))
            self.count(1)


def _number(name: str, value: Optional[str], cast: Callable = float, positive: bool = False):
    what = "an integer" if cast is int else "a number"
    if value is None:
        raise ValueError(f"{name} needs a value: {name}:NUMBER")
    try:
        number = cast(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {value!r} is not {what}") from exc
    if not math.isfinite(number) or (positive and number <= 0):
        raise ValueError(f"{name}: the value must be {'a positive' if positive else 'a'} finite {what.split()[-1]}")
    return number


def parse_attack(spec: str) -> Attack:
    """`KIND[:VALUE][,every:N][,eval:0|1]` -> an Attack; ValueError naming the fix otherwise."""
    try:
        return _parse(spec)
    except ValueError as exc:
        raise ValueError(f"attack '{spec}': {exc} (see tests/support/adversary_node.py)") from exc


def _parse(spec: str) -> Attack:
    kind, _, value = spec.strip().split(",")[0].partition(":")
    value = value or None
    modifiers = {}
    for part in spec.split(",")[1:]:
        key, _, arg = part.strip().partition(":")
        if key == "every":
            modifiers["every"] = _number("every", arg or None, int, positive=True)
        elif key == "eval" and arg in ("0", "1"):
            modifiers["evaluations"] = arg == "1"
        else:
            raise ValueError(f"unknown modifier '{part}' (every:N or eval:0|1)")
    if kind in ("zero_grad", "flip_grad", "swap") and value is not None:
        raise ValueError(f"{kind} takes no value")
    builders: dict[str, Callable[[], Attack]] = {
        "scale": lambda: Scale(spec, _number(kind, value), **modifiers),
        "noise": lambda: Noise(spec, _number(kind, value, positive=True), **modifiers),
        "bias": lambda: Bias(spec, _number(kind, value), **modifiers),
        "swap": lambda: Swap(spec, **modifiers),
        "stale": lambda: Stale(spec, _number(kind, value, int, positive=True), **modifiers),
        "zero_grad": lambda: GradAttack(spec, False, **modifiers),
        "flip_grad": lambda: GradAttack(spec, True, **modifiers),
        "loss": lambda: LossAttack(spec, factor=_number(kind, value), **modifiers),
        "loss_const": lambda: LossAttack(spec, const=_number(kind, value), **modifiers),
        "sloco_scale": lambda: FragmentScale(spec, _number(kind, value, positive=True), **modifiers),
        "spart_scale": lambda: PartScale(spec, _number(kind, value, positive=True), **modifiers),
    }
    if kind not in builders:
        raise ValueError(f"unknown attack '{kind}'; one of {', '.join(builders)}")
    return builders[kind]()


@dataclasses.dataclass
class ForwardContext:
    """What a batch's output attacks may look at besides its rows."""

    adversary: "Adversary"
    runtime: object
    requests: list
    honest: list[torch.Tensor]
    _replays: dict = dataclasses.field(default_factory=dict)

    def previous_output(self, shape: tuple) -> Optional[torch.Tensor]:
        return self.adversary.previous.get(shape)

    def replay(self, steps: int) -> Optional[list[torch.Tensor]]:
        """The batch's outputs on the weights of `steps` steps ago, or None if those are current."""
        if steps not in self._replays:
            self._replays[steps] = self.adversary.replay(self.runtime, self.requests, steps)
        return self._replays[steps]


class Adversary:
    """The attacks' state in one runtime: the last honest output per shape (swap) and a ring of
    CPU copies of the stage weights by version (stale), filled after every optimizer step and
    whenever a forward finds the step moved otherwise (a jump, a loaded state)."""

    def __init__(self, runtime, attacks: Sequence[Attack], installation: int):
        self.attacks = list(attacks)
        self.installation = installation
        self.previous: dict[tuple, torch.Tensor] = {}
        depth = max((a.steps for a in attacks if isinstance(a, Stale)), default=0)
        self._weights: collections.deque = collections.deque(maxlen=depth + 1)
        self._lock = threading.Lock()
        if depth and runtime.kind != "tail":
            self.remember(runtime)
            runtime.after_step.append(lambda step: self.remember(runtime))
        logger.info("adversary: %s on this stage-%d %s worker", ", ".join(a.spec for a in self.attacks),
                    runtime.stage, runtime.kind)
        idle = {FORWARD: runtime.kind == "tail", GRAD: runtime.kind == "head", LOSS: runtime.kind != "tail",
                FRAGMENT: False, PART: False}
        for attack in self.attacks:
            if idle[attack.direction]:
                logger.warning("adversary: %s alters %s, which a %s stage does not send: it does nothing here",
                               attack.spec, {FORWARD: "forward outputs", GRAD: "input gradients",
                                             LOSS: "losses", FRAGMENT: ""}[attack.direction], runtime.kind)

    # ---- stale weights ----

    def remember(self, runtime) -> None:
        opt = runtime.optimizer
        with opt.lock:  # reentrant: after_step hooks run with it held
            version = opt.local_step
            with self._lock:
                if self._weights and self._weights[-1][0] == version:
                    return
            state = {k: v.detach().to("cpu", copy=True) for k, v in runtime.model.state_dict().items()}
        with self._lock:
            self._weights.append((version, state))

    def replay(self, runtime, requests: list, steps: int) -> Optional[list[torch.Tensor]]:
        current = runtime.optimizer.local_step
        self.remember(runtime)  # a no-op unless the step moved without a step of ours
        with self._lock:
            old = [entry for entry in self._weights if entry[0] <= current - steps]
            version, state = old[-1] if old else self._weights[0]
        if version == current:
            return None
        state = {k: v.to(runtime.device) for k, v in state.items()}
        tokens, coords = runtime._inputs(requests)
        with torch.no_grad(), runtime._autocast():
            out = torch.func.functional_call(runtime.model, state, (coords, tokens))
        return list(out.detach().to(runtime.wire_dtype).cpu().unbind(0))

    # ---- the three directions ----

    def forward_outputs(self, runtime, rows: list[torch.Tensor], requests: list, *, evaluation: bool
                        ) -> list[torch.Tensor]:
        ctx = ForwardContext(self, runtime, requests, list(rows))
        for attack in self.attacks:
            if attack.direction == FORWARD and (attack.evaluations or not evaluation):
                chosen = attack.chosen(len(rows))
                if any(chosen):
                    rows = attack.alter(ctx, rows, chosen)
        if ctx.honest:
            last = ctx.honest[-1]
            self.previous[tuple(last.shape)] = last.clone()
        return rows

    def backward_results(self, results: list) -> list:
        for attack in self.attacks:
            if attack.direction == GRAD:
                results = _alter_field(attack, results, "grad_input", attack.alter_grad)
            elif attack.direction == LOSS:
                results = _alter_field(attack, results, "loss", attack.alter_loss)
        return results

    def evaluation(self, runtime, request, reply):
        if reply.coords is not None:
            [coords] = self.forward_outputs(runtime, [reply.coords], [request], evaluation=True)
            if coords is not reply.coords:
                reply = reply.model_copy(update={"coords": coords})
        if reply.loss is not None:
            loss = reply.loss
            for attack in self.attacks:
                if attack.direction == LOSS and attack.evaluations and attack.chosen(1)[0]:
                    loss = attack.alter_loss(loss)
                    attack.count(1)
            if loss != reply.loss:
                reply = reply.model_copy(update={"loss": loss})
        if reply.grad_input is not None:  # a spot check re-executing a backward
            grad = reply.grad_input
            for attack in self.attacks:
                if attack.direction == GRAD and attack.evaluations and attack.chosen(1)[0]:
                    grad = attack.alter_grad(grad)
                    attack.count(1)
            if grad is not reply.grad_input:
                reply = reply.model_copy(update={"grad_input": grad})
        return reply


def _alter_field(attack: Attack, results: list, name: str, alter: Callable) -> list:
    """`results` (BackwardResults) with `name` altered on the chosen ones of those that carry it."""
    carrying = [i for i, r in enumerate(results) if getattr(r, name) is not None]
    picks = attack.chosen(len(carrying))
    out = list(results)
    for i, pick in zip(carrying, picks):
        if pick:
            out[i] = dataclasses.replace(results[i], **{name: alter(getattr(results[i], name))})
    attack.count(sum(picks))
    return out


# ---- the patches ----

_ATTACKS: list[Attack] = []
_ORIGINALS: dict[str, Callable] = {}
_INSTALLATIONS = itertools.count(1)
_installation = 0
"""Which `install` the patches are from: a runtime that outlived an earlier one gets new state."""
_CREATING = threading.Lock()


def _adversary(runtime) -> Adversary:
    """The runtime's Adversary, made at its first patched call (the compute thread or an
    evaluation thread, whichever comes first)."""
    adversary = runtime.__dict__.get("_adversary")
    if adversary is None or adversary.installation != _installation:
        with _CREATING:
            adversary = runtime.__dict__.get("_adversary")
            if adversary is None or adversary.installation != _installation:
                adversary = runtime.__dict__["_adversary"] = Adversary(runtime, _ATTACKS, _installation)
    return adversary


def _forward_batch(self, requests):
    adversary = _adversary(self)  # before the forward: a stale ring starts at these weights
    rows = _ORIGINALS["_forward_batch"](self, requests)
    return adversary.forward_outputs(self, rows, requests, evaluation=False)


def _backward_batch(self, requests, *args, **kwargs):
    return _adversary(self).backward_results(_ORIGINALS["_backward_batch"](self, requests, *args, **kwargs))


def _backward_through(self, kept, requests):
    return _adversary(self).backward_results(_ORIGINALS["_backward_through"](self, kept, requests))


def _evaluate(self, request):
    adversary = _adversary(self)
    return adversary.evaluation(self, request, _ORIGINALS["evaluate"](self, request))


def _stop(self, *args, **kwargs):
    leftover = _ORIGINALS["stop"](self, *args, **kwargs)
    for attack in _ATTACKS:
        logger.info("adversary: altered %d samples (%s) in all", attack.altered, attack.spec)
    return leftover


def _capture(self, round_id, fragment, weights, *, beta, bits):
    # the pseudo-gradient the honest capture compresses, before it changes the error buffer
    pseudo = self.error[fragment.start:fragment.end] * beta + self.anchor[fragment.start:fragment.end] - weights
    cap = _ORIGINALS["SparseLoCoState.capture"](self, round_id, fragment, weights, beta=beta, bits=bits)
    for attack in _ATTACKS:
        if attack.direction == FRAGMENT:
            attack.after_capture(pseudo, cap)
    return cap


def _encode_fragment(c, envelope, identity):
    for attack in _ATTACKS:
        if attack.direction == FRAGMENT:
            c = attack.lie_for(c) or c
    return _ORIGINALS["service.encode_fragment"](c, envelope, identity)


def _runner_init(self, *args, **kwargs):
    _ORIGINALS["InstrumentedRunner.__init__"](self, *args, **kwargs)
    for attack in _ATTACKS:
        if attack.direction == PART:
            attack.before_round(self)


_PATCHES = {"_forward_batch": _forward_batch, "_backward_batch": _backward_batch,
            "_backward_through": _backward_through, "evaluate": _evaluate, "stop": _stop}


def _targets() -> list[tuple[object, str, str, Callable]]:
    """(owner, attribute, key in _ORIGINALS, patch) of every patch."""
    from roles.worker.averaging.allreduce import InstrumentedRunner
    from roles.worker.serving.batches import BatchCompute
    from roles.worker.serving.runtime import StageRuntime
    from roles.worker.sparseloco import service
    from roles.worker.sparseloco.outer import SparseLoCoState

    owners = {"_forward_batch": BatchCompute, "_backward_batch": BatchCompute, "_backward_through": BatchCompute,
              "evaluate": StageRuntime, "stop": StageRuntime}
    return [*((owners[name], name, name, patch) for name, patch in _PATCHES.items()),
            (SparseLoCoState, "capture", "SparseLoCoState.capture", _capture),
            (service, "encode_fragment", "service.encode_fragment", _encode_fragment),
            (InstrumentedRunner, "__init__", "InstrumentedRunner.__init__", _runner_init)]


def install(attacks: Sequence[Attack]) -> None:
    """Wrap StageRuntime's result-producing methods, SparseLoCo's capture, the SparseLoCo
    service's fragment encoding and the AsyncSPARTA runner's construction with `attacks`, applied
    in order."""
    if _ORIGINALS:
        raise RuntimeError("the adversary is already installed; uninstall it first")
    targets = _targets()
    for owner, name, key, _ in targets:
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(f"{key} is gone: tests/support/adversary.py needs updating")
    for owner, name, key, patch in targets:
        _ORIGINALS[key] = owner.__dict__[name]
        setattr(owner, name, patch)
    global _installation
    _installation = next(_INSTALLATIONS)
    _ATTACKS[:] = attacks


def uninstall() -> None:
    for owner, name, key, _ in _targets():
        if key in _ORIGINALS:
            setattr(owner, name, _ORIGINALS[key])
    _ORIGINALS.clear()
    _ATTACKS.clear()


@contextlib.contextmanager
def installed(*specs: str) -> Iterator[list[Attack]]:
    """The attacks of `specs` patched in for a `with` block (in-process tests); yields them."""
    attacks = [parse_attack(spec) for spec in specs]
    install(attacks)
    try:
        yield attacks
    finally:
        uninstall()
