"""The authorizer's tables (SQLAlchemy Core), the same on SQLite and PostgreSQL.

Two invariants are held by the database itself, not by Python, so that neither concurrency inside
one process nor two processes on one database can break them:

* a peer has at most one live (queued or admitted) ticket: a partial unique index;
* a pool (a stage, or the trainers) never admits more than its capacity: `pools.admitted` is only
  ever raised by one conditional `UPDATE ... WHERE admitted < capacity`, which both databases apply
  atomically, in the same transaction that flips the participant to admitted. The report admitted
  63 nodes into a cap of 60 through such races; this is what prevents it.
`pools.admitted`/`pools.queued` equal the counts of admitted/queued participants; every status
change adjusts them in its transaction, and start-up recounts them.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    text,
)

metadata = MetaData()

ID = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrements only INTEGER PRIMARY KEY

QUEUED, ADMITTED, REJECTED, LEFT, EXPIRED, BANNED, ABANDONED, REPLACED = (
    "queued", "admitted", "rejected", "left", "expired", "banned", "abandoned", "replaced",
)
LIVE_STATUSES = (QUEUED, ADMITTED)
LIVE_SQL = "status IN ('queued', 'admitted')"

meta = Table(
    "meta", metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

accounts = Table(
    "accounts", metadata,
    Column("id", String(64), primary_key=True, comment="sha256 hex of the account token; the token is never stored"),
    Column("banned", Boolean, nullable=False, server_default=text("false")),
    Column("created_at", Float, nullable=False),
    Column("reason", String(256)),
    Column("issued", Boolean, nullable=False, server_default=text("false"),
           comment="created by the run's owner (accounts add); only issued accounts pass when accounts are required"),
    Column("label", String(128), nullable=False, server_default=text("''")),
    Column("revoked_at", Float, comment="when the owner revoked the token; its nodes were ended then"),
)
ADDED_COLUMNS: dict[str, list[str]] = {"accounts": ["issued", "label", "revoked_at"], "participants": ["reachability"]}
"""Columns added after a table was first released: Store.open adds them to older databases."""

banned_peers = Table(
    "banned_peers", metadata,
    Column("peer_id", String(128), primary_key=True),
    Column("banned_at", Float, nullable=False),
    Column("reason", String(256)),
)

pools = Table(
    "pools", metadata,
    Column("pool", Integer, primary_key=True, comment="stage index, or -1 for trainers"),
    Column("admitted", Integer, nullable=False, server_default=text("0")),
    Column("queued", Integer, nullable=False, server_default=text("0")),
)

participants = Table(
    "participants", metadata,
    Column("id", ID, primary_key=True, autoincrement=True, comment="also the queue order"),
    Column("ticket", String(32), nullable=False, unique=True),
    Column("peer_id", String(128), nullable=False),
    Column("public_key", LargeBinary, nullable=False),
    Column("account_id", String(64), nullable=False),
    Column("role", String(16), nullable=False),
    Column("pool", Integer, comment="placed stage (-1 trainers); null until placed"),
    Column("status", String(16), nullable=False),
    Column("reason", String(32), comment="RejectReason of a rejected ticket"),
    Column("message", Text, comment="what the user should do about the rejection"),
    Column("hardware", JSON, nullable=False),
    Column("client_version", String(64), nullable=False),
    Column("package_digest", String(160), nullable=False),
    Column("announce_maddrs", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("last_seen_at", Float, nullable=False),
    Column("admitted_at", Float),
    Column("serial", BigInteger, comment="serial of the current credential"),
    Column("credential", LargeBinary, comment="current SignedCredential, msgpack"),
    Column("expires_at", BigInteger, comment="expiry of the current credential, unix seconds"),
    Column("last_proof_at", Float,
           comment="signed_at of the last accepted join, renew or leave proof (replays refused)"),
    Column("reachability", String(16),
           comment="relayed: the authorizer could not dial the node and admitted it to serve through the run's "
                   "relays; null: dialled directly (or not checked)"),
    Index(
        "participants_live_peer", "peer_id", unique=True,
        sqlite_where=text(LIVE_SQL), postgresql_where=text(LIVE_SQL),
    ),
    Index("participants_status_id", "status", "id"),
    Index("participants_account_status", "account_id", "status"),
)

credentials = Table(
    "credentials", metadata,
    Column("serial", ID, primary_key=True, autoincrement=True),
    Column("participant_id", BigInteger, nullable=False, index=True),
    Column("peer_id", String(128), nullable=False),
    Column("issued_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    Column("revoked_at", Float),
    Index("credentials_revoked", "revoked_at", "expires_at"),
)

rejection_counts = Table(
    "rejection_counts", metadata,
    Column("source", String(64), primary_key=True, comment="address the joins came from (IPv6: its /64)"),
    Column("reason", String(32), primary_key=True, comment="RejectReason, or rate_limited for joins answered 429"),
    Column("minute", BigInteger, primary_key=True, autoincrement=False, comment="unix seconds the minute starts"),
    Column("refused", BigInteger, nullable=False, comment="joins refused and not stored as a ticket"),
    Index("rejection_counts_minute", "minute"),
)
"""Rejected joins beyond what a source may leave as tickets (authorizer.rejections), counted."""

evidence_reports = Table(
    "evidence_reports", metadata,
    Column("id", ID, primary_key=True, autoincrement=True, comment="the evidence id; also the order received"),
    Column("received_at", Float, nullable=False),
    Column("reporter_peer_id", String(128), nullable=False),
    Column("reporter_account_id", String(64), nullable=False),
    Column("accused_peer_id", String(128), nullable=False),
    Column("accused_account_id", String(64), comment="null when the accused is no worker admitted to the stage"),
    Column("witness_peer_ids", JSON, nullable=False),
    Column("stage", Integer, nullable=False),
    Column("version", BigInteger, nullable=False),
    Column("kind", String(16), nullable=False, comment="output, gradient, loss or fragment"),
    Column("verdict", String(16), nullable=False, comment="upheld, already_revoked, rejected or pending"),
    Column("reason", String(32), comment="EvidenceReason of rejected evidence"),
    Column("distance_1", Float, comment="the accused's relative L2 distance from the first witness (held evidence); "
           "for a fragment its norm over the witnesses' median"),
    Column("distance_2", Float, comment="and from the second"),
    Column("message", String(512), nullable=False, comment="what was decided and done, in a sentence"),
    Column("body_sha256", String(64), nullable=False, comment="of the report's body; the tensors are not kept"),
    Index("evidence_reports_verdict_id", "verdict", "id"),
    Index("evidence_reports_reporter_id", "reporter_peer_id", "id"),
)
"""Every evidence report that reached a verdict (authorizer.evidence): upheld, already_revoked,
rejected with its reporter, whom the run owner sees flagged here, or pending (a two-replica
contradiction waiting for reporters of more accounts)."""

LIVE_PEER_INDEX_WHERE = text(LIVE_SQL)
