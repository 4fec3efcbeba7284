"""The meta store's tables of cluster operations (docs/cluster.md, "Operations"), beside those of
``qmq.meta.schema`` and created the same way (``create_or_upgrade`` creates what is absent):

    qmq_meta_group_states  key (role, group_name): a group taken out of writing; no row: writable
        state             "draining" (no new sends, consumers go on) | "removed" (unregistered for good)
        changed_at_ms, changed_by   when, and by whom (the operator the request named)

    qmq_meta_route_removals  key (subject, group_name): a route being retired; its row in
                      qmq_meta_routes stays, so consumers keep pulling what the group holds
        removed_at_ms, removed_by

    qmq_meta_backlogs  key (role, group_name): what the group's master last reported unconsumed
        address           the master that reported it
        total             messages left over every (subject, consumer group)
        pairs             (subject, consumer group) pairs with something left
        top               JSON [[subject, consumer group or null, left], ...], the largest first
        draining          whether the master already refused sends when it counted (so nothing can follow)
        reported_ms       when

    qmq_meta_history  one row per operation, oldest first (the latest HISTORY_KEPT kept)
        id, at_ms, who, action, target, detail
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa

from qmq.meta.schema import ADDRESS_CHARS_MAX, GROUP_CHARS, OWNER_CHARS, ROLE_CHARS, SUBJECT_CHARS, metadata, name_type

# Operations are done by hand: ten thousand is years of them.
HISTORY_KEPT: Final = 10_000
ACTION_CHARS: Final = 32
DETAIL_CHARS: Final = 2_000
TARGET_CHARS: Final = SUBJECT_CHARS + GROUP_CHARS + 2

group_states_table = sa.Table(
    "qmq_meta_group_states",
    metadata,
    sa.Column("role", name_type(ROLE_CHARS), primary_key=True),
    sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
    sa.Column("state", name_type(ROLE_CHARS), nullable=False),
    sa.Column("changed_at_ms", sa.BigInteger, nullable=False),
    sa.Column("changed_by", name_type(OWNER_CHARS), nullable=False),
)

route_removals_table = sa.Table(
    "qmq_meta_route_removals",
    metadata,
    sa.Column("subject", name_type(SUBJECT_CHARS), primary_key=True),
    sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
    sa.Column("removed_at_ms", sa.BigInteger, nullable=False),
    sa.Column("removed_by", name_type(OWNER_CHARS), nullable=False),
)

backlogs_table = sa.Table(
    "qmq_meta_backlogs",
    metadata,
    sa.Column("role", name_type(ROLE_CHARS), primary_key=True),
    sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
    sa.Column("address", name_type(ADDRESS_CHARS_MAX), nullable=False),
    sa.Column("total", sa.BigInteger, nullable=False),
    sa.Column("pairs", sa.BigInteger, nullable=False),
    sa.Column("top", sa.Text, nullable=False),
    sa.Column("draining", sa.Boolean, nullable=False),
    sa.Column("reported_ms", sa.BigInteger, nullable=False),
)

history_table = sa.Table(
    "qmq_meta_history",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("at_ms", sa.BigInteger, nullable=False),
    sa.Column("who", name_type(OWNER_CHARS), nullable=False),
    sa.Column("action", name_type(ACTION_CHARS), nullable=False),
    sa.Column("target", name_type(TARGET_CHARS), nullable=False),
    sa.Column("detail", sa.String(DETAIL_CHARS), nullable=False),
)
