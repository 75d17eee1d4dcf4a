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
from typing import TYPE_CHECKING, Callable, Optional, Union

from sqlalchemy import Connection, Engine, create_engine, event, exists, func, inspect, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Row
from sqlalchemy.exc import SQLAlchemyError

from authorizer import statements
from authorizer.admission import (
    MONITOR_POOL,
    REPLACED_MESSAGE,
    Rejection,
    RejectReason,
    account_limit_rejection,
    banned_account_rejection,
    banned_peer_rejection,
    revoked_account_rejection,
    unknown_account_rejection,
)
from authorizer.placement import PoolCount
from authorizer.policy import TRAINER_POOL
from authorizer.reads import StoreReads
from authorizer.schema import (
    ADDED_COLUMNS, ADMITTED, BANNED, LIVE_STATUSES, QUEUED, REJECTED, REPLACED, accounts, banned_peers, credentials,
    evidence_reports, meta, metadata, participants, pools,
)
from authorizer.writer import GroupCommitWriter, LoopWriter
from protocol.errors import ConfigError

if TYPE_CHECKING:
    from authorizer.issuer import CredentialIssuer as Issuer

logger = logging.getLogger("agora.authorizer.store")


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
    proof_at: Optional[float] = None
    """signed_at of the join's proof of key possession; None for a client that sent none."""
    reachability: Optional[str] = None
    """"relayed" when the node is admitted to serve through the run's relays (not dialled back)."""


@dataclass(frozen=True)
class UnrecordedRejection:
    """A rejected join answered in full but not stored as a ticket (the source used up its
    detailed rejections; authorizer.rejections counts it instead). It reads like a ticket row."""

    ticket: str
    peer_id: str
    role: str
    reason: str
    message: str
    status: str = REJECTED
    pool: Optional[int] = None

    @classmethod
    def of(cls, new: NewParticipant, rejection: Rejection) -> UnrecordedRejection:
        return cls(ticket=new.ticket, peer_id=new.peer_id, role=new.role, reason=rejection.reason.value,
                   message=rejection.message)


@dataclass(frozen=True)
class EvidenceBan:
    """Whom upheld evidence bans (an account, or a peer without one) and the words of the ban;
    `reason` and `message` take the report's id, known only once it is stored."""

    peer_id: Optional[str]
    account_id: Optional[str]
    reason: Callable[[int], str]
    message: Callable[[int], str]
    quorum: Optional[int] = None
    """For a two-replica contradiction from a reporter the owner does not trust: the ban waits until
    reporters of this many accounts, this one included, have reported the target (`pending`)."""
    parties: frozenset[str] = frozenset()
    """The accounts of the accused and its witness: their reporters do not count toward the quorum."""


KeepRejection = Callable[[], bool]
"""Asked once per rejection inside a join's transaction: store it as a ticket (True) or only count it."""


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


def open_engines(url: str, sqlite_synchronous: str = "full") -> tuple[Engine, Engine]:
    """(write engine, read engine) for `url`: on SQLite two engines in WAL mode, writers taking the
    lock up front; on PostgreSQL one pooled engine for both. Shared with the health monitor's
    store (authorizer.monitor.store), which writes to the same database."""
    try:
        if url.startswith("sqlite"):
            return _sqlite_engines(url, sqlite_synchronous)
        engine = create_engine(url, pool_size=8, max_overflow=8, pool_pre_ping=True,
                               connect_args={"connect_timeout": 10})
        return engine, engine
    except (SQLAlchemyError, ImportError) as exc:
        raise ConfigError(f"cannot use database {url!r} ({exc}); check --db") from exc


class Store(StoreReads):
    """The authorizer's database. Write methods are coroutines (group commit); the reads
    (authorizer.reads) are blocking and are meant to be called through `asyncio.to_thread`."""

    def __init__(self, url: str, *, sqlite_synchronous: str = "full"):
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        self.write_engine, self.read_engine = open_engines(url, sqlite_synchronous)
        self._insert = sqlite.insert if self.is_sqlite else postgresql.insert
        self.sql = statements.build("sqlite" if self.is_sqlite else "postgresql")
        self.writer = LoopWriter(self.write_engine) if self.is_sqlite else GroupCommitWriter(self.write_engine)

    # -- lifecycle -------------------------------------------------------------------------

    def open(self, run_id: str, num_stages: int) -> None:
        """Create tables, claim the database for `run_id`, and recount the pools."""
        try:
            metadata.create_all(self.write_engine)
            with self.write_engine.begin() as conn:
                self._add_columns(conn)
                self._open(conn, run_id, num_stages)
        except SQLAlchemyError as exc:
            raise ConfigError(f"cannot open database {self.url!r}: {exc.__class__.__name__}: {exc}; check --db") from exc

    @staticmethod
    def _add_columns(conn: Connection) -> None:
        """Bring a database created by an older release up to the current tables."""
        for table_name, names in ADDED_COLUMNS.items():
            present = {c["name"] for c in inspect(conn).get_columns(table_name)}
            table = metadata.tables[table_name]
            for name in names:
                if name not in present:
                    column = table.c[name]
                    ddl = f"ALTER TABLE {table_name} ADD COLUMN {name} {column.type.compile(conn.dialect)}"
                    if column.server_default is not None:
                        ddl += f" NOT NULL DEFAULT {column.server_default.arg.text}"
                    conn.exec_driver_sql(ddl)

    def _open(self, conn: Connection, run_id: str, num_stages: int) -> None:
        owner = conn.execute(select(meta.c.value).where(meta.c.key == "run_id")).scalar()
        if owner is None:
            conn.execute(meta.insert().values(key="run_id", value=run_id))
        elif owner != run_id:
            raise ConfigError(f"database belongs to run {owner!r}, not {run_id!r}; pass a fresh --db for this run")
        existing = set(conn.execute(select(pools.c.pool)).scalars())
        for pool in [MONITOR_POOL, TRAINER_POOL, *range(num_stages)]:
            if pool not in existing:
                conn.execute(pools.insert().values(pool=pool, admitted=0, queued=0))
        for column, status in (("admitted", ADMITTED), ("queued", QUEUED)):
            counted = (select(func.count()).select_from(participants)
                       .where(participants.c.pool == pools.c.pool, participants.c.status == status)
                       .scalar_subquery())
            conn.execute(update(pools).values({column: counted}))

    async def aclose(self) -> None:
        """Finish queued writes (on the event loop that ran them), then close."""
        if isinstance(self.writer, LoopWriter):
            await self.writer.aclose()
        self.close()

    def close(self) -> None:
        self.writer.close()
        self.write_engine.dispose()
        if self.read_engine is not self.write_engine:
            self.read_engine.dispose()

    # -- policy ----------------------------------------------------------------------------

    async def save_policy(self, policy: dict) -> None:
        await self.writer.run(lambda conn: self._put_meta(conn, "policy", json.dumps(policy)))

    def save_policy_now(self, policy: dict) -> None:
        """Blocking `save_policy`, for start-up (before the event loop writes anything)."""
        with self.write_engine.begin() as conn:
            self._put_meta(conn, "policy", json.dumps(policy))

    def _put_meta(self, conn: Connection, key: str, value: str) -> None:
        stmt = self._insert(meta).values(key=key, value=value)
        conn.execute(stmt.on_conflict_do_update(index_elements=[meta.c.key], set_={"value": stmt.excluded.value}))

    # -- joins -----------------------------------------------------------------------------

    async def create_ticket(
        self, new: NewParticipant, now: float, *, account_rules: bool, max_per_account: int,
        place: Callable[[dict[int, PoolCount]], Union[int, Rejection]], capacity: Callable[[int], int],
        run_full: Callable[[], Rejection], keep_rejected: KeepRejection = lambda: True,
    ) -> tuple[Union[Row, UnrecordedRejection, str], Optional[int]]:
        """Record a join: queued in the pool `place` picks, or rejected with the reason. Returns the
        ticket and, if newly queued, how many tickets are ahead of it.

        A peer that already holds a live ticket is a node restarted with its identity (after a
        crash, its old ticket is stale) or the same join sent again. A join that proves the key
        (`new.proof_at`) with a newer proof than the ticket's replaces it: the old ticket ends as
        `replaced`, its slot is freed and its credentials are revoked; the same proof again gets the
        same ticket back. Instead of a ticket the answer may be 'proof_required' (a live ticket and
        no proof) or 'replayed' (a proof older than the ticket's). A rejection is stored as a
        ticket if `keep_rejected()` says so, else returned as an UnrecordedRejection."""
        return await self.writer.run(lambda conn: self._create_ticket(
            conn, new, now, account_rules, max_per_account, place, capacity, run_full, keep_rejected))

    def _create_ticket(self, conn, new, now, account_rules, max_per_account, place, capacity, run_full, keep):
        sql, binds = self.sql, {"b_account": new.account_id, "b_peer": new.peer_id, "b_now": now}
        anonymous = new.account_id == "anonymous"
        account = None if anonymous else conn.execute(
            sql.account_locked if account_rules else sql.account_state, binds).first()
        if account is not None and account.banned:
            return self._reject(conn, new, now, banned_account_rejection(), keep), None
        if account is not None and account.revoked_at is not None:
            return self._reject(conn, new, now, revoked_account_rejection(), keep), None
        if account_rules and (account is None or not account.issued):
            return self._reject(conn, new, now, unknown_account_rejection(), keep), None
        if account_rules:
            peer_banned, live_count = conn.execute(sql.bans_and_live, binds).one()
        else:
            peer_banned, live_count = conn.execute(sql.peer_banned, binds).scalar(), 0
        if peer_banned:
            return self._reject(conn, new, now, banned_peer_rejection(new.peer_id), keep), None
        live = self._live_for_peer(conn, new.peer_id, lock=True)
        if live is not None:
            if new.proof_at is None:
                return "proof_required", None
            if live.last_proof_at is not None and new.proof_at == live.last_proof_at:
                return live, None  # the same join again (its answer was lost): the same ticket
            if live.last_proof_at is not None and new.proof_at < live.last_proof_at:
                return "replayed", None
            self._retire(conn, live, REPLACED, now, revoke=True, reason=RejectReason.REPLACED.value,
                         message=REPLACED_MESSAGE)
            live_count -= live.account_id == new.account_id
        if account_rules and live_count >= max_per_account:
            return self._reject(conn, new, now, account_limit_rejection(max_per_account), keep), None
        counts = {r.pool: PoolCount(r.pool, r.admitted, r.queued) for r in conn.execute(sql.pools)}
        choice = place(counts)
        if isinstance(choice, Rejection):
            return self._reject(conn, new, now, choice, keep), None
        row = conn.execute(sql.insert_live, self._binds(new, now, status=QUEUED, pool=choice)).first()
        if row is None:  # another authorizer queued this peer since we looked: that is the answer
            return conn.execute(sql.live_for_peer, binds).first(), None
        taken = conn.execute(sql.take_queue_slot, {"b_pool": choice, "b_capacity": capacity(choice)})
        if taken.rowcount != 1:  # another process filled the pool since we counted
            rejection = run_full()
            return conn.execute(sql.reject_participant, {
                "b_id": row.id, "b_reason": rejection.reason.value, "b_message": rejection.message, "b_now": now,
            }).one(), None
        return row, sum(c.queued for c in counts.values())  # one writer: everything queued is ahead

    @staticmethod
    def _binds(new: NewParticipant, now: float, *, status: str, pool: Optional[int] = None,
               rejection: Optional[Rejection] = None) -> dict:
        return {
            "b_ticket": new.ticket, "b_peer": new.peer_id, "b_public_key": new.public_key,
            "b_account": new.account_id, "b_role": new.role, "b_pool": pool, "b_status": status,
            "b_reason": rejection.reason.value if rejection else None,
            "b_message": rejection.message if rejection else None, "b_hardware": new.hardware,
            "b_client_version": new.client_version, "b_package_digest": new.package_digest,
            "b_announce_maddrs": new.announce_maddrs, "b_now": now, "b_proof_at": new.proof_at,
            "b_reachability": new.reachability,
        }

    def _live_for_peer(self, conn: Connection, peer_id: str, *, lock: bool = False) -> Optional[Row]:
        statement = self.sql.live_for_peer_locked if lock else self.sql.live_for_peer
        return conn.execute(statement, {"b_peer": peer_id}).first()

    def _reject(self, conn: Connection, new: NewParticipant, now: float, rejection: Rejection,
                keep: KeepRejection = lambda: True) -> Union[Row, UnrecordedRejection]:
        existing = self._live_for_peer(conn, new.peer_id)
        if existing is not None:
            return existing
        if not keep():
            return UnrecordedRejection.of(new, rejection)
        return conn.execute(self.sql.insert_final, self._binds(new, now, status=REJECTED, rejection=rejection)).one()

    async def record_rejection(self, new: NewParticipant, now: float, rejection: Rejection) -> Row:
        """Record a join refused before it reached the queue (capability, integrity, reachability)."""
        return await self.writer.run(lambda conn: self._reject(conn, new, now, rejection))

    async def add_rejection_counts(self, counts: list[tuple[str, str, int, int]]) -> int:
        """Add (source, reason, minute, refused) counts of unstored rejections (authorizer.rejections)."""
        def op(conn: Connection) -> int:
            for source, reason, minute, refused in counts:
                conn.execute(self.sql.add_rejection_count, {
                    "b_source": source, "b_reason": reason, "b_minute": minute, "b_refused": refused})
            return len(counts)
        return await self.writer.run(op) if counts else 0

    # -- admission and credentials -----------------------------------------------------------

    async def admit_next(self, limit: int, now: float, capacity: Callable[[int], int], issuer: Issuer,
                         run_full: Callable[[str], Rejection]) -> list[tuple[str, Row]]:
        """Release up to `limit` tickets from the head of the queue: each takes a slot of its pool
        (conditional update: never beyond capacity) and gets its first credential, or is rejected
        as run_full if its pool filled up meanwhile (e.g. the operator lowered the capacity)."""
        return await self.writer.run(lambda conn: self._admit_next(conn, limit, now, capacity, issuer, run_full))

    def _admit_next(self, conn, limit, now, capacity, issuer, run_full) -> list[tuple[str, Row]]:
        sql = self.sql
        outcomes = []
        for row in conn.execute(sql.queue_head, {"b_limit": limit}).all():
            taken = conn.execute(sql.take_admitted_slot, {"b_pool": row.pool, "b_capacity": capacity(row.pool)})
            if taken.rowcount == 1:
                changed = conn.execute(sql.admit, {"b_id": row.id, "b_now": now, **self._issue(conn, row, now, issuer)})
                outcome = "admitted"
            else:
                conn.execute(sql.leave_queue, {"b_pool": row.pool})
                rejection = run_full(row.role)
                changed = conn.execute(sql.release_rejected, {
                    "b_id": row.id, "b_reason": rejection.reason.value, "b_message": rejection.message, "b_now": now})
                outcome = "rejected"
            if changed.rowcount != 1:  # another process moved it meanwhile: roll back and retry
                raise RuntimeError(f"ticket {row.id} changed under the admission batch")
            outcomes.append((outcome, row))
        return outcomes

    def _issue(self, conn: Connection, row: Row, now: float, issuer: Issuer) -> dict:
        """Allocate a serial, sign a credential for `row`, and return the binds that record it."""
        issued_at = int(now)
        expires_at = issued_at + issuer.ttl_s
        serial = conn.execute(self.sql.insert_credential, {
            "b_id": row.id, "b_peer": row.peer_id, "b_issued_at": issued_at, "b_expires_at": expires_at,
        }).scalar_one()
        signed = issuer.issue(serial=serial, peer_id=row.peer_id, public_key=row.public_key, role=row.role,
                              stage=None if row.pool in (TRAINER_POOL, MONITOR_POOL) else row.pool,
                              issued_at=issued_at)
        return {"b_serial": serial, "b_credential": signed.to_bytes(), "b_expires_at": expires_at}

    async def renew(self, peer_id: str, signed_at: float, now: float, issuer: Issuer) -> Union[Row, str]:
        """Issue a fresh credential to the admitted peer; returns the updated row, or a string
        naming why not: 'not_admitted', 'queued', 'banned' or 'replayed'."""
        return await self.writer.run(lambda conn: self._renew(conn, peer_id, signed_at, now, issuer))

    def _renew(self, conn, peer_id, signed_at, now, issuer) -> Union[Row, str]:
        row = self._live_for_peer(conn, peer_id, lock=True)
        if row is None:
            return "banned" if conn.execute(self.sql.peer_banned, {"b_peer": peer_id}).scalar() else "not_admitted"
        if row.status == QUEUED:
            return "queued"
        if row.last_proof_at is not None and signed_at <= row.last_proof_at:
            return "replayed"
        return conn.execute(self.sql.renewed, {
            "b_id": row.id, "b_now": now, "b_signed_at": signed_at, **self._issue(conn, row, now, issuer),
        }).one()

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
        conn.execute(self.sql.leave_admitted if row.status == ADMITTED else self.sql.leave_queue, {"b_pool": row.pool})
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
        return await self.writer.run(lambda conn: self.ban_now(conn, peer_id=peer_id, account_id=account_id,
                                                               reason=reason, now=now, message=message))

    def ban_now(self, conn: Connection, *, peer_id: Optional[str] = None, account_id: Optional[str] = None,
                reason: str, now: float, message: str) -> int:
        """`ban` inside the caller's transaction (the admin API's bans and upheld evidence share it)."""
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

    async def record_evidence(self, record: dict, ban: Optional[EvidenceBan] = None) -> tuple[int, str, int]:
        """Store an evidence report (`record`: the evidence_reports columns but id and verdict, its
        message as text or as a function of the verdict) and,
        for evidence that holds (`ban`), ban its target unless it is banned or revoked already, in
        one transaction: two reports against one account ban it once. Returns (id, verdict, tickets
        ended), the verdict `upheld` or `already_revoked` with `ban` (`pending` while its quorum is
        not reached), else `rejected`."""
        def op(conn: Connection) -> tuple[int, str, int]:
            verdict, ended = "rejected", 0
            if ban is not None:
                if self._already_banned(conn, ban):
                    verdict = "already_revoked"
                elif ban.quorum is not None and len(self._reporters(conn, record, ban)) < ban.quorum:
                    verdict = "pending"
                else:
                    verdict = "upheld"
            message = record["message"](verdict) if callable(record["message"]) else record["message"]
            row = conn.execute(evidence_reports.insert().values(**{**record, "message": message}, verdict=verdict)
                               .returning(evidence_reports.c.id)).one()
            if verdict == "upheld":
                ended = self.ban_now(conn, peer_id=ban.peer_id, account_id=ban.account_id,
                                     reason=ban.reason(row.id), now=record["received_at"], message=ban.message(row.id))
            return row.id, verdict, ended
        return await self.writer.run(op)

    def _reporters(self, conn: Connection, record: dict, ban: EvidenceBan) -> set[str]:
        """The accounts that reported `ban`'s target with evidence pending (this report included),
        but the parties' own."""
        target = (evidence_reports.c.accused_peer_id == ban.peer_id if ban.peer_id is not None
                  else evidence_reports.c.accused_account_id == ban.account_id)
        rows = conn.execute(select(evidence_reports.c.reporter_account_id).distinct()
                            .where(target, evidence_reports.c.verdict == "pending")).all()
        return ({row.reporter_account_id for row in rows} | {record["reporter_account_id"]}) - ban.parties

    def _already_banned(self, conn: Connection, ban: EvidenceBan) -> bool:
        if ban.peer_id is not None:
            return bool(conn.execute(select(exists().where(banned_peers.c.peer_id == ban.peer_id))).scalar())
        query = select(accounts.c.banned, accounts.c.revoked_at).where(accounts.c.id == ban.account_id)
        # another authorizer on the database judging evidence against the account waits for this one
        state = conn.execute(query if self.is_sqlite else query.with_for_update()).first()
        return state is not None and (bool(state.banned) or state.revoked_at is not None)

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
        await self.writer.run(lambda conn: conn.execute(self.sql.touch, {"b_id": participant_id, "b_now": now}))

    # -- accounts ----------------------------------------------------------------------------
    # Each operation is a function of a connection, so the admin API (through the writer) and the
    # `accounts` command line (a transaction of its own, beside a running authorizer) share it.

    async def create_account(self, account_id: str, label: str, now: float) -> Row:
        return await self.writer.run(lambda conn: create_account(conn, self._insert, account_id, label, now))

    async def revoke_account(self, account_id: str, now: float) -> tuple[bool, int]:
        return await self.writer.run(lambda conn: self.revoke_account_now(conn, account_id, now))

    def revoke_account_now(self, conn: Connection, account_id: str, now: float) -> tuple[bool, int]:
        """Revoke an issued account: its joins are refused (revoked_account), its live tickets end
        and their credentials are revoked, as a ban would. Returns (was active, tickets ended)."""
        changed = conn.execute(update(accounts).where(
            accounts.c.id == account_id, accounts.c.issued, accounts.c.revoked_at.is_(None),
        ).values(revoked_at=now)).rowcount
        message = revoked_account_rejection().message
        rows = conn.execute(select(participants).where(
            participants.c.account_id == account_id, participants.c.status.in_(LIVE_STATUSES))).all()
        ended = sum(self._retire(conn, row, BANNED, now, revoke=True, reason=RejectReason.REVOKED_ACCOUNT.value,
                                 message=message) for row in rows)
        return changed == 1, ended

    def open_for_accounts(self) -> None:
        """Create or upgrade the tables without claiming the database for a run: the accounts
        command line works on a database whether or not an authorizer has opened it yet."""
        try:
            metadata.create_all(self.write_engine)
            with self.write_engine.begin() as conn:
                self._add_columns(conn)
        except SQLAlchemyError as exc:
            raise ConfigError(f"cannot open database {self.url!r}: {exc.__class__.__name__}: {exc}; check --db") from exc


def create_account(conn: Connection, insert, account_id: str, label: str, now: float) -> Row:
    """Record an issued account under its token's hash (the token itself is never stored)."""
    stmt = insert(accounts).values(id=account_id, banned=False, created_at=now, issued=True, label=label)
    stmt = stmt.on_conflict_do_update(index_elements=[accounts.c.id], set_={"issued": True, "label": label})
    return conn.execute(stmt.returning(*accounts.c)).one()
