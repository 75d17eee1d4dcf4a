"""The health monitor's history in the authorizer's database (SQLite or PostgreSQL).

One transaction per snapshot: node rows, history samples, stage rows, the progress point, the
trainer cursors with the run's totals, and the alerts. Reads serve the JSON API. All methods block;
the monitor and the API call them through `asyncio.to_thread`. History is pruned to a bound: node
samples for `NODE_HISTORY_S`, stage samples and progress for `RUN_HISTORY_S`, resolved alerts for
`RUN_HISTORY_S`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from sqlalchemy import Engine, delete, func, inspect, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError

from authorizer.monitor.health import Alert
from authorizer.monitor.membership import NodeState, Placement
from authorizer.monitor.progress import Cursor
from authorizer.monitor.tables import (
    ADDED_COLUMNS, monitor_alerts, monitor_metadata, monitor_node_samples, monitor_nodes, monitor_progress,
    monitor_stage_samples, monitor_stages, monitor_state, monitor_trainer_cursors,
)
from protocol.errors import ConfigError

logger = logging.getLogger("agora.monitor")

NODE_HISTORY_S = 6 * 3600.0
RUN_HISTORY_S = 30 * 86400.0
PRUNE_EVERY = 60
"""Snapshots between two prunings."""
_NODE_COLUMNS = ("role", "stage", "state", "phase", "first_seen", "last_seen", "gone_at", "admitted", "throughput",
                 "step", "samples", "rss_bytes", "last_expiration", "ttl_s", "rounds", "relayed", "relayed_bytes")


@dataclass
class Loaded:
    """What a (re)started monitor resumes from."""

    nodes: dict[str, NodeState] = field(default_factory=dict)
    cursors: dict[str, Cursor] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    best_loss: Optional[float] = None
    losses: list[float] = field(default_factory=list)


@dataclass
class SnapshotWrite:
    """Everything one snapshot changes."""

    t: float
    interval_s: float
    nodes: list[NodeState]
    node_samples: list[dict]
    stages: list[dict]
    progress: dict
    cursors: list[Cursor]
    totals: tuple[int, int]
    best_loss: Optional[float]
    raised: list[Alert]
    refreshed: list[Alert]
    resolved: list[Alert]


class MonitorStore:
    """The monitor's tables on `write_engine`/`read_engine` (the authorizer's store's, when the
    monitor runs inside the authorizer: authorizer.store.open_engines)."""

    def __init__(self, write_engine: Engine, read_engine: Engine):
        self.write_engine, self.read_engine = write_engine, read_engine
        self.is_sqlite = write_engine.dialect.name == "sqlite"
        self._insert = sqlite.insert if self.is_sqlite else postgresql.insert
        self._writes = 0

    # -- lifecycle -------------------------------------------------------------------------

    def open(self, run_id: str) -> None:
        """Create the tables and claim them for `run_id`; a ConfigError if they hold another run."""
        try:
            monitor_metadata.create_all(self.write_engine)
            with self.write_engine.begin() as conn:
                self._add_columns(conn)
                owner = conn.execute(select(monitor_state.c.value).where(monitor_state.c.key == "run_id")).scalar()
                if owner is None:
                    conn.execute(monitor_state.insert().values(key="run_id", value=json.dumps(run_id)))
                elif json.loads(owner) != run_id:
                    raise ConfigError(f"the monitor's tables in this database belong to run {json.loads(owner)!r}, "
                                      f"not {run_id!r}; give the monitor a fresh --db")
        except SQLAlchemyError as exc:
            raise ConfigError(f"cannot open the monitor's tables: {exc.__class__.__name__}: {exc}; check --db") from exc

    @staticmethod
    def _add_columns(conn) -> None:
        """Bring tables an older monitor created up to the current ones (nullable columns only)."""
        for table_name, names in ADDED_COLUMNS.items():
            present = {c["name"] for c in inspect(conn).get_columns(table_name)}
            for name in names:
                if name not in present:
                    column = monitor_metadata.tables[table_name].c[name]
                    conn.exec_driver_sql(f"ALTER TABLE {table_name} ADD COLUMN {name} "
                                         f"{column.type.compile(conn.dialect)}")

    def load(self, recent_losses: int = 32) -> Loaded:
        loaded = Loaded()
        with self.read_engine.connect() as conn:
            for row in conn.execute(select(monitor_nodes)):
                loaded.nodes[row.peer_id] = NodeState(
                    peer_id=row.peer_id, role=row.role, stage=row.stage, first_seen=row.first_seen,
                    last_seen=row.last_seen, state=row.state, phase=row.phase, gone_at=row.gone_at,
                    admitted=bool(row.admitted), throughput=row.throughput, step=row.step, samples=row.samples,
                    rss_bytes=row.rss_bytes, last_expiration=row.last_expiration, ttl_s=row.ttl_s,
                    rounds=list(row.rounds or []), relayed=row.relayed, relayed_bytes=row.relayed_bytes)
            for row in conn.execute(select(monitor_trainer_cursors)):
                loaded.cursors[row.peer_id] = Cursor(peer_id=row.peer_id, process=row.process, samples=row.samples,
                                                     tokens=row.tokens, report_time=row.report_time,
                                                     first_loss=row.first_loss)
            for row in conn.execute(select(monitor_alerts).where(monitor_alerts.c.resolved_at.is_(None))):
                loaded.alerts.append(_alert(row))
            state = self._state(conn)
            loaded.samples, loaded.tokens = int(state.get("samples", 0)), int(state.get("tokens", 0))
            loaded.best_loss = state.get("best_loss")
            losses = conn.execute(select(monitor_progress.c.loss).where(monitor_progress.c.loss.is_not(None))
                                  .order_by(monitor_progress.c.id.desc()).limit(recent_losses)).scalars().all()
            loaded.losses = list(reversed(losses))
        return loaded

    @staticmethod
    def _state(conn) -> dict[str, Any]:
        return {row.key: json.loads(row.value) for row in conn.execute(select(monitor_state))}

    # -- reads from the admission tables -----------------------------------------------------

    def placements(self) -> Optional[dict[str, Placement]]:
        """Admitted peers and where they were placed, from the authorizer's `participants`; None
        if this database has no admissions (a standalone monitor on a database of its own)."""
        from authorizer.admission import MONITOR_POOL
        from authorizer.policy import TRAINER_POOL
        from authorizer.schema import ADMITTED, participants

        try:
            with self.read_engine.connect() as conn:
                if not inspect(conn).has_table("participants"):
                    return None
                rows = conn.execute(select(participants.c.peer_id, participants.c.role, participants.c.pool)
                                    .where(participants.c.status == ADMITTED)).all()
        except SQLAlchemyError as exc:
            logger.warning("could not read the admissions (%s); reconciliation skipped this time", exc)
            return None
        return {row.peer_id: Placement(role=row.role, stage=None if row.pool in (TRAINER_POOL, MONITOR_POOL)
                                       else row.pool) for row in rows}

    # -- the snapshot's write ----------------------------------------------------------------

    def write(self, snap: SnapshotWrite) -> None:
        """Store one snapshot in one transaction; new alerts get their ids."""
        with self.write_engine.begin() as conn:
            if snap.nodes:
                rows = [dict(peer_id=n.peer_id, **{c: getattr(n, c) for c in _NODE_COLUMNS}) for n in snap.nodes]
                stmt = self._insert(monitor_nodes)
                conn.execute(stmt.on_conflict_do_update(
                    index_elements=[monitor_nodes.c.peer_id],
                    set_={c: getattr(stmt.excluded, c) for c in _NODE_COLUMNS if c != "first_seen"}), rows)
            if snap.node_samples:
                conn.execute(monitor_node_samples.insert(), snap.node_samples)
            for stage in snap.stages:
                stmt = self._insert(monitor_stages).values(stage=stage["stage"], t=snap.t, summary=stage)
                conn.execute(stmt.on_conflict_do_update(index_elements=[monitor_stages.c.stage],
                                                        set_={"t": stmt.excluded["t"], "summary": stmt.excluded["summary"]}))
            if snap.stages:
                conn.execute(monitor_stage_samples.insert(), [dict(
                    t=snap.t, stage=s["stage"], replicas=s["replicas"], active=s["phases"]["active"], step=s["step"],
                    throughput=s["throughput"], rounds_complete=s["averaging"]["complete"],
                    rounds_failed=s["averaging"]["failed"]) for s in snap.stages])
            conn.execute(monitor_progress.insert().values(t=snap.t, **snap.progress))
            for cursor in snap.cursors:
                values = dict(process=cursor.process, samples=cursor.samples, tokens=cursor.tokens,
                              report_time=cursor.report_time, first_loss=cursor.first_loss)
                stmt = self._insert(monitor_trainer_cursors).values(peer_id=cursor.peer_id, **values)
                conn.execute(stmt.on_conflict_do_update(index_elements=[monitor_trainer_cursors.c.peer_id],
                                                        set_=values))
            state = {"samples": snap.totals[0], "tokens": snap.totals[1], "best_loss": snap.best_loss,
                     "updated_at": snap.t, "interval_s": snap.interval_s}
            for key, value in state.items():
                stmt = self._insert(monitor_state).values(key=key, value=json.dumps(value))
                conn.execute(stmt.on_conflict_do_update(index_elements=[monitor_state.c.key],
                                                        set_={"value": stmt.excluded.value}))
            for alert in snap.raised:
                alert.id = conn.execute(monitor_alerts.insert().values(
                    kind=alert.kind, severity=alert.severity, subject=alert.subject, message=alert.message,
                    first_at=alert.first_at, last_at=alert.last_at).returning(monitor_alerts.c.id)).scalar_one()
            for alert in snap.refreshed + snap.resolved:
                if alert.id is not None:
                    conn.execute(update(monitor_alerts).where(monitor_alerts.c.id == alert.id).values(
                        last_at=alert.last_at, message=alert.message, resolved_at=alert.resolved_at))
            self._writes += 1
            if self._writes % PRUNE_EVERY == 1:
                self._prune(conn, snap.t)

    @staticmethod
    def _prune(conn, now: float) -> None:
        conn.execute(delete(monitor_node_samples).where(monitor_node_samples.c.t < now - NODE_HISTORY_S))
        conn.execute(delete(monitor_stage_samples).where(monitor_stage_samples.c.t < now - RUN_HISTORY_S))
        conn.execute(delete(monitor_progress).where(monitor_progress.c.t < now - RUN_HISTORY_S))
        conn.execute(delete(monitor_alerts).where(monitor_alerts.c.resolved_at < now - RUN_HISTORY_S))

    # -- reads for the JSON API ----------------------------------------------------------------

    def overview(self) -> Optional[dict]:
        """The parts of GET /v1/monitor/overview the database holds; None before any snapshot."""
        with self.read_engine.connect() as conn:
            if not inspect(conn).has_table("monitor_state"):
                return None
            state = self._state(conn)
            if "updated_at" not in state:
                return None
            stages = [row.summary for row in conn.execute(select(monitor_stages).order_by(monitor_stages.c.stage))]
            last = conn.execute(select(monitor_progress).order_by(monitor_progress.c.id.desc()).limit(1)).first()
            counts = dict(conn.execute(select(monitor_nodes.c.state, func.count()).group_by(monitor_nodes.c.state))
                          .all())
            alerts = [_alert(row).as_json() for row in conn.execute(
                select(monitor_alerts).where(monitor_alerts.c.resolved_at.is_(None)).order_by(monitor_alerts.c.id))]
        return {
            "run_id": state.get("run_id"), "updated_at": state.get("updated_at"),
            "interval_s": state.get("interval_s"), "stages": stages,
            "training": {"samples": int(state.get("samples", 0)), "tokens": int(state.get("tokens", 0)),
                         "loss": last.loss if last else None, "tokens_per_s": last.tokens_per_s if last else None,
                         "trainers": last.trainers if last else 0,
                         "eval_loss": last.eval_loss if last else None, "eval_step": last.eval_step if last else None,
                         "eval_stderr": last.eval_stderr if last else None},
            "nodes": {"present": int(counts.get("present", 0)), "gone": int(counts.get("gone", 0))},
            "alerts": alerts,
        }

    def progress(self, since: Optional[float], limit: int) -> list[dict]:
        """Progress points after `since`, oldest first; without `since` the newest `limit` of them."""
        query = select(monitor_progress)
        if since is not None:
            query = query.where(monitor_progress.c.t > since).order_by(monitor_progress.c.id).limit(limit)
        else:
            query = query.order_by(monitor_progress.c.id.desc()).limit(limit)
        with self.read_engine.connect() as conn:
            rows = conn.execute(query).mappings().all()  # mappings: Row.t is SQLAlchemy's own attribute
        rows = sorted(rows, key=lambda r: r["id"])
        return [dict(t=r["t"], samples=int(r["samples"]), tokens=int(r["tokens"]), loss=r["loss"],
                     tokens_per_s=r["tokens_per_s"], eval_loss=r["eval_loss"], eval_step=r["eval_step"],
                     eval_stderr=r["eval_stderr"]) for r in rows]

    def nodes(self, limit: int = 100_000) -> list[dict]:
        with self.read_engine.connect() as conn:
            rows = conn.execute(select(monitor_nodes).order_by(monitor_nodes.c.state.desc(), monitor_nodes.c.role,
                                                               monitor_nodes.c.stage, monitor_nodes.c.peer_id)
                                .limit(limit)).all()
        return [node_json(row) for row in rows]

    def node(self, peer_id: str, history: int = 500) -> Optional[dict]:
        with self.read_engine.connect() as conn:
            row = conn.execute(select(monitor_nodes).where(monitor_nodes.c.peer_id == peer_id)).first()
            if row is None:
                return None
            samples = conn.execute(select(monitor_node_samples).where(monitor_node_samples.c.peer_id == peer_id)
                                   .order_by(monitor_node_samples.c.t.desc()).limit(history)).mappings().all()
        keys = ("t", "phase", "throughput", "step", "samples", "rss_bytes", "rounds_complete", "rounds_failed")
        return {"node": node_json(row), "rounds": list(row.rounds or []),
                "history": [{k: s[k] for k in keys} for s in reversed(samples)]}

    def alerts(self, active: Optional[bool], limit: int = 1000) -> list[dict]:
        query = select(monitor_alerts)
        if active is True:
            query = query.where(monitor_alerts.c.resolved_at.is_(None))
        elif active is False:
            query = query.where(monitor_alerts.c.resolved_at.is_not(None))
        with self.read_engine.connect() as conn:
            rows = conn.execute(query.order_by(monitor_alerts.c.id.desc()).limit(limit)).all()
        return [_alert(row).as_json() for row in rows]


def node_json(row) -> dict:
    return dict(peer_id=row.peer_id, role=row.role, stage=row.stage, state=row.state, phase=row.phase,
                first_seen=row.first_seen, last_seen=row.last_seen, gone_at=row.gone_at,
                throughput=row.throughput, step=row.step, admitted=bool(row.admitted), relayed=row.relayed,
                relayed_bytes=row.relayed_bytes)


def _alert(row) -> Alert:
    return Alert(id=row.id, kind=row.kind, severity=row.severity, subject=row.subject, message=row.message,
                 first_at=row.first_at, last_at=row.last_at, resolved_at=row.resolved_at)
