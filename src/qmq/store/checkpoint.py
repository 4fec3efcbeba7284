"""Checkpoints: a consistent snapshot of offsets and consumer progress, replaced atomically.

Written to a temporary file, fsynced, renamed over the old one, and the directory fsynced,
so a crash leaves either the old checkpoint or the new one, never a mix. The payload is a
msgpack map with a CRC32C in front so a damaged file is noticed instead of trusted.

A store may also keep the last few checkpoints as ``checkpoint.<key>`` (``history_max``):
a broker demoted after a failover cuts its logs back to where its new master's copy ended
and recovers from the newest kept checkpoint at or before that point, and recovery falls back
to the newest kept one that checks out when the latest is damaged (``candidates``).

The payload's ``version`` is its format version: a checkpoint of a later version, or one that
passes its CRC but does not decode, is refused (StoreError naming it), never taken for damage.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any

import crc32c
import msgpack

from qmq.protocol.packing import packb
from qmq.store import fileio
from qmq.store.datadir import StoreError

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<4sI")
_MAGIC = b"QMCK"
NAME = "checkpoint"
FORMAT_VERSION = 1  # of the payload: its "version"; the broker's and the delay server's agree


class DamagedCheckpoint(Exception):
    """A checkpoint file that does not check out (cut short, or failing its CRC); the text says how."""


def write_checkpoint(
    directory: Path, state: dict[str, Any], history_key: tuple[int, ...] = (), history_max: int = 0
) -> None:
    """Replace the checkpoint with ``state``; with ``history_max``, also keep it as
    ``checkpoint.<key>`` (``history_key``: numbers that grow with time, e.g. log offsets),
    keeping the newest ``history_max`` of those."""
    payload = packb(state)
    data = _HEAD.pack(_MAGIC, crc32c.crc32c(payload)) + payload
    if history_key and history_max > 0:
        _write_replacing(directory, f"{NAME}." + ".".join(f"{k:020d}" for k in history_key), data)
        for old in history(directory)[:-history_max]:
            fileio.unlink(old, missing_ok=True)
    _write_replacing(directory, NAME, data)
    fileio.fsync_dir(directory)


def _write_replacing(directory: Path, name: str, data: bytes) -> None:
    tmp = directory / (name + ".tmp")
    fd = fileio.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        fileio.write_all(fd, data)
        fileio.fsync(fd)
    finally:
        fileio.close(fd)
    fileio.replace(tmp, directory / name)


def history(directory: Path) -> list[Path]:
    """The kept checkpoints, oldest first (by key; keys of one number were written by older versions)."""
    prefix = f"{NAME}."
    return sorted(
        directory / name
        for name in fileio.listdir(directory)
        if name.startswith(prefix) and not name.endswith(".tmp") and name[len(prefix) :].replace(".", "").isdigit()
    )


def candidates(directory: Path) -> list[Path]:
    """The checkpoint, then the kept ones newest first: where recovery looks, in order."""
    return [directory / NAME, *reversed(history(directory))]


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path``; None when there is none. DamagedCheckpoint when it does not
    check out; StoreError when it does but is of a later format version or does not decode."""
    try:
        raw = fileio.read_file(path)
    except FileNotFoundError:
        return None
    if len(raw) < _HEAD.size:
        raise DamagedCheckpoint(f"{len(raw)} bytes, too short")
    magic, crc = _HEAD.unpack_from(raw)
    payload = raw[_HEAD.size :]
    if magic != _MAGIC:
        raise DamagedCheckpoint(f"magic {magic!r}, not {_MAGIC!r}")
    if crc32c.crc32c(payload) != crc:
        raise DamagedCheckpoint("it fails its CRC")
    try:
        state = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises many types for bad input
        state = None
    if not isinstance(state, dict):
        raise StoreError(
            f"checkpoint {path} passes its CRC but does not decode as a checkpoint of format version "
            f"{FORMAT_VERSION}; another version of qmq wrote it: run that version"
        )
    version = state.get("version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise StoreError(
            f"checkpoint {path} has format version {version}; this qmq reads checkpoints of format versions "
            f"1 to {FORMAT_VERSION}: run the qmq version that wrote it (or a later one)"
        )
    return state


def newest_checkpoint(directory: Path) -> dict[str, Any] | None:
    """The newest checkpoint that checks out, the latest or a kept one (damaged ones are logged)."""
    for path in candidates(directory):
        state = read_checkpoint(directory, path)
        if state is not None:
            return state
    return None


def read_checkpoint(directory: Path, path: Path | None = None) -> dict[str, Any] | None:
    """The checkpoint (or the kept one at ``path``); None when there is none or it is damaged
    (logged). StoreError as ``load_checkpoint``."""
    path = path or directory / NAME
    try:
        return load_checkpoint(path)
    except DamagedCheckpoint as exc:
        log.warning("checkpoint %s is damaged (%s); not used", path, exc)
        return None
