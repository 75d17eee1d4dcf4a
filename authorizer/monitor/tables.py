"""The health monitor's tables (SQLAlchemy Core), the same on SQLite and PostgreSQL.

They live on their own MetaData beside the admission tables (authorizer.schema) in the same
database, so the authorizer's store never depends on them and a standalone monitor pointed at a
database of its own creates only these. History tables are pruned to a bound (authorizer.monitor.store).

Counting training progress exactly once rests on `monitor_trainer_cursors` and the totals in
`monitor_state` being written in the same transaction: a restarted monitor resumes from the
last report it counted, never from zero.
"""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Boolean, Column, Float, Index, Integer, MetaData, String, Table, Text

monitor_metadata = MetaData()

ID = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrements only INTEGER PRIMARY KEY

monitor_state = Table(
    "monitor_state", monitor_metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False, comment="JSON"),
)
"""run_id, interval_s, updated_at (the last snapshot), samples and tokens counted, best_loss."""

monitor_nodes = Table(
    "monitor_nodes", monitor_metadata,
    Column("peer_id", String(128), primary_key=True),
    Column("role", String(16), nullable=False),
    Column("stage", Integer),
    Column("state", String(16), nullable=False, comment="present or gone"),
    Column("phase", String(32)),
    Column("first_seen", Float, nullable=False),
    Column("last_seen", Float, nullable=False, comment="when its newest record was stored, while it was present"),
    Column("gone_at", Float, comment="the snapshot that first saw it gone"),
    Column("admitted", Boolean, nullable=False),
    Column("throughput", Float),
    Column("step", BigInteger),
    Column("samples", BigInteger),
    Column("rss_bytes", BigInteger),
    Column("last_expiration", Float, comment="expiration of its newest record: a refresh moves it"),
    Column("ttl_s", Float, comment="the longest remaining life seen on its records: its records' TTL"),
    Column("rounds", JSON, comment="its last averaging rounds (RoundSummaryRecord dicts)"),
    Column("relayed", Boolean, comment="it announces only addresses through the run's relays (behind NAT)"),
    Column("relayed_bytes", BigInteger, comment="pipeline bytes it moved through the run's relays"),
    Index("monitor_nodes_state", "state"),
)

monitor_node_samples = Table(
    "monitor_node_samples", monitor_metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("peer_id", String(128), nullable=False),
    Column("t", Float, nullable=False),
    Column("phase", String(32)),
    Column("throughput", Float),
    Column("step", BigInteger),
    Column("samples", BigInteger),
    Column("rss_bytes", BigInteger),
    Column("rounds_complete", BigInteger),
    Column("rounds_failed", BigInteger),
    Index("monitor_node_samples_peer_t", "peer_id", "t"),
    Index("monitor_node_samples_t", "t"),
)

monitor_stages = Table(
    "monitor_stages", monitor_metadata,
    Column("stage", Integer, primary_key=True),
    Column("t", Float, nullable=False),
    Column("summary", JSON, nullable=False, comment="the stage's entry of GET /v1/monitor/overview"),
)
"""The latest snapshot of each stage."""

monitor_stage_samples = Table(
    "monitor_stage_samples", monitor_metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("t", Float, nullable=False),
    Column("stage", Integer, nullable=False),
    Column("replicas", Integer, nullable=False),
    Column("active", Integer, nullable=False),
    Column("step", BigInteger),
    Column("throughput", Float, nullable=False),
    Column("rounds_complete", BigInteger, nullable=False),
    Column("rounds_failed", BigInteger, nullable=False),
    Index("monitor_stage_samples_t", "t"),
)

monitor_progress = Table(
    "monitor_progress", monitor_metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("t", Float, nullable=False),
    Column("samples", BigInteger, nullable=False, comment="samples completed in the run, each counted once"),
    Column("tokens", BigInteger, nullable=False),
    Column("loss", Float),
    Column("tokens_per_s", Float),
    Column("trainers", Integer, nullable=False),
    Column("eval_loss", Float, comment="the run's latest held-out loss (roles/trainer/evaluation.py)"),
    Column("eval_step", BigInteger, comment="the stage step that held-out loss was taken at"),
    Column("eval_stderr", Float, comment="the standard error of that held-out loss over its samples"),
    Index("monitor_progress_t", "t"),
)

ADDED_COLUMNS = {"monitor_progress": ("eval_loss", "eval_step", "eval_stderr"), "monitor_nodes": ("relayed", "relayed_bytes")}
"""Columns added since the tables were first released: a database an older monitor created gets
them when the monitor opens it (authorizer.monitor.store)."""

monitor_trainer_cursors = Table(
    "monitor_trainer_cursors", monitor_metadata,
    Column("peer_id", String(128), primary_key=True),
    Column("process", Integer, nullable=False, comment="trainer processes seen under this peer id"),
    Column("samples", BigInteger, nullable=False, comment="the process's counter as last counted"),
    Column("tokens", BigInteger, nullable=False),
    Column("report_time", Float, nullable=False, comment="time field of the last report counted"),
    Column("first_loss", Float, comment="the process's first loss: a new value means a new process"),
)

monitor_alerts = Table(
    "monitor_alerts", monitor_metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("kind", String(32), nullable=False),
    Column("severity", String(16), nullable=False),
    Column("subject", String(160), nullable=False),
    Column("message", Text, nullable=False),
    Column("first_at", Float, nullable=False),
    Column("last_at", Float, nullable=False),
    Column("resolved_at", Float),
    Index("monitor_alerts_active", "resolved_at", "kind"),
)
