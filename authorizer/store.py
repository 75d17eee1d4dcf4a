"""Durable participant records on SQLite (embedded default) or PostgreSQL, and every change to them.

Each change is one write operation run by the group-commit writer (authorizer.writer): it reads
what it needs and decides inside the same transaction, so capacity, bans and per-account limits
hold however many requests race (authorizer.schema states the invariants). Outcomes that are not
the caller's success (a refused renewal, say) are returned as error values rather than raised, so
they never roll back the other operations sharing their transaction. Reads (polls, run info,
revocations) run on their own connections: SQLite in WAL mode lets them proceed beside the writer.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from sqlalchemy import Connection, Engine, create_engine, event, exists, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Row
from sqlalchemy.exc import SQLAlchemyError

from authorizer.admission import (
    Rejection,
    RejectReason,
    account_limit_rejection,
    banned_account_rejection,
    banned_peer_rejection,
)
from authorizer.placement import PoolCount
from authorizer.policy import TRAINER_POOL
from authorizer.schema import (
    ADMITTED, LIVE_PEER_INDEX_WHERE, LIVE_STATUSES, QUEUED, REJECTED,
    accounts, banned_peers, credentials, meta, metadata, participants, pools,
)
from authorizer.writer import GroupCommitWriter
from protocol.errors import ConfigError

logger = logging.getLogger("agora.authorizer.store")

Issue = Callable[..., Any]  # CredentialIssuer.issue


@dataclass(frozen=True)
class NewParticipant:
    """A join request as the store records it."""

    ticket: str
    peer_id: str
    public_key: bytes
    account_id: str
    role: str
    hardware: dict
    client_version: str
    package_digest: str
    announce_maddrs: list[str]


def _sqlite_engines(url: str, synchronous: str) -> tuple[Engine, Engine]:
    path = url[len("sqlite:///"):]
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create {directory} for the database ({exc}); fix --db") from exc

    def make(begin: str) -> Engine:
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _connect(dbapi_connection, _record):
            dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA synchronous={synchronous.upper()}")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _begin(connection):
            connection.exec_driver_sql(begin)

        return engine

    # Writers take the write lock up front (BEGIN IMMEDIATE): a deferred transaction that reads
    # and then writes can fail to upgrade its lock instead of waiting for it.
    return make("BEGIN IMMEDIATE"), make("BEGIN")


class Store:
    """The authorizer's database. Write methods are coroutines (group commit); reads are blocking
    and are meant to be called through `asyncio.to_thread`."""

    def __init__(self, url: str, *, sqlite_synchronous: str = "full"):
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        try:
            if self.is_sqlite:
                self.write_engine, self.read_engine = _sqlite_engines(url, sqlite_synchronous)
            else:
                engine = create_engine(
                    url, pool_size=8, max_overflow=8, pool_pre_ping=True, connect_args={"connect_timeout": 10}
                )
                self.write_engine = self.read_engine = engine
        except (SQLAlchemyError, ImportError) as exc:
            raise ConfigError(f"cannot use database {url!r} ({exc}); check --db") from exc
        self._insert = sqlite.insert if self.is_sqlite else postgresql.insert
        self.writer = GroupCommitWriter(self.write_engine)

    # -- lifecycle -------------------------------------------------------------------------

    def open(self, run_id: str, num_stages: int) -> None:
        """Create tables, claim the database for `run_id`, and recount the pools."""
        try:
            metadata.create_all(self.write_engine)
            self.writer.call(lambda conn: self._open(conn, run_id, num_stages))
        except SQLAlchemyError as exc:
            raise ConfigError(f"cannot open database {self.url!r}: {exc.__class__.__name__}: {exc}; check --db") from exc

    def _open(self, conn: Connection, run_id: str, num_stages: int) -> None:
        owner = conn.execute(select(meta.c.value).where(meta.c.key == "run_id")).scalar()
        if owner is None:
            conn.execute(meta.insert().values(key="run_id", value=run_id))
        elif owner != run_id:
            raise ConfigError(f"database belongs to run {owner!r}, not {run_id!r}; pass a fresh --db for this run")
        existing = set(conn.execute(select(pools.c.pool)).scalars())
        for pool in [TRAINER_POOL, *range(num_stages)]:
            if pool not in existing:
                conn.execute(pools.insert().values(pool=pool, admitted=0, queued=0))
        for column, status in (("admitted", ADMITTED), ("queued", QUEUED)):
            counted = (select(func.count()).select_from(participants)
                       .where(participants.c.pool == pools.c.pool, participants.c.status == status)
                       .scalar_subquery())
            conn.execute(update(pools).values({column: counted}))

    def close(self) -> None:
        self.writer.close()
        self.write_engine.dispose()
        if self.read_engine is not self.write_engine:
            self.read_engine.dispose()

    # -- policy ----------------------------------------------------------------------------

    def load_policy(self) -> Optional[dict]:
        with self.read_engine.connect() as conn:
            value = conn.execute(select(meta.c.value).where(meta.c.key == "policy")).scalar()
        return None if value is None else json.loads(value)

    async def save_policy(self, policy: dict) -> None:
        await self.writer.run(lambda conn: self._put_meta(conn, "policy", json.dumps(policy)))

    def save_policy_now(self, policy: dict) -> None:
        """Blocking `save_policy`, for start-up."""
        self.writer.call(lambda conn: self._put_meta(conn, "policy", json.dumps(policy)))

    def _put_meta(self, conn: Connection, key: str, value: str) -> None:
        stmt = self._insert(meta).values(key=key, value=value)
        conn.execute(stmt.on_conflict_do_update(index_elements=[meta.c.key], set_={"value": stmt.excluded.value}))

    # -- joins -----------------------------------------------------------------------------

    async def create_ticket(
        self, new: NewParticipant, now: float, *, account_rules: bool, max_per_account: int,
        place: Callable[[dict[int, PoolCount]], Union[int, Rejection]], capacity: Callable[[int], int],
        run_full: Callable[[], Rejection],
    ) -> tuple[Row, Optional[int]]:
        """Record a join: queued in the pool `place` picks, or rejected with the reason. A peer
        that already has a live ticket gets that ticket back (joins are idempotent per peer).
        Returns the ticket and, if newly queued, how many tickets are ahead of it."""
        return await self.writer.run(lambda conn: self._create_ticket(
            conn, new, now, account_rules, max_per_account, place, capacity, run_full))

    def _create_ticket(self, conn, new, now, account_rules, max_per_account, place, capacity, run_full):
        if account_rules:
            stmt = self._insert(accounts).values(id=new.account_id, banned=False, created_at=now)
            stmt = stmt.on_conflict_do_update(index_elements=[accounts.c.id], set_={"id": stmt.excluded.id})
            account_banned = conn.execute(stmt.returning(accounts.c.banned)).scalar_one()  # locks the row
            live = (select(func.count()).select_from(participants)
                    .where(participants.c.account_id == new.account_id, participants.c.status.in_(LIVE_STATUSES))
                    .scalar_subquery())
        else:
            account_banned = bool(conn.execute(
                select(accounts.c.banned).where(accounts.c.id == new.account_id)).scalar())
            live = select(func.count()).where(False).scalar_subquery()
        peer_banned, live_count = conn.execute(
            select(exists().where(banned_peers.c.peer_id == new.peer_id), live)).one()
        if account_banned:
            return self._reject(conn, new, now, banned_account_rejection()), None
        if peer_banned:
            return self._reject(conn, new, now, banned_peer_rejection(new.peer_id)), None
        if account_rules and live_count >= max_per_account:
            return self._reject(conn, new, now, account_limit_rejection(max_per_account)), None
        counts = {r.pool: PoolCount(r.pool, r.admitted, r.queued) for r in conn.execute(select(pools))}
        choice = place(counts)
        if isinstance(choice, Rejection):
            return self._reject(conn, new, now, choice), None
        stmt = self._insert(participants).values(**self._values(new, now), status=QUEUED, pool=choice)
        stmt = stmt.on_conflict_do_nothing(index_elements=[participants.c.peer_id], index_where=LIVE_PEER_INDEX_WHERE)
        row = conn.execute(stmt.returning(*participants.c)).first()
        if row is None:
            return self._live_for_peer(conn, new.peer_id), None
        taken = conn.execute(update(pools).where(
            pools.c.pool == choice, pools.c.admitted + pools.c.queued < capacity(choice),
        ).values(queued=pools.c.queued + 1))
        if taken.rowcount != 1:  # another process filled the pool since we counted
            rejection = run_full()
            return conn.execute(update(participants).where(participants.c.id == row.id).values(
                status=REJECTED, pool=None, reason=rejection.reason.value, message=rejection.message,
            ).returning(*participants.c)).one(), None
        return row, sum(c.queued for c in counts.values())  # one writer: everything queued is ahead

    def _values(self, new: NewParticipant, now: float) -> dict:
        return dict(
            ticket=new.ticket, peer_id=new.peer_id, public_key=new.public_key, account_id=new.account_id,
            role=new.role, hardware=new.hardware, client_version=new.client_version,
            package_digest=new.package_digest, announce_maddrs=new.announce_maddrs,
            created_at=now, updated_at=now, last_seen_at=now,
        )

    def _live_for_peer(self, conn: Connection, peer_id: str, *, lock: bool = False) -> Optional[Row]:
        query = select(participants).where(participants.c.peer_id == peer_id, participants.c.status.in_(LIVE_STATUSES))
        return conn.execute(query.with_for_update() if lock and not self.is_sqlite else query).first()

    def _reject(self, conn: Connection, new: NewParticipant, now: float, rejection: Rejection) -> Row:
        existing = self._live_for_peer(conn, new.peer_id)
        if existing is not None:
            return existing
        values = self._values(new, now)
        return conn.execute(participants.insert().values(
            **values, status=REJECTED, reason=rejection.reason.value, message=rejection.message,
        ).returning(*participants.c)).one()

    async def record_rejection(self, new: NewParticipant, now: float, rejection: Rejection) -> Row:
        """Record a join refused before it reached the queue (capability, integrity, reachability)."""
        return await self.writer.run(lambda conn: self._reject(conn, new, now, rejection))

    # -- admission and credentials -----------------------------------------------------------

    async def admit_next(self, limit: int, now: float, capacity: Callable[[int], int], issue: Issue,
                         run_full: Callable[[str], Rejection]) -> list[tuple[str, Row]]:
        """Release up to `limit` tickets from the head of the queue: each takes a slot of its pool
        (conditional update: never beyond capacity) and gets its first credential, or is rejected
        as run_full if its pool filled up meanwhile (e.g. the operator lowered the capacity)."""
        return await self.writer.run(lambda conn: self._admit_next(conn, limit, now, capacity, issue, run_full))

    def _admit_next(self, conn, limit, now, capacity, issue, run_full) -> list[tuple[str, Row]]:
        heads = conn.execute(select(participants).where(participants.c.status == QUEUED)
                             .order_by(participants.c.id).limit(limit)).all()
        outcomes = []
        for row in heads:
            taken = conn.execute(update(pools).where(
                pools.c.pool == row.pool, pools.c.admitted < capacity(row.pool),
            ).values(admitted=pools.c.admitted + 1, queued=pools.c.queued - 1))
            if taken.rowcount == 1:
                values = self._issue(conn, row, now, issue)
                values.update(status=ADMITTED, admitted_at=now)
                outcome = "admitted"
            else:
                conn.execute(update(pools).where(pools.c.pool == row.pool).values(queued=pools.c.queued - 1))
                rejection = run_full(row.role)
                values = dict(status=REJECTED, reason=rejection.reason.value, message=rejection.message,
                              updated_at=now)
                outcome = "rejected"
            changed = conn.execute(update(participants).where(
                participants.c.id == row.id, participants.c.status == QUEUED).values(**values))
            if changed.rowcount != 1:
                raise RuntimeError(f"ticket {row.id} changed under the admission batch; retrying")
            outcomes.append((outcome, row))
        return outcomes

    def _issue(self, conn: Connection, row: Row, now: float, issue: Issue) -> dict:
        """Allocate a serial, sign a credential for `row`, and return the participant columns to set."""
        issued_at = int(now)
        serial = conn.execute(credentials.insert().values(
            participant_id=row.id, peer_id=row.peer_id, issued_at=issued_at, expires_at=issued_at,
        ).returning(credentials.c.serial)).scalar_one()
        signed = issue(serial=serial, peer_id=row.peer_id, public_key=row.public_key, role=row.role,
                       stage=None if row.pool == TRAINER_POOL else row.pool, issued_at=issued_at)
        expires_at = signed.credential.expires_at
        conn.execute(update(credentials).where(credentials.c.serial == serial).values(expires_at=expires_at))
        return dict(serial=serial, credential=signed.to_bytes(), expires_at=expires_at, updated_at=now,
                    last_seen_at=now)

    async def renew(self, peer_id: str, signed_at: float, now: float, issue: Issue) -> Union[Row, str]:
        """Issue a fresh credential to the admitted peer; returns the updated row, or a string
        naming why not: 'not_admitted', 'queued', 'banned' or 'replayed'."""
        return await self.writer.run(lambda conn: self._renew(conn, peer_id, signed_at, now, issue))

    def _renew(self, conn, peer_id, signed_at, now, issue) -> Union[Row, str]:
        row = self._live_for_peer(conn, peer_id, lock=True)
        if row is None:
            if conn.execute(select(exists().where(banned_peers.c.peer_id == peer_id))).scalar():
                return "banned"
            return "not_admitted"
        if row.status == QUEUED:
            return "queued"
        if row.last_proof_at is not None and signed_at <= row.last_proof_at:
            return "replayed"
        values = self._issue(conn, row, now, issue)
        return conn.execute(update(participants).where(participants.c.id == row.id).values(
            **values, last_proof_at=signed_at).returning(*participants.c)).one()

    async def leave(self, peer_id: str, signed_at: float, now: float) -> Union[Row, str]:
        """Retire the peer's live ticket and revoke its credentials; 'not_live' or 'replayed' if not."""
        return await self.writer.run(lambda conn: self._leave(conn, peer_id, signed_at, now))

    def _leave(self, conn, peer_id, signed_at, now) -> Union[Row, str]:
        row = self._live_for_peer(conn, peer_id, lock=True)
        if row is None:
            return "not_live"
        if row.last_proof_at is not None and signed_at <= row.last_proof_at:
            return "replayed"
        self._retire(conn, row, "left", now, revoke=True)
        conn.execute(update(participants).where(participants.c.id == row.id).values(last_proof_at=signed_at))
        return row

    def _retire(self, conn: Connection, row: Row, status: str, now: float, *, revoke: bool,
                reason: Optional[str] = None, message: Optional[str] = None) -> bool:
        """Move a live ticket to a final status, free its slot, and optionally revoke its credentials."""
        changed = conn.execute(update(participants).where(
            participants.c.id == row.id, participants.c.status == row.status,
        ).values(status=status, updated_at=now, reason=reason, message=message))
        if changed.rowcount != 1:
            return False
        column = pools.c.admitted if row.status == ADMITTED else pools.c.queued
        conn.execute(update(pools).where(pools.c.pool == row.pool).values({column.name: column - 1}))
        if revoke and row.status == ADMITTED:
            conn.execute(update(credentials).where(
                credentials.c.participant_id == row.id, credentials.c.revoked_at.is_(None),
                credentials.c.expires_at > int(now) - 60,
            ).values(revoked_at=now))
        return True

    # -- operator actions --------------------------------------------------------------------

    async def ban(self, *, peer_id: Optional[str] = None, account_id: Optional[str] = None,
                  reason: str, now: float, message: str) -> int:
        """Ban a peer or an account: future joins refused, live tickets ended, credentials revoked.
        Returns how many live tickets were ended."""
        def op(conn: Connection) -> int:
            if peer_id is not None:
                stmt = self._insert(banned_peers).values(peer_id=peer_id, banned_at=now, reason=reason)
                conn.execute(stmt.on_conflict_do_update(index_elements=[banned_peers.c.peer_id],
                                                        set_={"reason": stmt.excluded.reason}))
                where = participants.c.peer_id == peer_id
            else:
                stmt = self._insert(accounts).values(id=account_id, banned=True, created_at=now, reason=reason)
                conn.execute(stmt.on_conflict_do_update(index_elements=[accounts.c.id],
                                                        set_={"banned": True, "reason": stmt.excluded.reason}))
                where = participants.c.account_id == account_id
            code = (RejectReason.BANNED_PEER if peer_id is not None else RejectReason.BANNED_ACCOUNT).value
            rows = conn.execute(select(participants).where(where, participants.c.status.in_(LIVE_STATUSES))).all()
            return sum(self._retire(conn, row, "banned", now, revoke=True, reason=code, message=message)
                       for row in rows)
        return await self.writer.run(op)

    async def unban(self, *, peer_id: Optional[str] = None, account_id: Optional[str] = None) -> bool:
        def op(conn: Connection) -> bool:
            if peer_id is not None:
                return conn.execute(banned_peers.delete().where(banned_peers.c.peer_id == peer_id)).rowcount > 0
            return conn.execute(update(accounts).where(accounts.c.id == account_id, accounts.c.banned)
                                .values(banned=False)).rowcount > 0
        return await self.writer.run(op)

    async def sweep(self, now: float, queue_idle_timeout_s: float, grace_s: float, limit: int = 1000) -> int:
        """End admitted tickets whose credential lapsed unrenewed and queued tickets nobody polls."""
        def op(conn: Connection) -> int:
            lapsed = conn.execute(select(participants).where(
                participants.c.status == ADMITTED, participants.c.expires_at < now - grace_s).limit(limit)).all()
            idle = conn.execute(select(participants).where(
                participants.c.status == QUEUED, participants.c.last_seen_at < now - queue_idle_timeout_s,
            ).limit(limit)).all()
            return (sum(self._retire(conn, row, "expired", now, revoke=False) for row in lapsed)
                    + sum(self._retire(conn, row, "abandoned", now, revoke=False) for row in idle))
        return await self.writer.run(op)

    async def touch(self, participant_id: int, now: float) -> None:
        await self.writer.run(lambda conn: conn.execute(update(participants).where(
            participants.c.id == participant_id).values(last_seen_at=now)))

    # -- reads (blocking) ----------------------------------------------------------------------

    def ticket(self, ticket: str) -> Optional[tuple[Row, int]]:
        """The ticket's row and, if queued, how many queued tickets are ahead of it."""
        with self.read_engine.connect() as conn:
            row = conn.execute(select(participants).where(participants.c.ticket == ticket)).first()
            if row is None:
                return None
            ahead = 0
            if row.status == QUEUED:
                ahead = conn.execute(select(func.count()).select_from(participants).where(
                    participants.c.status == QUEUED, participants.c.id < row.id)).scalar_one()
            return row, ahead

    def live(self, peer_id: str) -> Optional[Row]:
        """The peer's queued or admitted ticket, if any."""
        with self.read_engine.connect() as conn:
            return self._live_for_peer(conn, peer_id)

    def pool_counts(self) -> dict[int, PoolCount]:
        with self.read_engine.connect() as conn:
            return {r.pool: PoolCount(r.pool, r.admitted, r.queued) for r in conn.execute(select(pools))}

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

    def recent_addresses(self, limit: int) -> list[str]:
        """Announced addresses of recently seen admitted nodes: bootstrap peers for newcomers."""
        with self.read_engine.connect() as conn:
            rows = conn.execute(select(participants.c.announce_maddrs).where(participants.c.status == ADMITTED)
                                .order_by(participants.c.last_seen_at.desc()).limit(limit)).scalars()
            return [addr for maddrs in rows for addr in (maddrs or [])[:2]]

    def list_participants(self, status: Optional[str], after_id: int, limit: int) -> list[Row]:
        with self.read_engine.connect() as conn:
            query = select(participants).where(participants.c.id > after_id)
            if status is not None:
                query = query.where(participants.c.status == status)
            return conn.execute(query.order_by(participants.c.id).limit(limit)).all()
