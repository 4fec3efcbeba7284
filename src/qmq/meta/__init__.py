"""The meta server: registry of broker and delay groups, heartbeats, subject routes, and
client discovery over HTTP/JSON (``GET /meta/address``)."""

from qmq.meta.server import MetaServer, MetaStartupError, run_meta

__all__ = ["MetaServer", "MetaStartupError", "run_meta"]
