"""Checkpoints: a consistent snapshot of offsets and consumer progress, replaced atomically.

Written to a temporary file, fsynced, renamed over the old one, and the directory fsynced,
so a crash leaves either the old checkpoint or the new one, never a mix. The payload is a
msgpack map with a CRC32C in front so a damaged file is noticed instead of trusted.

A store may also keep the last few checkpoints as ``checkpoint.<key>`` (``history_max``):
a broker demoted after a failover cuts its logs back to where its new master's copy ended
and recovers from the newest kept checkpoint at or before that point.
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


def write_checkpoint(
    directory: Path, state: dict[str, Any], history_key: int | None = None, history_max: int = 0
) -> None:
    payload = msgpack.packb(state, use_bin_type=True)
    data = _HEAD.pack(_MAGIC, crc32c.crc32c(payload)) + payload
    if history_key is not None and history_max > 0:
        _write_replacing(directory, f"{NAME}.{history_key:020d}", data)
        for old in history(directory)[:-history_max]:
            old.unlink(missing_ok=True)
    _write_replacing(directory, NAME, data)
    fsync_dir(directory)


def _write_replacing(directory: Path, name: str, data: bytes) -> None:
    tmp = directory / (name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / name)


def history(directory: Path) -> list[Path]:
    """The kept checkpoints, oldest first."""
    return sorted(p for p in directory.glob(f"{NAME}.*") if p.suffix != ".tmp" and p.name[len(NAME) + 1 :].isdigit())


def read_checkpoint(directory: Path, path: Path | None = None) -> dict[str, Any] | None:
    """The checkpoint (or the kept one at ``path``); None when there is none or it is damaged."""
    path = path or directory / NAME
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
