"""The rate limits' parts in process, on a hand-driven clock: the token bucket (refill, burst), the
bounded tables, whom each request is charged to (authorizer.ratelimit), and the ledger of
rejected joins (authorizer.rejections). The real thing over HTTP is tests/authorizer/test_flood.py."""

from __future__ import annotations

import json

import pytest

from authorizer.buckets import Bucket, BucketTable, LruTable
from authorizer.errors import RateLimited, retry_after_header
from authorizer.ratelimit import Limiter, RateLimits, source_of
from authorizer.rejections import OVERFLOW_SOURCE, RejectionLedger
from authorizer.testing import NodeKey
from protocol.authorizer_api import MAX_RETRY_AFTER_S, RATE_LIMITED, retry_after_s

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- the bucket ----------------------------------------------------------------------------------

def test_bucket_spends_its_burst_then_refills_at_the_rate():
    bucket = Bucket(burst=3, now=0.0)
    assert [bucket.take(0.0, 2.0, 3) for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst, back to back
    assert bucket.take(0.0, 2.0, 3) == pytest.approx(0.5)  # empty: a token in 1 / rate seconds
    assert bucket.take(0.25, 2.0, 3) == pytest.approx(0.25)  # half a token accrued; a refusal spends nothing
    assert bucket.take(0.5, 2.0, 3) == 0.0
    assert bucket.take(100.0, 2.0, 3) == 0.0  # a long pause refills to the burst, never beyond
    assert [bucket.take(100.0, 2.0, 3) for _ in range(3)] == [0.0, 0.0, pytest.approx(0.5)]


def test_bucket_table_is_bounded_and_forgets_the_least_recently_used():
    table = BucketTable(rate_per_s=1.0, burst=2, max_entries=100)
    for i in range(10_000):
        table.take(f"10.0.{i // 256}.{i % 256}", now=0.0)
    assert len(table) == 100 and table.evicted == 9_900
    keep = "10.0.0.1"
    table.take(keep, 0.0)
    table.take(keep, 0.0)
    assert table.take(keep, 0.0) > 0  # its burst is spent
    for i in range(99):  # 99 newer keys: the busy one is still among the 100 newest
        table.take(f"k{i}", 0.0)
    assert table.take(keep, 0.0) > 0
    for i in range(100):  # 100 more: now it is the oldest and is forgotten (a fresh burst if it comes back)
        table.take(f"n{i}", 0.0)
    assert table.take(keep, 0.0) == 0.0

    lru: LruTable[str, int] = LruTable(2)
    lru.put("a", 1), lru.put("b", 2)
    assert lru.get("a") == 1  # reading makes "a" the newest
    lru.put("c", 3)
    assert "b" not in lru and lru.get("a") == 1 and lru.setdefault("d", lambda: 4) == 4 and len(lru) == 2


def test_bucket_settings_are_validated():
    with pytest.raises(ValueError):
        BucketTable(rate_per_s=0, burst=1, max_entries=1)
    with pytest.raises(ValueError):
        LruTable(0)


# -- who pays ----------------------------------------------------------------------------------

LIMITS = RateLimits(join_rate_per_s=1.0, join_burst=3, request_rate_per_s=1.0, request_burst=2,
                    node_rate_per_s=2.0, node_burst=4, max_sources=1000)


def limiter(clock: Clock, wall: Clock) -> Limiter:
    return Limiter(LIMITS, run_id="tiny", proof_window_s=120.0, clock=clock, wall_clock=wall)


def renew_body(key: NodeKey, signed_at: float, action: str = "renew") -> bytes:
    return json.dumps(key.proof_body(action, "tiny", signed_at=signed_at)).encode()


def test_joins_are_limited_per_source_address():
    clock, wall = Clock(), Clock(1.7e9)
    limits = limiter(clock, wall)
    refused = []
    limits.on_join_refused = refused.append
    assert [limits.check_join("203.0.113.7") for _ in range(3)] == [None] * 3
    error = limits.check_join("203.0.113.7")
    assert isinstance(error, RateLimited) and error.status == 429 and error.code == "rate_limited"
    assert error.retry_after_s == pytest.approx(1.0) and error.headers() == {"Retry-After": "1"}
    assert "too many joins from 203.0.113.7" in error.message and "retry after" in error.message
    assert refused == ["203.0.113.7"]
    assert limits.check_join("198.51.100.1") is None  # another address has its own bucket
    clock.now += 1.0
    assert limits.check_join("203.0.113.7") is None  # one token a second
    assert limits.refused.totals["join"] == 1


def test_a_proven_node_pays_from_its_own_bucket_and_a_forger_from_its_address():
    clock, wall = Clock(), Clock(1.7e9)
    limits = limiter(clock, wall)
    key, stranger = NodeKey.generate(), NodeKey.generate()
    source = "203.0.113.7"
    # before the store has shown the node live, its renewals prove nothing: the address pays
    assert limits.check_proof(source, "renew", renew_body(key, wall.now)) is None
    limits.know(key.peer_id, key.public_key, ticket="t" * 22, signed_at=wall.now)
    assert limits.check_proof(source, "renew", renew_body(key, wall.now + 0.1)) is None
    assert limits.check_proof(source, "renew", b"not json") is None  # the address's second token
    assert limits.check_proof(source, "renew", b"[" * 10_000) is not None  # address spent; hostile bytes pay there
    # the node still has its own tokens, whatever its address floods
    for i in range(3):
        assert limits.check_proof(source, "renew", renew_body(key, wall.now + 1 + i)) is None
    assert limits.check_proof(source, "leave", renew_body(key, wall.now + 5, "leave")) is not None  # 4 spent
    clock.now += 0.5  # one node token back
    replay = renew_body(key, wall.now + 2)  # older than the newest proof charged: not the node's
    forged = json.loads(renew_body(key, wall.now + 10))
    forged["signature"] = stranger.proof_body("renew", "tiny", signed_at=wall.now + 10)["signature"]
    wrong_action = renew_body(key, wall.now + 11, "leave")
    stale = renew_body(key, wall.now - 500)
    charged = [limits.check_proof("198.51.100.1", "renew", body)
               for body in (replay, json.dumps(forged).encode(), wrong_action, stale)]
    assert charged[:2] == [None, None] and all(isinstance(c, RateLimited) for c in charged[2:])  # its address paid
    assert limits.check_proof(source, "renew", renew_body(key, wall.now + 12)) is None  # the node's token was kept
    limits.forget(key.peer_id)
    assert limits.check_proof("192.0.2.1", "renew", renew_body(key, wall.now + 13)) is None  # the address pays
    assert "192.0.2.1" in limits.requests._buckets


def test_a_known_ticket_polls_from_its_node_bucket():
    clock, wall = Clock(), Clock(1.7e9)
    limits = limiter(clock, wall)
    key = NodeKey.generate()
    ticket = "a" * 22
    limits.know(key.peer_id, key.public_key, ticket=ticket)
    assert [limits.check_poll("203.0.113.7", ticket) for _ in range(4)] == [None] * 4
    refusal = limits.check_poll("203.0.113.7", ticket)
    assert refusal is not None and f"node {key.peer_id}" in refusal.message
    assert limits.check_poll("203.0.113.7", "unknown-ticket-0000") is None  # the address pays for others
    limits.know(key.peer_id, key.public_key, ticket=ticket)  # known again: the bucket is not reset
    assert limits.check_poll("203.0.113.7", ticket) is not None


def test_sources_are_addresses_and_ipv6_prefixes():
    assert source_of("203.0.113.7") == "203.0.113.7"
    assert source_of("2001:db8:1:2:aaaa::1") == source_of("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert source_of("2001:db8:1:3::1") != source_of("2001:db8:1:2::1")
    assert source_of("::ffff:198.51.100.4") == "198.51.100.4"
    assert source_of(None) == "unknown" and source_of("fe80::1%eth0") == "fe80::/64"


def test_tables_stay_bounded_under_a_spray_of_identities():
    clock, wall = Clock(), Clock(1.7e9)
    limits = Limiter(RateLimits(join_rate_per_s=1.0, join_burst=1, request_rate_per_s=1.0, request_burst=1,
                                node_rate_per_s=1.0, node_burst=1, max_sources=50),
                     run_id="tiny", proof_window_s=120.0, clock=clock, wall_clock=wall)
    key = NodeKey.generate()
    for i in range(2000):
        limits.check_join(f"10.1.{i // 256}.{i % 256}")
        limits.check_poll(f"10.2.{i // 256}.{i % 256}", f"ticket-{i:016d}")
        limits.know(f"peer{i}", key.public_key, ticket=f"ticket-{i:016d}")
    assert len(limits.joins) == len(limits.requests) == len(limits.nodes) == len(limits.tickets) == 50


# -- rejected joins ----------------------------------------------------------------------------

def test_ledger_keeps_a_burst_of_rejections_then_counts_per_source_reason_and_minute():
    clock = Clock()
    ledger = RejectionLedger(detail_rate_per_s=0.5, detail_burst=2, max_sources=100, max_pending=3, clock=clock)
    assert [ledger.keep("203.0.113.7") for _ in range(3)] == [True, True, False]
    assert ledger.keep("198.51.100.1")
    clock.now += 2.0
    assert ledger.keep("203.0.113.7") and not ledger.keep("203.0.113.7")
    minute = 1_700_000_040
    for _ in range(5):
        ledger.count("203.0.113.7", "insufficient_vram", minute + 10)
    ledger.count("203.0.113.7", "insufficient_vram", minute + 70)  # the next minute
    ledger.count("203.0.113.7", "rate_limited", minute + 1)
    ledger.count("198.51.100.1", "rate_limited", minute + 2)  # a fourth key: pooled under "other"
    counts = ledger.take()
    assert sorted(counts) == sorted([
        ("203.0.113.7", "insufficient_vram", minute, 5), ("203.0.113.7", "insufficient_vram", minute + 60, 1),
        ("203.0.113.7", "rate_limited", minute, 1), (OVERFLOW_SOURCE, "rate_limited", minute, 1)])
    assert ledger.take() == [] and ledger.counted == 8
    ledger.restore(counts)
    assert sorted(ledger.take()) == sorted(counts)


# -- the wire ----------------------------------------------------------------------------------

def test_retry_after_on_the_wire():
    assert RateLimited("x", 0.01).code == RATE_LIMITED  # both sides name the code alike
    assert [retry_after_header(s) for s in (0.0, 0.01, 1.0, 1.2, 30.0)] == [1, 1, 1, 2, 30]
    assert retry_after_s("3") == 3.0 and retry_after_s(" 0.5 ") == 0.5
    assert retry_after_s(None) == 1.0 and retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 1.0
    assert retry_after_s("nan") == 1.0 and retry_after_s("-5") == 0.0 and retry_after_s("1e9") == MAX_RETRY_AFTER_S


# -- dial-backs ----------------------------------------------------------------------------------

def test_dial_backs_are_bounded_per_source_and_in_all(monkeypatch):
    """Issue 22: dial-backs that each wait out their timeout must not queue every join behind a
    flood. A source past its pending dial-backs, or everyone past the total, is answered 429 at
    once; another source still gets dialed."""
    import asyncio

    import protocol.hivemind_adapter as adapter
    from authorizer.reachability import Dialer

    async def scenario():
        release = asyncio.Event()
        dialed = []

        async def connect(p2p, peer_id, addresses):
            dialed.append(peer_id)
            await release.wait()

        async def disconnect(p2p, peer_id):
            return None

        monkeypatch.setattr(adapter, "connect", connect)
        monkeypatch.setattr(adapter, "disconnect", disconnect)
        dialer = Dialer(5.0, max_concurrent=2, max_pending_per_source=3, max_pending=5)

        async def no_daemon():
            return object()

        dialer._dialer = no_daemon
        peer = NodeKey.generate().peer_id
        maddrs = ["/ip4/203.0.113.9/tcp/4001"]

        def join(source):
            return asyncio.create_task(dialer.check(peer, maddrs, allow_private=True, source=source))

        flood = [join("192.0.2.1") for _ in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(RateLimited) as refused:
            await dialer.check(peer, maddrs, allow_private=True, source="192.0.2.1")
        assert "192.0.2.1" in str(refused.value) and refused.value.retry_after_s == 5.0
        others = [join("198.51.100.7"), join("198.51.100.8")]  # another source is taken: 5 pending
        await asyncio.sleep(0)
        with pytest.raises(RateLimited, match="dialing back 5"):
            await dialer.check(peer, maddrs, allow_private=True, source="198.51.100.9")
        assert len(dialed) == 2  # two at a time
        release.set()
        assert await asyncio.gather(*flood, *others) == [None] * 5
        assert dialer._pending_total == 0 and not dialer._pending
        # an address it may not dial costs no slot
        assert (await dialer.check(peer, ["/ip4/10.0.0.1/tcp/1"], allow_private=False)).reason is not None
        assert dialer._pending_total == 0

    asyncio.run(asyncio.wait_for(scenario(), 30))
