"""Replication between the brokers of a group (docs/cluster.md): what a broker master sends its
slaves (whole records of its message log and action log, ``store.replica``) and what a broker
slave does with them. The request loop, the long poll, the waiting answers of sends and acks,
which requesters count as slaves (those the meta server names) and the group's write state are
every role's (``qmq.serving.replication``).
"""

from __future__ import annotations

from collections.abc import Callable
from ssl import SSLContext
from typing import Any

from qmq.auth.handshake import ClientCredentials
from qmq.client.connection import Connection
from qmq.common.config import BrokerConfig
from qmq.protocol.frame import Frame
from qmq.serving import replication
from qmq.store.broker_store import BrokerStore
from qmq.store.replica import Chunk, append_actions, append_log, read_actions, read_log

CONNECT_TIMEOUT_MS = 3000


class ReplicationSource(replication.ReplicationSource):
    """A broker master's side: answers carry a message-log chunk and an action-log chunk."""

    def __init__(self, store_of: Callable[[], BrokerStore], config: BrokerConfig) -> None:
        def read(header: dict[str, Any]) -> tuple[dict[str, Any], list[bytes], bool]:
            store = store_of()
            budget = min(int(header.get("max_bytes", replication.CHUNK_BYTES_MAX)), replication.CHUNK_BYTES_MAX)
            log_chunk = read_log(store, header["from"], budget)
            act_chunk = read_actions(store, header["action_from"], budget)
            fields = {
                "offset": log_chunk.offset,
                "segment_base": log_chunk.segment_base,
                "count": len(log_chunk.data),
                "action_offset": act_chunk.offset,
                "action_segment_base": act_chunk.segment_base,
                "action_count": len(act_chunk.data),
            }
            parts = [c for c in (log_chunk.data, act_chunk.data) if c]
            return fields, parts, bool(parts)

        def ends() -> tuple[int, int]:
            store = store_of()
            return store.mlog.end, store.alog.end

        super().__init__(read, config, ends)
        self.store_of = store_of


class Replicator(replication.Replicator):
    """A broker slave's loop: appends the master's records and indexes them (``store.replica``)."""

    def __init__(
        self,
        store_of: Callable[[], BrokerStore],
        master: str,
        epoch: int,
        me: str,
        on_data: Callable[[set[str]], None],
        credentials: ClientCredentials | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        def ask() -> dict[str, Any]:
            store = store_of()
            return {"from": store.mlog.end, "action_from": store.alog.end}

        def take(frame: Frame) -> None:
            store = store_of()
            h = frame.header
            body = bytes(frame.body)
            n = int(h["count"])
            touched = append_log(store, Chunk(int(h["offset"]), int(h["segment_base"]), body[:n]))
            append_actions(store, Chunk(int(h["action_offset"]), int(h["action_segment_base"]), body[n:]))
            if touched:
                on_data(touched)

        conn = Connection(master, connect_timeout_ms=CONNECT_TIMEOUT_MS, credentials=credentials, ssl=ssl)
        super().__init__(master, epoch, me, conn, ask, take)
