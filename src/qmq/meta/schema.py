"""The meta store's tables, and bringing an older database up to them.

Tables (created when absent; every name carries a ``qmq_meta_`` prefix because the database
behind ``db_url`` may be shared with other applications):

    qmq_meta_servers  key (role, group_name, address): one row per server, as it last reported
        role              "broker" | "delay"
        group_name        broker or delay group
        address           host:port of the binary protocol
        http              host:port of the server's /metrics and /health
        pid               process id, so a restart at the same address is told from a heartbeat
        role_in_group     "master" | "slave": what the server reported doing
        registered_at_ms  when this process first registered
        last_heartbeat_ms when it last reported itself
        epoch             the epoch it works in (0: never knew one; NULL: it does not report epochs)
        log_end           end offset of its message log
        action_end        end offset of its action log
        replicated_ms     slaves: when it last held every write its master had answered (its own clock)
        write_state       masters: "ok" | "read-only" | "degraded" | "disk-full" | "failed" (NULL: not reported)

    qmq_meta_groups   key (role, group_name): what the meta server decided, one row per group
        epoch             the group's current epoch, raised by every promotion
        master            address of the master of that epoch
        message_offset    where the master's logs stood when it was promoted
        action_offset     (NULL both: the epoch began without a promotion)
        changed_at_ms     when this row last changed
        changed_by        which meta server changed it

    qmq_meta_epochs   key (role, group_name, epoch): every promotion, so a server back from an
                      old epoch is cut where its successor began (the latest EPOCHS_KEPT per group)
        master, message_offset, action_offset, started_at_ms

    qmq_meta_routes   key (subject, group_name)
        created_at_ms     when the subject was routed to the group

    qmq_meta_leases   key name: the leader of the meta servers sharing the database
        owner             the meta server holding it
        url               that meta server's base URL
        expires_ms        when it ends unless renewed

    qmq_meta_push     key (subject, group_name): an HTTP push subscription (qmq.meta.push_store)
        url               where each message is POSTed
        concurrency       most deliveries in flight at once
        rate_per_s        most deliveries started per second (0: no bound)
        timeout_ms        an answer later than this is a failure
        secret            key of the X-Qmq-Signature HMAC ("" : no signature)
        tags, tag_type    JSON list of tags the broker filters on, "or" | "and"
        start_from        "latest" | "earliest": where the group began when it was added
        max_retries       failures before a message goes to the dead letters
        retry_backoff_ms  JSON list: wait after the n-th failure, the last repeating
        created_at_ms     when it was added
        owner             the gateway holding its lease ("" : none ever)
        owner_url         that gateway's base URL, for people
        lease_expires_ms  when the lease ends unless renewed
        lease_generation  raised each time the lease changes hands

    qmq_meta_alarms   key (subject, group_name): a backlog alarm (qmq.meta.alarms)
        lag_over          the breach: more than this many messages left to the group
        for_ms            how long a breach (or its end) must last before it is notified
        webhook, secret   where notifications are POSTed, and the key of their signature ("": none)
        created_at_ms     when it was added
        state             "ok" | "pending" (over, not for long enough) | "firing" | "clearing"
        state_since_ms    when the state began
        lag, checked_ms   the lag at the last check, and when that was (-1: never known)

    qmq_meta_push_gateways   key owner: the gateways asking for push leases, to share them out
        url               the gateway's base URL, for people
        last_seen_ms      when it last asked (a row silent for a few leases is deleted)
        held_max          most subscriptions it runs
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

# Column widths. Names are checked by qmq.common.naming before they get here; these only
# need to hold what passes that check (subjects up to the internal-subject limit).
ROLE_CHARS: Final = 16
GROUP_CHARS: Final = 100
SUBJECT_CHARS: Final = 255
ADDRESS_CHARS_MAX: Final = 300
OWNER_CHARS: Final = 200
URL_CHARS: Final = 400
# A push subscription's callback URL, its secret and its JSON lists (10 tags of up to 100
# bytes, or the back-off waits) fit in these.
PUSH_URL_CHARS: Final = 2_000
PUSH_SECRET_CHARS: Final = 200
PUSH_LIST_CHARS: Final = 2_000
# A promotion needs a failure, so a group sees few; a server absent across more than this many
# is cut at the oldest one kept (never too late: see MetaStore.offsets_after).
EPOCHS_KEPT: Final = 1000


LIMIT_APP_CHARS = 200
LIMIT_PATTERN_CHARS = 400


def name_type(chars: int) -> sa.types.TypeEngine[str]:
    """A name column. MySQL and MariaDB compare strings case-insensitively by default, which
    would make subjects "Order" and "order" one key; their binary collation keeps names exact."""
    return sa.String(chars).with_variant(
        mysql.VARCHAR(chars, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


metadata = sa.MetaData()

servers_table = sa.Table(
    "qmq_meta_servers",
    metadata,
    sa.Column("role", name_type(ROLE_CHARS), primary_key=True),
    sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
    sa.Column("address", name_type(ADDRESS_CHARS_MAX), primary_key=True),
    sa.Column("http", name_type(ADDRESS_CHARS_MAX), nullable=False),
    sa.Column("pid", sa.BigInteger, nullable=False),
    sa.Column("role_in_group", name_type(ROLE_CHARS), nullable=False),
    sa.Column("registered_at_ms", sa.BigInteger, nullable=False),
    sa.Column("last_heartbeat_ms", sa.BigInteger, nullable=False),
    # Added with epochs: a database made before them gains these columns (see upgrade()).
    sa.Column("epoch", sa.BigInteger, nullable=True),
    sa.Column("log_end", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("action_end", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("replicated_ms", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("write_state", name_type(ROLE_CHARS), nullable=True),
)

groups_table = sa.Table(
    "qmq_meta_groups",
    metadata,
    sa.Column("role", name_type(ROLE_CHARS), primary_key=True),
    sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("master", name_type(ADDRESS_CHARS_MAX), nullable=False),
    sa.Column("message_offset", sa.BigInteger, nullable=True),
    sa.Column("action_offset", sa.BigInteger, nullable=True),
    sa.Column("changed_at_ms", sa.BigInteger, nullable=False),
    sa.Column("changed_by", name_type(OWNER_CHARS), nullable=False),
)

epochs_table = sa.Table(
    "qmq_meta_epochs",
    metadata,
    sa.Column("role", name_type(ROLE_CHARS), primary_key=True),
    sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
    sa.Column("epoch", sa.BigInteger, primary_key=True),
    sa.Column("master", name_type(ADDRESS_CHARS_MAX), nullable=False),
    sa.Column("message_offset", sa.BigInteger, nullable=False),
    sa.Column("action_offset", sa.BigInteger, nullable=False),
    sa.Column("started_at_ms", sa.BigInteger, nullable=False),
)

routes_table = sa.Table(
    "qmq_meta_routes",
    metadata,
    sa.Column("subject", name_type(SUBJECT_CHARS), primary_key=True),
    sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
    sa.Column("created_at_ms", sa.BigInteger, nullable=False),
)

leases_table = sa.Table(
    "qmq_meta_leases",
    metadata,
    sa.Column("name", name_type(ROLE_CHARS), primary_key=True),
    sa.Column("owner", name_type(OWNER_CHARS), nullable=False),
    sa.Column("url", name_type(URL_CHARS), nullable=False),
    sa.Column("expires_ms", sa.BigInteger, nullable=False),
)

push_table = sa.Table(
    "qmq_meta_push",
    metadata,
    sa.Column("subject", name_type(SUBJECT_CHARS), primary_key=True),
    sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
    sa.Column("url", sa.String(PUSH_URL_CHARS), nullable=False),
    sa.Column("concurrency", sa.Integer, nullable=False),
    sa.Column("rate_per_s", sa.Integer, nullable=False),
    sa.Column("timeout_ms", sa.Integer, nullable=False),
    sa.Column("secret", sa.String(PUSH_SECRET_CHARS), nullable=False),
    sa.Column("tags", sa.String(PUSH_LIST_CHARS), nullable=False),
    sa.Column("tag_type", name_type(ROLE_CHARS), nullable=False),
    sa.Column("start_from", name_type(ROLE_CHARS), nullable=False),
    sa.Column("max_retries", sa.Integer, nullable=False),
    sa.Column("retry_backoff_ms", sa.String(PUSH_LIST_CHARS), nullable=False),
    sa.Column("created_at_ms", sa.BigInteger, nullable=False),
    sa.Column("owner", name_type(OWNER_CHARS), nullable=False, server_default=""),
    sa.Column("owner_url", sa.String(URL_CHARS), nullable=False, server_default=""),
    sa.Column("lease_expires_ms", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("lease_generation", sa.BigInteger, nullable=False, server_default="0"),
)

alarms_table = sa.Table(
    "qmq_meta_alarms",
    metadata,
    sa.Column("subject", name_type(SUBJECT_CHARS), primary_key=True),
    sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
    sa.Column("lag_over", sa.BigInteger, nullable=False),
    sa.Column("for_ms", sa.BigInteger, nullable=False),
    sa.Column("webhook", sa.String(PUSH_URL_CHARS), nullable=False),
    sa.Column("secret", sa.String(PUSH_SECRET_CHARS), nullable=False),
    sa.Column("created_at_ms", sa.BigInteger, nullable=False),
    sa.Column("state", name_type(ROLE_CHARS), nullable=False, server_default="ok"),
    sa.Column("state_since_ms", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("lag", sa.BigInteger, nullable=False, server_default="-1"),
    sa.Column("checked_ms", sa.BigInteger, nullable=False, server_default="0"),
)

push_gateways_table = sa.Table(
    "qmq_meta_push_gateways",
    metadata,
    sa.Column("owner", name_type(OWNER_CHARS), primary_key=True),
    sa.Column("url", sa.String(URL_CHARS), nullable=False),
    sa.Column("last_seen_ms", sa.BigInteger, nullable=False),
    sa.Column("held_max", sa.Integer, nullable=False, server_default="0"),
)

# Quotas set at run time (`qmq limits set`; qmq.meta.limits): one row per app and pattern,
# applied by every broker and delay server on top of its auth file's.
limits_table = sa.Table(
    "qmq_meta_limits",
    metadata,
    sa.Column("app", name_type(LIMIT_APP_CHARS), primary_key=True),
    sa.Column("pattern", name_type(LIMIT_PATTERN_CHARS), primary_key=True),
    sa.Column("produce_msgs_per_s", sa.Float, nullable=False),
    sa.Column("produce_bytes_per_s", sa.Float, nullable=False),
    sa.Column("consume_msgs_per_s", sa.Float, nullable=False),
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
)


def create_or_upgrade(conn: sa.Connection) -> None:
    """Create the tables that are absent, then add the columns a table made by an older qmq lacks.

    Only nullable columns or columns with a server default are ever added, so ``ALTER TABLE ..
    ADD COLUMN`` fills existing rows the same way on every database.
    """
    metadata.create_all(conn, checkfirst=True)
    inspector = sa.inspect(conn)
    for table in metadata.sorted_tables:
        present = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in present:
                continue
            ddl = sa.schema.CreateColumn(column).compile(dialect=conn.dialect)
            conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {ddl}"))
