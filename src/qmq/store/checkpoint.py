"""Checkpoints: a consistent snapshot of offsets and consumer progress, replaced atomically.

Written to a temporary file, fsynced, renamed over the old one, and the directory fsynced,
so a crash leaves either the old checkpoint or the new one, never a mix. The payload is a
msgpack map with a CRC32C in front so a damaged file is noticed instead of trusted.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any

import crc32c
import msgpack

from qmq.store.segments import fsync_dir

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<4sI")
_MAGIC = b"QMCK"
NAME = "checkpoint"


def write_checkpoint(directory: Path, state: dict[str, Any]) -> None:
    payload = msgpack.packb(state, use_bin_type=True)
    tmp = directory / (NAME + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, _HEAD.pack(_MAGIC, crc32c.crc32c(payload)) + payload)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / NAME)
    fsync_dir(directory)


def read_checkpoint(directory: Path) -> dict[str, Any] | None:
    path = directory / NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(raw) < _HEAD.size:
        log.warning("checkpoint %s is too short (%d bytes); recovering from the start of the logs", path, len(raw))
        return None
    magic, crc = _HEAD.unpack_from(raw)
    payload = raw[_HEAD.size :]
    if magic != _MAGIC or crc32c.crc32c(payload) != crc:
        log.warning("checkpoint %s is damaged; recovering from the start of the logs", path)
        return None
    state = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return state if isinstance(state, dict) else None
