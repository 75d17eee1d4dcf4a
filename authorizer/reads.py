"""The authorizer's reads: polls, run counts, bans, revocations, the admin listings.

Each runs on its own short-lived connection from the read engine, outside the writer: SQLite in
WAL mode lets readers proceed beside the one writer, and PostgreSQL readers never block writers.
They are blocking calls, made through `asyncio.to_thread` by the service.
"""

from __future__ import annotations

import json
from typing import Optional

from sqlalchemy import and_, exists, or_, select
from sqlalchemy.engine import Row

from authorizer.admission import Rejection, banned_account_rejection, banned_peer_rejection
from authorizer.placement import PoolCount
from authorizer.schema import (
    ADMITTED, QUEUED, accounts, banned_peers, credentials, evidence_reports, meta, participants, rejection_counts,
)


class StoreReads:
    """Read queries of `authorizer.store.Store` (which provides `read_engine` and `sql`)."""

    def load_policy(self) -> Optional[dict]:
        with self.read_engine.connect() as conn:
            value = conn.execute(select(meta.c.value).where(meta.c.key == "policy")).scalar()
        return None if value is None else json.loads(value)

    def ticket(self, ticket: str) -> Optional[tuple[Row, int]]:
        """The ticket's row and, if queued, how many queued tickets are ahead of it."""
        with self.read_engine.connect() as conn:
            row = conn.execute(self.sql.by_ticket, {"b_ticket": ticket}).first()
            if row is None:
                return None
            ahead = conn.execute(self.sql.queued_ahead, {"b_id": row.id}).scalar_one() if row.status == QUEUED else 0
            return row, ahead

    def live(self, peer_id: str) -> Optional[Row]:
        """The peer's queued or admitted ticket, if any."""
        with self.read_engine.connect() as conn:
            return conn.execute(self.sql.live_for_peer, {"b_peer": peer_id}).first()

    def pool_counts(self) -> dict[int, PoolCount]:
        with self.read_engine.connect() as conn:
            return {r.pool: PoolCount(r.pool, r.admitted, r.queued) for r in conn.execute(self.sql.pools)}

    def is_banned(self, peer_id: str, account_id: str) -> Optional[Rejection]:
        with self.read_engine.connect() as conn:
            peer, account = conn.execute(select(
                exists().where(banned_peers.c.peer_id == peer_id),
                exists().where(accounts.c.id == account_id, accounts.c.banned),
            )).one()
        if account:
            return banned_account_rejection()
        return banned_peer_rejection(peer_id) if peer else None

    def revoked(self, now: float, limit: int) -> tuple[list[int], list[str]]:
        """Serials of revoked credentials still in their lifetime, and banned peer ids."""
        with self.read_engine.connect() as conn:
            serials = list(conn.execute(select(credentials.c.serial).where(
                credentials.c.revoked_at.is_not(None), credentials.c.expires_at > int(now),
            ).order_by(credentials.c.serial).limit(limit)).scalars())
            peers = list(conn.execute(select(banned_peers.c.peer_id).order_by(banned_peers.c.peer_id)
                                      .limit(limit)).scalars())
            peers += conn.execute(select(participants.c.peer_id).where(
                participants.c.status == "banned", participants.c.expires_at > int(now)).limit(limit)).scalars()
        return serials, sorted(set(peers))[:limit]

    def recent_addresses(self, limit: int, admitted_at: float, participant_id: int) -> list[str]:
        """Announced addresses of recently seen nodes admitted before the participant admitted at
        `admitted_at` with id `participant_id`: bootstrap peers for a newcomer. Only earlier ones
        (in admission order, ties by id), so that of nodes admitted together the first starts the
        DHT and each of the others joins one admitted before it, instead of each waiting for
        another; and never none of them, or a batch admitted at once would start separate DHTs."""
        earlier = or_(participants.c.admitted_at < admitted_at,
                      and_(participants.c.admitted_at == admitted_at, participants.c.id < participant_id))
        with self.read_engine.connect() as conn:
            rows = conn.execute(select(participants.c.announce_maddrs).where(
                participants.c.status == ADMITTED, participants.c.role != "relay", earlier)
                                .order_by(participants.c.last_seen_at.desc()).limit(limit)).scalars()
            return [addr for maddrs in rows for addr in (maddrs or [])[:2]]

    def relay_addresses(self, limit: int) -> list[str]:
        """Announced addresses (with /p2p/<id>) of the run's admitted relays, newest first: every
        admitted node is handed them (protocol/relays.py)."""
        with self.read_engine.connect() as conn:
            rows = conn.execute(select(participants.c.peer_id, participants.c.announce_maddrs).where(
                participants.c.status == ADMITTED, participants.c.role == "relay")
                                .order_by(participants.c.admitted_at.desc()).limit(limit)).all()
        found = []
        for peer_id, maddrs in rows:
            for maddr in (maddrs or [])[:4]:
                found.append(maddr if maddr.rstrip("/").endswith(f"/p2p/{peer_id}") else
                             f"{maddr.rstrip('/')}/p2p/{peer_id}")
        return found

    def list_participants(self, status: Optional[str], after_id: int, limit: int) -> list[Row]:
        with self.read_engine.connect() as conn:
            query = select(participants).where(participants.c.id > after_id)
            if status is not None:
                query = query.where(participants.c.status == status)
            return conn.execute(query.order_by(participants.c.id).limit(limit)).all()

    def list_rejection_counts(self, since: float, limit: int) -> list[Row]:
        """Counted (unstored) rejections of minutes starting at or after `since`: newest minute
        first, the largest counts first within it."""
        with self.read_engine.connect() as conn:
            return conn.execute(select(rejection_counts).where(rejection_counts.c.minute >= int(since // 60) * 60)
                                .order_by(rejection_counts.c.minute.desc(), rejection_counts.c.refused.desc(),
                                          rejection_counts.c.source, rejection_counts.c.reason)
                                .limit(limit)).all()

    def list_accounts(self) -> list[Row]:
        """Issued accounts, oldest first."""
        with self.read_engine.connect() as conn:
            return conn.execute(select(accounts).where(accounts.c.issued).order_by(accounts.c.created_at)).all()

    def account(self, account_id: str) -> Optional[Row]:
        with self.read_engine.connect() as conn:
            return conn.execute(select(accounts).where(accounts.c.id == account_id)).first()

    def stage_workers(self, peer_ids: list[str], stage: int) -> dict[str, Row]:
        """Of `peer_ids`, those once admitted as workers of `stage` (issued a credential for it),
        each with its latest such ticket: whom evidence about the stage may name."""
        with self.read_engine.connect() as conn:
            rows = conn.execute(select(participants.c.peer_id, participants.c.account_id, participants.c.status)
                                .where(participants.c.peer_id.in_(peer_ids), participants.c.role == "worker",
                                       participants.c.pool == stage, participants.c.admitted_at.is_not(None))
                                .order_by(participants.c.id)).all()
        return {row.peer_id: row for row in rows}  # the latest ticket of each peer wins

    def list_evidence(self, limit: int, verdict: Optional[str] = None, reporter: Optional[str] = None) -> list[Row]:
        """Evidence reports, newest first, optionally of one verdict or one reporter."""
        query = select(evidence_reports)
        if verdict is not None:
            query = query.where(evidence_reports.c.verdict == verdict)
        if reporter is not None:
            query = query.where(evidence_reports.c.reporter_peer_id == reporter)
        with self.read_engine.connect() as conn:
            return conn.execute(query.order_by(evidence_reports.c.id.desc()).limit(limit)).all()
