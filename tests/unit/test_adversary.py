"""The adversary harness (tests/support/adversary.py) alters exactly what each attack says, in a
StageRuntime built as a worker builds it, and leaves the worker's own training state honest.

Each test computes the honest result first (nothing patched), then the same request again with
the attack installed: the weights do not move in between, so the two differ only by the attack."""

from __future__ import annotations

import asyncio
import copy
import logging
import threading

import pytest
import torch

from protocol.messages import BackwardRequest, EvaluateRequest, ForwardRequest
from protocol.run_config import load_run_config
from roles.model.stage import StageModel
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.serving.queues import TaskKind, TaskQueues
from roles.worker.serving.runtime import StageRuntime
from roles.worker.steps.step_ledger import StepLedger
from tests.support.adversary import installed, parse_attack
from tests.support.adversary_node import adversary_prefix, split_argv

pytestmark = pytest.mark.timeout(60)

RUN = load_run_config("tiny", {"target_batch_size": 64})
HEAD, BODY, TAIL = 0, 1, RUN.num_stages - 1


def make_runtime(stage: int, run=RUN, **options) -> StageRuntime:
    model = StageModel(run, stage)
    optimizer = StageOptimizer.for_stage(run, stage, model.trainable_parameters(), "cpu")
    ledger = StepLedger(run.target_batch_size, assigns=model.kind == "tail")
    return StageRuntime(model, optimizer, TaskQueues(64), stage=stage, vocab_size=run.model.vocab_size,
                        max_seq_len=run.model.max_seq_len, device=torch.device("cpu"), ledger=ledger, **options)


def tokens(i: int) -> torch.Tensor:
    return torch.randint(0, RUN.model.vocab_size, (RUN.seq_len,), generator=torch.Generator().manual_seed(i))


def coords(i: int) -> torch.Tensor:
    return torch.randn(RUN.seq_len, RUN.model.subspace_rank, generator=torch.Generator().manual_seed(1000 + i)) * 0.1


def forward(stage: int, i: int) -> ForwardRequest:
    return ForwardRequest(stage=stage, sample_id=f"s{i}", tokens=tokens(i), coords=None if stage == HEAD else coords(i))


def backward(stage: int, i: int, step=0) -> BackwardRequest:
    if stage == TAIL:
        return BackwardRequest(stage=stage, sample_id=f"s{i}", tokens=tokens(i), coords=coords(i))
    return BackwardRequest(stage=stage, sample_id=f"s{i}", tokens=tokens(i),
                           coords=None if stage == HEAD else coords(i), grad_output=coords(2000 + i), step=step)


def evaluation(stage: int, i: int) -> EvaluateRequest:
    return EvaluateRequest(stage=stage, sample_id=f"e{i}", tokens=tokens(i),
                           coords=None if stage == HEAD else coords(i))


def rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def test_scale_multiplies_every_forward_output():
    runtime = make_runtime(BODY)
    requests = [forward(BODY, i) for i in range(3)]
    honest = runtime._forward_batch(requests)
    with installed("scale:3") as [attack]:
        out = runtime._forward_batch(requests)
    for got, ref in zip(out, honest):
        assert torch.equal(got, ref * 3)
    assert attack.altered == 3


def test_noise_has_the_asked_signal_to_noise_ratio_per_sample():
    runtime = make_runtime(BODY)
    requests = [forward(BODY, i) for i in range(4)]
    honest = runtime._forward_batch(requests)
    with installed("noise:4") as [attack]:
        out = runtime._forward_batch(requests)
    noises = [got - ref for got, ref in zip(out, honest)]
    for noise, ref in zip(noises, honest):
        assert float(noise.std()) == pytest.approx(float(ref.std()) / 4, rel=0.1)
    assert not torch.allclose(noises[0], noises[1])  # fresh noise for each sample
    assert attack.altered == 4


def test_bias_adds_one_fixed_direction_of_relative_size_eps():
    runtime = make_runtime(BODY)
    requests = [forward(BODY, i) for i in range(2)]
    honest = runtime._forward_batch(requests)
    with installed("bias:0.5"):
        out = runtime._forward_batch(requests)
    added = [got - ref for got, ref in zip(out, honest)]
    directions = []
    for bias, ref in zip(added, honest):
        torch.testing.assert_close(bias, bias[:1].expand_as(bias))  # the same vector at every position
        assert rms(bias) == pytest.approx(0.5 * rms(ref), rel=1e-4)
        directions.append(bias[0] / bias[0].norm())
    torch.testing.assert_close(directions[0], directions[1])


def test_swap_rolls_the_batch_and_a_batch_of_one_gets_the_previous_output():
    runtime = make_runtime(BODY)
    batch, single = [forward(BODY, i) for i in range(3)], [forward(BODY, 7)]
    honest = runtime._forward_batch(batch)
    with installed("swap") as [attack]:
        [alone] = runtime._forward_batch(single)  # nothing before it: sent honestly
        out = runtime._forward_batch(batch)
        [after] = runtime._forward_batch(single)
    assert torch.equal(alone, make_runtime(BODY)._forward_batch(single)[0])
    for i in range(3):
        assert torch.equal(out[i], honest[i - 1])
    assert torch.equal(after, honest[2])
    assert attack.altered == 4


def _take_step(runtime: StageRuntime, i: int) -> None:
    step = runtime.optimizer.local_step
    runtime._backward_batch([backward(HEAD, i, step=step)])
    runtime._maybe_step()
    assert runtime.optimizer.local_step == step + 1


def test_stale_replays_the_weights_of_n_steps_ago():
    runtime = make_runtime(HEAD, load_run_config("tiny", {"target_batch_size": 1}))
    models = []
    outputs = []
    with installed("stale:1") as [attack]:
        for i in range(3):
            models.append(copy.deepcopy(runtime.model))
            [out] = runtime._forward_batch([forward(HEAD, i)])
            outputs.append(out)
            _take_step(runtime, i)
    with torch.no_grad():
        on = [[m(None, tokens(i).unsqueeze(0))[0] for m in models] for i in range(3)]
    assert not torch.allclose(on[2][1], on[2][2]), "the steps moved the weights"
    torch.testing.assert_close(outputs[0], on[0][0])  # step 0: no older weights, honest
    torch.testing.assert_close(outputs[1], on[1][0])
    torch.testing.assert_close(outputs[2], on[2][1])
    assert attack.altered == 2


@pytest.mark.parametrize("spec", ["zero_grad", "flip_grad"])
def test_grad_attacks_alter_the_input_gradient_but_not_the_workers_own_gradients(spec):
    runtime = make_runtime(BODY)
    [honest] = runtime._backward_batch([backward(BODY, 0)])
    own = [p.grad.clone() for p in runtime.optimizer.params]
    with installed(spec) as [attack]:
        [result] = runtime._backward_batch([backward(BODY, 0)])
    expected = torch.zeros_like(honest.grad_input) if spec == "zero_grad" else -honest.grad_input
    assert torch.equal(result.grad_input, expected) and honest.grad_input.abs().sum() > 0
    for p, first in zip(runtime.optimizer.params, own):
        torch.testing.assert_close(p.grad, 2 * first)  # the same honest gradient accumulated twice
    assert attack.altered == 1


def test_attacks_apply_on_the_compute_thread_and_leave_kept_activations_honest():
    """Forwards and backwards queued as the handlers queue them; the backward runs through the
    forward's kept graph, which the scaled forward reply must not have touched."""
    runtime = make_runtime(BODY, kept_activations_bytes=1 << 28)
    reference = copy.deepcopy(runtime.model)
    results: dict[str, object] = {}
    done = threading.Condition()

    def callback(key):
        def on_done(result, exc):
            with done:
                results[key] = exc if exc is not None else result
                done.notify_all()
        return on_done

    def wait(keys):
        with done:
            assert done.wait_for(lambda: all(k in results for k in keys), 20), f"no reply for {keys}"
        return [results[k] for k in keys]

    with installed("scale:2", "flip_grad"):
        runtime.start()
        try:
            for i in range(2):
                runtime.submit(TaskKind.FORWARD, forward(BODY, i), callback(f"f{i}"))
            outs = wait(["f0", "f1"])
            for i in range(2):
                runtime.submit(TaskKind.BACKWARD, backward(BODY, i), callback(f"b{i}"))
            grads = [r.grad_input for r in wait(["b0", "b1"])]
        finally:
            runtime.stop(5)
    assert runtime.counters["backward_kept"] == 2, runtime.counters
    for i in range(2):
        c = coords(i).unsqueeze(0).requires_grad_(True)
        out = reference(c, tokens(i).unsqueeze(0))
        out.backward(coords(2000 + i).unsqueeze(0))
        torch.testing.assert_close(outs[i], 2 * out[0].detach())
        torch.testing.assert_close(grads[i], -c.grad[0])


@pytest.mark.parametrize("spec, expected", [("loss:2.5", lambda loss: 2.5 * loss),
                                            ("loss_const:0.5", lambda loss: 0.5)])
def test_loss_attacks_alter_the_tails_reported_loss_only(spec, expected):
    runtime = make_runtime(TAIL)
    [honest] = runtime._backward_batch([backward(TAIL, 0)], tag=0)
    with installed(spec) as [attack]:
        [result] = runtime._backward_batch([backward(TAIL, 0)], tag=0)
    assert result.loss == pytest.approx(expected(honest.loss)) and result.loss != honest.loss
    assert torch.equal(result.grad_input, honest.grad_input)
    assert attack.altered == 1


def test_every_n_cheats_on_one_sample_in_n_across_batches():
    runtime = make_runtime(BODY)
    batches = [[forward(BODY, i) for i in range(2)], [forward(BODY, i) for i in range(2, 5)]]
    honest = [row for batch in batches for row in runtime._forward_batch(batch)]
    with installed("scale:3,every:2") as [attack]:
        out = [row for batch in batches for row in runtime._forward_batch(batch)]
    assert [torch.equal(got, ref * 3) for got, ref in zip(out, honest)] == [True, False, True, False, True]
    assert [torch.equal(got, ref) for got, ref in zip(out, honest)] == [False, True, False, True, False]
    assert attack.altered == 3


def test_held_out_evaluations_are_altered_unless_eval_0():
    body, tail = make_runtime(BODY), make_runtime(TAIL)
    honest_coords = body.evaluate(evaluation(BODY, 0)).coords
    honest_loss = tail.evaluate(evaluation(TAIL, 0)).loss
    with installed("scale:3", "loss:2"):
        assert torch.equal(body.evaluate(evaluation(BODY, 0)).coords, honest_coords * 3)
        assert tail.evaluate(evaluation(TAIL, 0)).loss == pytest.approx(2 * honest_loss)
    body = make_runtime(BODY)
    with installed("scale:3,eval:0") as [attack]:
        assert torch.equal(body.evaluate(evaluation(BODY, 0)).coords, honest_coords)
        [out] = body._forward_batch([forward(BODY, 0)])
    assert torch.equal(out, body._forward_batch([forward(BODY, 0)])[0] * 3)
    assert attack.altered == 1


def test_counts_are_logged_first_then_per_hundred_and_in_all_at_stop(caplog):
    runtime, head = make_runtime(BODY), make_runtime(HEAD)
    with caplog.at_level(logging.INFO, logger="tests.support.adversary"), installed("scale:3", "flip_grad"):
        for start in range(0, 120, 40):
            runtime._forward_batch([forward(BODY, i) for i in range(start, start + 40)])
        runtime.stop(1)
        head._forward_batch([forward(HEAD, 0)])
    messages = [r.getMessage() for r in caplog.records]
    altered = [m for m in messages if m.startswith("adversary: altered")]
    assert altered == ["adversary: altered 40 samples (scale:3)", "adversary: altered 120 samples (scale:3)",
                       "adversary: altered 120 samples (scale:3) in all",
                       "adversary: altered 0 samples (flip_grad) in all"]
    assert any("flip_grad alters input gradients, which a head stage does not send" in m for m in messages)


@pytest.mark.parametrize("spec", ["scale", "scale:x", "noise:0", "stale:1.5", "stale:0", "swap:2", "flip_grad:1",
                                  "foo:1", "scale:3,every:0", "scale:3,bogus:1", "scale:inf", "loss_const",
                                  "sloco_scale:0", "sloco_scale", "spart_scale:-1", "spart_scale"])
def test_bad_specs_are_refused_with_a_reason(spec):
    with pytest.raises(ValueError) as refused:
        parse_attack(spec)
    assert spec.split(",")[0].split(":")[0] in str(refused.value)


def test_prefix_and_argv_split_bring_the_node_command_line_through():
    prefix = adversary_prefix("scale:3", "noise:1,every:10")
    assert prefix[0] == "env" and prefix[1].startswith("PYTHONPATH=") and prefix[-1] == "--"
    assert prefix[prefix.index("-m") + 1] == "tests.support.adversary_node"
    own, node = split_argv([*prefix[prefix.index("tests.support.adversary_node") + 1:], "/x/bin/python3", "-m",
                            "node.cli", "--role", "worker"])
    assert own == ["--attack", "scale:3", "--attack", "noise:1,every:10"] and node == ["--role", "worker"]
    with pytest.raises(ValueError, match="no '--'"):
        split_argv(["--attack", "scale:3"])
    with pytest.raises(ValueError, match="PYTHON -m node.cli"):
        split_argv(["--attack", "scale:3", "--", "python", "-m", "node.other"])
    with pytest.raises(ValueError):
        adversary_prefix("scale")


@pytest.mark.parametrize("spec", ["sloco_scale:100", "spart_scale:100"])
def test_an_averaging_liar_serves_the_pipeline_honestly(spec):
    """Its forwards, backwards and evaluations are an honest worker's (the first call of each once
    failed with a KeyError: every request of the liar's, so it served nothing)."""
    honest, lying = make_runtime(BODY), make_runtime(BODY)
    lying.model.load_state_dict(honest.model.state_dict())
    with installed(spec):
        [out] = lying._forward_batch([forward(BODY, 1)])
        [result] = lying._backward_batch([backward(BODY, 1)])
        reply = lying.evaluate(evaluation(BODY, 2))
    assert torch.equal(out, honest._forward_batch([forward(BODY, 1)])[0])
    assert torch.equal(result.grad_input, honest._backward_batch([backward(BODY, 1)])[0].grad_input)
    assert torch.equal(reply.coords, honest.evaluate(evaluation(BODY, 2)).coords)


def test_sloco_scale_signs_a_scaled_pseudo_gradient_and_keeps_its_own_state_honest():
    from protocol.identity import Identity
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from roles.worker.layout import FlatLayout
    from roles.worker.sparseloco import service
    from roles.worker.sparseloco.chunks import plan_fragments
    from roles.worker.sparseloco.codec import Envelope, compressed_norm, decode_fragment
    from roles.worker.sparseloco.outer import SparseLoCoState

    layout = FlatLayout(["w"], [(64, 64)])
    [frag] = plan_fragments(layout, chunk_size=512, topk=16, fragments=1)
    me = Identity(ed25519.Ed25519PrivateKey.generate(), "")
    envelope = Envelope("run", 0, 5, 0, layout.digest, 512, 16, 2, sender=me.peer_id.to_base58())
    start = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1))
    weights = start - torch.randn(layout.numel, generator=torch.Generator().manual_seed(2)) * 0.01

    def one_round():
        state = SparseLoCoState.starting_at(start)
        cap = state.capture(5, frag, weights.clone(), beta=0.95, bits=2)
        _, sent = decode_fragment(service.encode_fragment(cap.own, envelope, me), envelope, frag)
        return state, cap, compressed_norm(sent, frag)

    honest_state, honest_cap, honest_norm = one_round()
    with installed("sloco_scale:1000,every:2") as [attack]:
        state, cap, lie_norm = one_round()
        _, _, second = one_round()  # every:2 - the second round is sent honestly
    assert lie_norm == pytest.approx(1000 * honest_norm, rel=0.02) and second == pytest.approx(honest_norm)
    assert attack.altered == 1
    # what it keeps and applies is what an honest replica would
    assert torch.equal(state.error, honest_state.error) and cap.own_norm == honest_cap.own_norm
    assert service.encode_fragment.__module__ == "roles.worker.sparseloco.codec"  # uninstalled


def test_spart_scale_scales_the_parts_sent_to_other_reducers_and_keeps_its_own_slice_honest():
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from roles.worker.averaging.allreduce import InstrumentedRunner

    me, other = (PeerID.from_base58(p) for p in ("QmRnvt8BjCaCdpVzTFsKVCH4Dt5Q3NYVdVWmdvTovVxaBs",
                                                  "QmWQx2UQvKbRmvPKcDTyvW3PqUBK4crX9XrJfVUVqUkJ6S"))
    values = torch.arange(32, dtype=torch.float32)

    def parts(runner):
        sent = runner.tensor_part_container._input_parts_by_peer  # tests may look: what the round will send
        runner.tensor_part_reducer.finished.set()  # never run: not a reducer that lost its parts
        return [torch.cat([part for part, _ in sent[index]]) for index in range(2)]

    async def round_parts():
        """A runner is built inside a running loop, as the averager builds it: hivemind's parts
        container makes futures, which need one (none is current once another test's loop closed)."""
        return parts(InstrumentedRunner(p2p=SimpleNamespace(peer_id=me), servicer_type=InstrumentedRunner, prefix=None,
                                        group_id=b"g", tensors=[values.clone()], ordered_peer_ids=[me, other],
                                        peer_fractions=(0.5, 0.5), part_size_bytes=64))

    honest = asyncio.run(round_parts())
    with installed("spart_scale:1000,every:2") as [attack]:
        lying, second = asyncio.run(round_parts()), asyncio.run(round_parts())
    assert torch.equal(lying[1], honest[1] * 1000) and torch.equal(lying[0], honest[0]), "its own slice is honest"
    assert torch.equal(second[1], honest[1]), "every:2 - the second round is sent honestly"
    assert attack.altered == 1
    assert InstrumentedRunner.__init__.__module__ == "roles.worker.averaging.allreduce"  # uninstalled
