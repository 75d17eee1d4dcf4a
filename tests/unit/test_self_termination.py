"""The self-termination rules' evaluator (roles/worker/health/termination.py) [report 3.3.1.6]: each rule
fires on its cause and not otherwise, thresholds come from the run config, successes reset the
counts, and the rules table agrees with the exit codes."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from pydantic import ValidationError

from protocol.exit_codes import EXIT_CODES, ExitCode
from protocol.run_config import TerminationConfig, load_run_config
from roles.worker.health.round_health import RoundHealth
from roles.worker.errors import SelfTerminated, WorkerLeftStage
from roles.worker.health.termination import RULES, SelfTermination, averaging_health, is_device_fault

GIB = 2**30


def rules(**sections) -> SelfTermination:
    return SelfTermination(TerminationConfig.model_validate(sections), clock=lambda: 0.0)


def fired(evaluator: SelfTermination):
    return None if evaluator.firing is None else evaluator.firing.rule.name


def test_every_rule_has_its_own_documented_exit_code_and_a_sentence():
    codes = [rule.exit_code for rule in RULES]
    assert len(set(codes)) == len(codes)
    assert len({rule.name for rule in RULES}) == len(RULES)
    for rule in RULES:
        assert f"rule {rule.name}," in EXIT_CODES[rule.exit_code], "exit_codes.py must name the rule"
        assert rule.sentence and rule.sentence[0].islower() and not rule.sentence.endswith(".")
        assert rule.name in TerminationConfig.model_fields
    assert RULES[-1].exit_code == ExitCode.LEFT_STAGE == 3, "the averaging rule keeps exit code 3"


def test_the_run_config_carries_the_rules_and_refuses_unknown_keys():
    run = load_run_config("tiny", {"termination": {"connectivity": {"after_s": 7}, "host_memory": {
        "enabled": True, "max_bytes": "1000"}}})
    assert run.termination.connectivity.after_s == 7 and run.termination.host_memory.max_bytes == 1000
    assert load_run_config("tiny").termination == TerminationConfig()
    with pytest.raises(Exception):
        load_run_config("tiny", {"termination": {"connectivity": {"after": 7}}})
    with pytest.raises(ValidationError):
        TerminationConfig.model_validate({"host_memory": {"enabled": True, "max_fraction": None}})
    with pytest.raises(ValidationError):
        TerminationConfig.model_validate({"averaging": {"max_failures": 4, "window": 3}})


@pytest.mark.parametrize("exc, device", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"), True),
    (RuntimeError("NCCL communicator was aborted"), True),
    (RuntimeError("device-side assert triggered"), True),
    (torch.cuda.OutOfMemoryError("Tried to allocate 2.00 GiB"), True),
    (ValueError("shapes [3, 4] and [5] do not match"), False),
    (MemoryError("host out of memory"), False),
    (KeyError("layer.3.weight"), False),
])
def test_device_faults_are_told_from_bugs(exc, device):
    assert is_device_fault(exc) is device
    evaluator = rules()
    assert evaluator.compute_error(exc) is device
    assert fired(evaluator) == ("device_fault" if device else None)


def test_a_device_fault_behind_another_error_is_found():
    try:
        try:
            raise RuntimeError("CUDA error: misaligned address")
        except RuntimeError as inner:
            raise ValueError("batch failed") from inner
    except ValueError as outer:
        assert is_device_fault(outer)


def test_a_switched_off_rule_never_fires():
    evaluator = rules(device_fault={"enabled": False}, non_finite={"enabled": False})
    evaluator.compute_error(RuntimeError("CUDA error"))
    for _ in range(5):
        evaluator.step_result(False, "nan")
    assert fired(evaluator) is None


def test_non_finite_fires_when_the_retry_fails_too_and_a_finite_step_resets():
    evaluator = rules()
    evaluator.step_result(False, "gradient norm is nan at step 3")
    assert fired(evaluator) is None, "the first non-finite step is dropped; the next one is its retry"
    evaluator.step_result(True)
    evaluator.step_result(False, "gradient norm is nan at step 5")
    assert fired(evaluator) is None, "a finite step in between reset the count"
    evaluator.step_result(False, "gradient norm is inf at step 6")
    assert fired(evaluator) == "non_finite"
    assert "2 consecutive" in evaluator.firing.detail and "step 6" in evaluator.firing.detail
    three = rules(non_finite={"max_consecutive": 3})
    for _ in range(2):
        three.step_result(False)
    assert fired(three) is None
    three.step_result(False)
    assert fired(three) == "non_finite"


@pytest.mark.parametrize("name, feed", [("connectivity", SelfTermination.connectivity),
                                        ("progress", SelfTermination.progress_read)])
def test_silence_rules_fire_after_their_time_without_a_success(name, feed):
    evaluator = rules(**{name: {"after_s": 30}})
    feed(evaluator, False, "nobody", now=0.0)
    assert evaluator.check(now=100.0) is None, "never succeeded: nothing was lost"
    feed(evaluator, True, now=100.0)
    assert evaluator.check(now=200.0) is None, "no failure since the success"
    feed(evaluator, False, "timed out", now=110.0)
    assert evaluator.check(now=125.0) is None, "25 s < 30 s"
    feed(evaluator, True, now=126.0)
    feed(evaluator, False, "timed out", now=127.0)
    assert evaluator.check(now=150.0) is None, "the success at 126 s restarted the clock"
    feed(evaluator, False, "timed out again", now=156.0)
    assert evaluator.check(now=157.0).rule.name == name
    assert "31s" in evaluator.firing.detail and "timed out again" in evaluator.firing.detail
    off = rules(**{name: {"enabled": False, "after_s": 1}})
    feed(off, True, now=0.0)
    feed(off, False, "x", now=1.0)
    assert off.check(now=100.0) is None


def test_memory_rules_fire_above_their_limit_only():
    evaluator = rules(host_memory={"enabled": True, "max_bytes": 2 * GIB, "max_fraction": None})
    evaluator.memory(host_rss=1 * GIB, host_total=64 * GIB)
    assert fired(evaluator) is None
    evaluator.memory(host_rss=3 * GIB, host_total=64 * GIB)
    assert fired(evaluator) == "host_memory" and "2.000 GiB" in evaluator.firing.detail
    fraction = rules(host_memory={"enabled": True, "max_fraction": 0.5})
    fraction.memory(host_rss=3 * GIB, host_total=8 * GIB)
    assert fired(fraction) is None
    fraction.memory(host_rss=5 * GIB, host_total=8 * GIB)
    assert fired(fraction) == "host_memory"
    both = rules(host_memory={"enabled": True, "max_bytes": 4 * GIB, "max_fraction": 0.25})
    both.memory(host_rss=3 * GIB, host_total=8 * GIB)
    assert fired(both) == "host_memory", "the lower of the two limits counts"
    device = rules(device_memory={"enabled": True, "max_fraction": 0.9})
    device.memory(host_rss=GIB, host_total=8 * GIB, device_used=None, device_total=None)
    assert fired(device) is None, "no device (CPU): nothing to read"
    device.memory(host_rss=GIB, host_total=8 * GIB, device_used=23 * GIB, device_total=24 * GIB)
    assert fired(device) == "device_memory"
    default = rules()
    default.memory(host_rss=63 * GIB, host_total=64 * GIB, device_used=24 * GIB, device_total=24 * GIB)
    assert fired(default) is None, "the memory rules are off by default"


def test_the_averaging_rule_is_configured_here_and_successes_reset_it():
    health = averaging_health(TerminationConfig.model_validate({"averaging": {"max_failures": 3, "window": 4}}))
    assert type(health) is RoundHealth and health.max_failures == 3 and health.recent.maxlen == 4
    for round_id in range(2):
        health.record_failure("step", round_id)
    health.resolve([("step", 0), ("step", 1)])
    assert health.should_leave() is None
    health.record_success()
    for round_id in range(2, 4):
        health.record_failure("step", round_id)
    health.resolve([("step", 2), ("step", 3)])
    assert health.should_leave() is None, "the success reset the count"
    health.record_failure("step", 4)
    health.resolve([("step", 4)])
    reason = health.should_leave()
    assert reason and "the limit is 3 of 4" in reason
    evaluator = rules()
    evaluator.averaging_left(reason)
    assert fired(evaluator) == "averaging" and evaluator.firing.rule.exit_code == 3
    off = averaging_health(TerminationConfig.model_validate({"averaging": {"enabled": False}}))
    for round_id in range(3):
        off.record_failure("step", round_id)
    off.resolve([("step", r) for r in range(3)])
    assert off.failures == 3 and off.should_leave() is None


def test_the_first_rule_to_fire_wins_wakes_the_loop_and_is_raised_as_a_typed_error():
    evaluator = rules(host_memory={"enabled": True, "max_bytes": 10})
    evaluator.raise_if_fired()  # nothing yet

    async def fault_from_the_compute_thread():
        woke = evaluator.fired.listen()
        thread = threading.Thread(target=evaluator.compute_error, args=(RuntimeError("CUDA error: out of memory"),))
        thread.start()
        await asyncio.wait_for(woke.wait(), 5)
        thread.join()

    asyncio.run(fault_from_the_compute_thread())
    evaluator.memory(host_rss=100, host_total=1000)
    assert fired(evaluator) == "device_fault"
    with pytest.raises(SelfTerminated) as info:
        evaluator.raise_if_fired()
    assert isinstance(info.value, WorkerLeftStage)
    assert info.value.rule == "device_fault" and info.value.exit_code == 8
    assert str(info.value).startswith("self-termination rule device_fault: the worker's device failed")
    assert evaluator.summary() == {"rule": "device_fault", "exit_code": 8,
                                   "detail": "RuntimeError: CUDA error: out of memory"}
    assert rules().summary() is None
