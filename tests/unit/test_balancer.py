"""StageBalancer: least-loaded choice, speed-weighted spread, bans, placement of new workers."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protocol.errors import ConfigError, NoWorkersError
from roles.trainer.balancer import StageBalancer, WorkerView


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(*peers: str, clock: FakeClock | None = None, **kwargs) -> StageBalancer:
    balancer = StageBalancer(0, clock=clock or FakeClock(), **kwargs)
    balancer.update_workers(WorkerView(p, 10.0) for p in peers)
    return balancer


def test_least_loaded_first_and_round_robin_for_equal_workers():
    balancer = make("a", "b", "c")
    assert [balancer.choose() for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_charge_is_cost_over_throughput():
    balancer = StageBalancer(0, clock=FakeClock())
    balancer.update_workers([WorkerView("slow", 1.0), WorkerView("fast", 4.0)])
    picks = Counter(balancer.choose() for _ in range(50))
    assert picks["fast"] == 40 and picks["slow"] == 10
    snap = balancer.snapshot()
    assert snap["fast"]["runtime"] == pytest.approx(10.0)
    assert snap["slow"]["runtime"] == pytest.approx(10.0)


def test_unknown_announced_throughput_uses_default():
    balancer = StageBalancer(0, default_throughput=5.0, clock=FakeClock())
    balancer.update_workers([WorkerView("a", 0.0), WorkerView("b", None), WorkerView("c", float("nan"))])
    assert {s["throughput"] for s in balancer.snapshot().values()} == {5.0}


def test_speed_weighted_spread_follows_measured_throughput():
    """Both announce the same speed; measurement must discover that `fast` is 3x faster."""
    clock = FakeClock()
    balancer = StageBalancer(0, clock=clock)
    true_speed = {"fast": 30.0, "slow": 10.0}
    balancer.update_workers(WorkerView(p, 10.0) for p in true_speed)
    counts: Counter[str] = Counter()
    for _ in range(4000):
        peer = balancer.choose(1.0)
        elapsed = 1.0 / true_speed[peer]
        clock.advance(elapsed)
        balancer.report_success(peer, 1.0, elapsed)
        counts[peer] += 1
    assert counts["fast"] / counts["slow"] == pytest.approx(3.0, rel=0.2)
    assert balancer.snapshot()["fast"]["throughput"] == pytest.approx(30.0)


def test_measured_throughput_wins_over_announced():
    balancer = make("a")
    balancer.report_success("a", 2.0, 1.0)
    balancer.update_workers([WorkerView("a", 500.0)])
    snap = balancer.snapshot()["a"]
    assert snap["throughput"] == pytest.approx(2.0)
    assert snap["announced_throughput"] == 500.0


def test_throughput_estimate_is_an_ewma():
    balancer = make("a", ewma_alpha=0.5)
    balancer.report_success("a", 10.0, 1.0)
    balancer.report_success("a", 20.0, 1.0)
    assert balancer.snapshot()["a"]["throughput"] == pytest.approx(15.0)
    balancer.report_success("a", 1.0, 0.0)
    balancer.report_success("ghost", 1.0, 1.0)
    assert balancer.snapshot()["a"]["throughput"] == pytest.approx(15.0)


def test_ban_and_expiry():
    clock = FakeClock()
    balancer = make("a", "b", clock=clock, ban_s=30.0)
    balancer.report_failure("a")
    assert balancer.is_banned("a")
    assert balancer.usable() == ["b"]
    assert all(balancer.choose() == "b" for _ in range(10))
    clock.advance(29.9)
    assert balancer.is_banned("a")
    clock.advance(0.2)
    assert not balancer.is_banned("a")
    assert set(balancer.usable()) == {"a", "b"}


def test_expired_ban_does_not_flood_the_returning_worker():
    clock = FakeClock()
    balancer = make("a", "b", clock=clock)
    balancer.report_failure("a")
    for _ in range(100):
        balancer.choose()
    clock.advance(31.0)
    picks = [balancer.choose() for _ in range(10)]
    assert picks.count("a") == 5
    assert "b" in picks[:2]


def test_ban_backoff_doubles_and_is_capped():
    clock = FakeClock()
    balancer = make("a", "b", clock=clock, ban_s=10.0, max_ban_s=25.0)
    expected = [10.0, 20.0, 25.0, 25.0]
    for ban in expected:
        balancer.report_failure("a")
        assert balancer.snapshot()["a"]["ban_remaining_s"] == pytest.approx(ban)
        clock.advance(ban + 0.01)
        assert not balancer.is_banned("a")
    balancer.report_success("a", 1.0, 0.1)
    balancer.report_failure("a")
    assert balancer.snapshot()["a"]["ban_remaining_s"] == pytest.approx(10.0)


def test_failures_during_a_ban_do_not_escalate_it():
    clock = FakeClock()
    balancer = make("a", "b", clock=clock, ban_s=10.0)
    for _ in range(8):
        balancer.report_failure("a")
    assert balancer.snapshot()["a"]["ban_remaining_s"] == pytest.approx(10.0)
    assert balancer.snapshot()["a"]["failures"] == 1


def test_the_last_usable_worker_is_backed_off_not_banned():
    clock = FakeClock()
    balancer = make("a", "b", clock=clock, ban_s=30.0, backoff_s=0.5, max_backoff_s=2.0)
    assert balancer.report_failure("a") == 0.0
    assert balancer.is_banned("a")
    waits = []
    for _ in range(4):
        waits.append(balancer.report_failure("b"))
        assert not balancer.is_banned("b")
        assert balancer.choose() == "b"
        assert balancer.report_failure("b") == pytest.approx(waits[-1]), "a failure during the backoff is the same one"
        clock.advance(waits[-1])
    assert waits == pytest.approx([0.5, 1.0, 2.0, 2.0])
    balancer.report_success("b", 1.0, 0.1)
    assert balancer.report_failure("b") == pytest.approx(0.5)


def test_a_single_worker_stage_is_never_banned():
    balancer = make("a")
    for _ in range(5):
        assert balancer.report_failure("a") > 0
        balancer.choose()
    assert balancer.usable() == ["a"]


def test_when_every_worker_is_banned_the_ban_that_ends_first_is_lifted():
    """Bans outlive a worker's drop and return (a restart): when they leave a stage with no
    usable worker, the next choice tries the one whose ban ends first instead of dropping."""
    clock = FakeClock()
    balancer = make("a", "b", clock=clock, ban_s=10.0)
    balancer.report_failure("a")  # a banned until 10
    clock.advance(1.0)
    balancer.update_workers([WorkerView("b", 10.0)])  # a restarts: gone from discovery, still banned
    balancer.report_failure("b")  # b is now the last usable worker: backed off, not banned
    balancer.update_workers([WorkerView("a", 10.0), WorkerView("b", 10.0)])
    balancer.report_failure("b")  # a is back but banned: b stays usable
    assert balancer.is_banned("a") and not balancer.is_banned("b")
    balancer.update_workers([WorkerView("a", 10.0)])  # b restarts too
    assert balancer.choose() == "a", "a known worker is tried rather than none"
    assert not balancer.is_banned("a")
    assert balancer.snapshot()["a"]["failures"] == 1, "its failures are kept: the next ban is longer"


def test_all_banned_raises_no_workers():
    clock = FakeClock()
    balancer = make("a", "b", clock=clock, ban_s=30.0)
    balancer.report_failure("a")
    balancer.update_workers([WorkerView("b", 10.0)])
    balancer.update_workers([WorkerView("a", 10.0), WorkerView("b", 10.0)])
    balancer.report_failure("b")
    assert not balancer.is_banned("b")
    with pytest.raises(NoWorkersError, match="stage 0"):
        balancer.choose(exclude=["b"])


def test_no_known_workers_raises():
    with pytest.raises(NoWorkersError, match="no known worker"):
        StageBalancer(3, clock=FakeClock()).choose()


def test_exclude():
    balancer = make("a", "b", "c")
    assert {balancer.choose(exclude=["a"]) for _ in range(20)} == {"b", "c"}
    with pytest.raises(NoWorkersError, match="excluded"):
        balancer.choose(exclude={"a", "b", "c"})


def test_new_worker_enters_level_with_most_loaded():
    balancer = make("a", "b", "c")
    for _ in range(300):
        balancer.choose()
    balancer.update_workers(WorkerView(p, 10.0) for p in ("a", "b", "c", "new"))
    picks = [balancer.choose() for _ in range(8)]
    assert picks.count("new") == 2
    assert picks[:4].count("new") <= 1


def test_refresh_keeps_state_of_known_workers():
    balancer = make("a", "b")
    for _ in range(10):
        balancer.choose()
    before = balancer.snapshot()
    balancer.update_workers([WorkerView("a", 10.0, max_batch=4), WorkerView("b", 10.0)])
    after = balancer.snapshot()
    assert after["a"]["runtime"] == before["a"]["runtime"]
    assert after["a"]["dispatched"] == 5
    assert after["a"]["max_batch"] == 4


def test_dropped_workers_are_never_chosen():
    balancer = make("a", "b", "c")
    balancer.update_workers([WorkerView("b", 10.0)])
    assert balancer.known() == ["b"]
    assert {balancer.choose() for _ in range(20)} == {"b"}
    balancer.report_failure("a")
    balancer.report_success("a", 1.0, 1.0)
    assert not balancer.is_banned("a")
    assert balancer.known() == ["b"]


def test_ban_survives_a_drop_and_return():
    clock = FakeClock()
    balancer = make("a", "b", clock=clock, ban_s=30.0)
    balancer.report_failure("a")
    balancer.update_workers([WorkerView("b", 10.0)])
    clock.advance(10.0)
    balancer.update_workers([WorkerView("a", 10.0), WorkerView("b", 10.0)])
    assert balancer.is_banned("a")
    clock.advance(20.1)
    assert not balancer.is_banned("a")


def test_release_refunds_the_charge():
    balancer = make("a", "b")
    assert balancer.choose() == "a"
    balancer.release("a", 1.0)
    assert balancer.choose() == "a"
    assert balancer.snapshot()["a"]["dispatched"] == 1


def test_invalid_config_and_cost():
    with pytest.raises(ConfigError):
        StageBalancer(0, ewma_alpha=0.0)
    with pytest.raises(ConfigError):
        StageBalancer(0, ban_s=0.0)
    with pytest.raises(ValueError):
        make("a").choose(cost=0.0)


def test_thread_safety_counts_add_up():
    balancer = StageBalancer(0)
    peers = [f"w{i}" for i in range(8)]
    balancer.update_workers(WorkerView(p, 10.0 + i) for i, p in enumerate(peers))
    per_thread = 2000
    mine: list[Counter[str]] = [Counter() for _ in range(8)]

    def lane(index: int) -> None:
        for k in range(per_thread):
            peer = balancer.choose()
            mine[index][peer] += 1
            if k % 50 == 0:
                balancer.update_workers(WorkerView(p, 10.0) for p in peers)
            balancer.report_success(peer, 1.0, 0.01 * (1 + index))
            balancer.snapshot()

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    total = sum(mine, Counter())
    assert sum(total.values()) == 8 * per_thread
    snap = balancer.snapshot()
    assert {p: snap[p]["dispatched"] for p in peers} == dict(total)
    assert sum(s["completed"] for s in snap.values()) == 8 * per_thread


PEERS = [f"p{i}" for i in range(5)]


class BalancerMachine(RuleBasedStateMachine):
    """Random refreshes, choices, reports and clock steps: a choice is always known and unbanned.

    The model tracks only what must hold whatever the backoff: a worker banned less than `ban_s`
    ago must not be chosen, and a failure bans its worker unless no other worker was usable.
    """

    BAN_S = 5.0

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.balancer = StageBalancer(1, ban_s=self.BAN_S, max_ban_s=20.0, clock=self.clock)
        self.known: set[str] = set()
        self.failed_at: dict[str, float] = {}

    @rule(peers=st.sets(st.sampled_from(PEERS)), speeds=st.lists(st.floats(0, 100), min_size=5, max_size=5))
    def refresh(self, peers, speeds):
        self.balancer.update_workers(WorkerView(p, speeds[PEERS.index(p)]) for p in sorted(peers))
        self.known = set(peers)

    @rule(cost=st.floats(0.1, 8), exclude=st.sets(st.sampled_from(PEERS), max_size=2))
    def choose(self, cost, exclude):
        all_banned = bool(self.known) and all(self.balancer.is_banned(p) for p in self.known)
        try:
            peer = self.balancer.choose(cost, exclude=exclude)
        except NoWorkersError:
            recently_failed = {p for p, t in self.failed_at.items() if self.clock.now < t + self.BAN_S}
            assert all(p in exclude or p in recently_failed or self.balancer.is_banned(p) for p in self.known)
            assert not all_banned or set(self.known) <= set(exclude), "every worker banned: one is tried again"
            return
        assert peer in self.known
        assert peer not in exclude
        if all_banned:  # the ban that ended first was lifted; the worker counts as failed from now on
            self.failed_at.pop(peer, None)
        else:
            assert self.clock.now >= self.failed_at.get(peer, -1e9) + self.BAN_S

    @precondition(lambda self: self.known)
    @rule(data=st.data())
    def fail(self, data):
        peer = data.draw(st.sampled_from(sorted(self.known)))
        was_banned = self.balancer.is_banned(peer)
        last = self.balancer.usable() == [peer]
        backoff = self.balancer.report_failure(peer)
        if last:
            assert backoff > 0 and not self.balancer.is_banned(peer), "the last usable worker is never banned"
            return
        assert backoff == 0.0
        if not was_banned:
            self.failed_at[peer] = self.clock.now
        assert self.balancer.is_banned(peer)

    @rule(peer=st.sampled_from(PEERS), cost=st.floats(0.1, 8), elapsed=st.floats(0.001, 10))
    def succeed(self, peer, cost, elapsed):
        self.balancer.report_success(peer, cost, elapsed)

    @rule(peer=st.sampled_from(PEERS), cost=st.floats(0.1, 8))
    def release(self, peer, cost):
        self.balancer.release(peer, cost)

    @rule(seconds=st.floats(0, 30))
    def tick(self, seconds):
        self.clock.advance(seconds)

    @invariant()
    def views_agree(self):
        assert set(self.balancer.known()) == self.known
        usable = self.balancer.usable()
        assert set(usable) <= self.known
        assert not any(self.balancer.is_banned(p) for p in usable)


TestBalancerMachine = BalancerMachine.TestCase
TestBalancerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_restarted_worker_is_no_longer_banned_but_keeps_its_failure_count():
    """Seen in the lab's churn run: a worker SIGKILLed and restarted in seconds stayed banned
    for the rest of its 30-60 s ban, so it served again only 65-96 s after its restart."""
    clock = FakeClock()
    balancer = StageBalancer(0, clock=clock, ban_s=30.0)
    views = lambda a_started: [WorkerView("a", incarnation=a_started), WorkerView("b", incarnation=1.0)]  # noqa: E731
    balancer.update_workers(views(1.0))
    balancer.report_failure("a")
    assert balancer.usable() == ["b"]
    balancer.update_workers(views(1.0))
    assert balancer.usable() == ["b"], "the same process: still banned"
    balancer.update_workers(views(50.0))
    assert sorted(balancer.usable()) == ["a", "b"], "a new process: the ban was for the one that died"
    balancer.report_failure("a")
    clock.advance(45.0)
    assert balancer.usable() == ["b"], "its failures were kept: the second ban lasts 60 s"
    balancer.update_workers([WorkerView("b", incarnation=1.0)])  # its record lapsed while banned
    balancer.update_workers(views(50.0))
    assert balancer.usable() == ["b"], "the same process back in discovery is still banned"
    balancer.update_workers([WorkerView("b", incarnation=1.0)])
    balancer.update_workers(views(90.0))
    assert sorted(balancer.usable()) == ["a", "b"], "restarted while out of discovery"
