"""The SQL the authorizer runs on every join, poll and renewal, built once per dialect.

Building a SQLAlchemy statement is far costlier than running it (measured: ~3 ms of Python per
join when each request built its five statements, ~0.3 ms with them prebuilt and bound by
parameter), and every write runs on the single writer thread, so statements are constructed here
once with `bindparam`s. Bind names carry a `b_` prefix: SQLAlchemy reserves column names for the
VALUES/SET clauses. The two dialects differ only in their INSERT ... ON CONFLICT constructs.
"""

from __future__ import annotations

from types import SimpleNamespace

from sqlalchemy import Integer, bindparam, exists, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite

from authorizer.schema import (
    ADMITTED, LIVE_PEER_INDEX_WHERE, LIVE_SQL, QUEUED, accounts, banned_peers, credentials, participants, pools,
    rejection_counts,
)

_P = participants
LIVE = text(LIVE_SQL)
"""The live-status condition as static SQL: an `in_()` list is re-expanded on every execution."""
_PARTICIPANT_VALUES = dict(
    ticket=bindparam("b_ticket"), peer_id=bindparam("b_peer"), public_key=bindparam("b_public_key"),
    account_id=bindparam("b_account"), role=bindparam("b_role"), pool=bindparam("b_pool"),
    status=bindparam("b_status"), reason=bindparam("b_reason"), message=bindparam("b_message"),
    hardware=bindparam("b_hardware"), client_version=bindparam("b_client_version"),
    package_digest=bindparam("b_package_digest"), announce_maddrs=bindparam("b_announce_maddrs"),
    created_at=bindparam("b_now"), updated_at=bindparam("b_now"), last_seen_at=bindparam("b_now"),
    last_proof_at=bindparam("b_proof_at"), reachability=bindparam("b_reachability"),
)


def build(dialect: str) -> SimpleNamespace:
    """Statements for 'sqlite' or 'postgresql'."""
    insert = sqlite.insert if dialect == "sqlite" else postgresql.insert
    s = SimpleNamespace()

    # -- joins --
    s.account_state = select(accounts.c.banned, accounts.c.issued, accounts.c.revoked_at).where(
        accounts.c.id == bindparam("b_account"))
    # Locks the account row, so that two joins of one account (in two processes) count its live
    # nodes one after the other. SQLite needs no lock: BEGIN IMMEDIATE serializes writers.
    s.account_locked = s.account_state.with_for_update() if dialect != "sqlite" else s.account_state
    live_of_account = (select(func.count()).select_from(_P)
                       .where(_P.c.account_id == bindparam("b_account"), LIVE)
                       .scalar_subquery())
    s.bans_and_live = select(exists().where(banned_peers.c.peer_id == bindparam("b_peer")), live_of_account)
    s.peer_banned = select(exists().where(banned_peers.c.peer_id == bindparam("b_peer")))
    s.pools = select(pools)
    inserting = insert(_P).values(**_PARTICIPANT_VALUES)
    s.insert_live = inserting.on_conflict_do_nothing(
        index_elements=[_P.c.peer_id], index_where=LIVE_PEER_INDEX_WHERE).returning(*_P.c)
    s.insert_final = inserting.returning(*_P.c)
    s.take_queue_slot = update(pools).where(
        pools.c.pool == bindparam("b_pool"), pools.c.admitted + pools.c.queued < bindparam("b_capacity"),
    ).values(queued=pools.c.queued + 1)
    s.live_for_peer = select(_P).where(_P.c.peer_id == bindparam("b_peer"), LIVE)
    s.live_for_peer_locked = s.live_for_peer.with_for_update() if dialect != "sqlite" else s.live_for_peer
    s.reject_participant = update(_P).where(_P.c.id == bindparam("b_id")).values(
        status="rejected", pool=None, reason=bindparam("b_reason"), message=bindparam("b_message"),
        updated_at=bindparam("b_now"),
    ).returning(*_P.c)

    # -- admission and credentials --
    s.queue_head = (select(_P).where(_P.c.status == QUEUED).order_by(_P.c.id)
                    .limit(bindparam("b_limit", type_=Integer)))
    s.take_admitted_slot = update(pools).where(
        pools.c.pool == bindparam("b_pool"), pools.c.admitted < bindparam("b_capacity"),
    ).values(admitted=pools.c.admitted + 1, queued=pools.c.queued - 1)
    s.leave_queue = update(pools).where(pools.c.pool == bindparam("b_pool")).values(queued=pools.c.queued - 1)
    s.leave_admitted = update(pools).where(pools.c.pool == bindparam("b_pool")).values(admitted=pools.c.admitted - 1)
    s.insert_credential = credentials.insert().values(
        participant_id=bindparam("b_id"), peer_id=bindparam("b_peer"), issued_at=bindparam("b_issued_at"),
        expires_at=bindparam("b_expires_at"),
    ).returning(credentials.c.serial)
    s.admit = update(_P).where(_P.c.id == bindparam("b_id"), _P.c.status == QUEUED).values(
        status=ADMITTED, admitted_at=bindparam("b_now"), updated_at=bindparam("b_now"),
        last_seen_at=bindparam("b_now"), serial=bindparam("b_serial"), credential=bindparam("b_credential"),
        expires_at=bindparam("b_expires_at"),
    )
    s.release_rejected = update(_P).where(_P.c.id == bindparam("b_id"), _P.c.status == QUEUED).values(
        status="rejected", reason=bindparam("b_reason"), message=bindparam("b_message"),
        updated_at=bindparam("b_now"),
    )
    s.renewed = update(_P).where(_P.c.id == bindparam("b_id")).values(
        serial=bindparam("b_serial"), credential=bindparam("b_credential"), expires_at=bindparam("b_expires_at"),
        updated_at=bindparam("b_now"), last_seen_at=bindparam("b_now"), last_proof_at=bindparam("b_signed_at"),
    ).returning(*_P.c)

    # -- rejections counted, not stored one by one (authorizer.rejections) --
    counting = insert(rejection_counts).values(
        source=bindparam("b_source"), reason=bindparam("b_reason"), minute=bindparam("b_minute"),
        refused=bindparam("b_refused"))
    s.add_rejection_count = counting.on_conflict_do_update(
        index_elements=[rejection_counts.c.source, rejection_counts.c.reason, rejection_counts.c.minute],
        set_={"refused": rejection_counts.c.refused + counting.excluded.refused})

    # -- reads --
    s.by_ticket = select(_P).where(_P.c.ticket == bindparam("b_ticket"))
    s.queued_ahead = select(func.count()).select_from(_P).where(
        _P.c.status == QUEUED, _P.c.id < bindparam("b_id"))
    s.touch = update(_P).where(_P.c.id == bindparam("b_id")).values(last_seen_at=bindparam("b_now"))
    return s
