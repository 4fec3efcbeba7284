"""The archive's bookkeeping as transactions: a manifest per committed batch.

Every run of ``qmq archive`` and every micro-batch of ``qmq archive --follow`` is one batch:

1. ``workspace()`` makes a directory ``_qmq/work/<token>/`` and holds an exclusive ``flock``
   on ``_qmq/work/<token>.lock`` while the batch runs. Spark writes the batch's Parquet files
   there (``subject=…/date=…/part-*.parquet``, ``_groups/…``, ``_dead/…``: the archive's own
   layout, relative to the workspace).
2. ``commit()`` writes manifest ``_qmq/manifests/<number>.json`` — the new state (per broker
   group and subject the next sequence to archive; per dead-letter subject the last letter)
   and the files to move — to a temporary file, fsyncs it and hard-links it to its name.
   The link is the commit: it is atomic, and it fails when that number exists, so of two
   writers that read the same state only one commits; the other starts its batch again.
3. Then the files move (rename) from the workspace to their place in the archive.

``load()`` reads the newest manifest and first finishes the moves of any manifest whose
workspace is still there (a writer stopped between 2 and 3: roll forward), and removes every
workspace no live process holds (a writer stopped before 2: its files are never seen; roll
back). Readers (``spark.read.parquet(archive)``, ``qmq query``, ``trace``, ``report``) see
only the archive's own directories — names starting with ``_`` are hidden from them — so they
read the archive unchanged, and a row is in it once whatever stopped when.

An archive made before manifests (``_qmq_archive.json`` only) is read as manifest 0.
The archive directory must be one file system that every writer's driver sees (local disk, or
a shared one with working ``flock`` and hard links, such as NFSv4); executors write into the
workspace, so they must see it too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qmq.common.errors import ConfigError, QmqError
from qmq.spark.offsets import Positions, from_json, to_json

log = logging.getLogger(__name__)

LEDGER_DIR = "_qmq"
MANIFESTS = "manifests"
WORK = "work"
LEGACY_STATE_FILE = "_qmq_archive.json"
_MANIFEST_VERSION = 2
_LEGACY_VERSION = 1
# Manifests kept after a commit (older ones, whose moves are done, are removed).
MANIFESTS_KEPT = 50
_NUMBER_DIGITS = 12


class ConflictError(QmqError):
    """Another writer committed this manifest number first: load again and redo the batch."""


@dataclass
class ArchiveState:
    """What the archive holds: the state of its newest manifest."""

    offsets: Positions = field(default_factory=dict)
    dead: dict[str, int] = field(default_factory=dict)  # "<broker group>/<dead subject>" -> last letter
    number: int = 0  # of the manifest this state comes from (0: none yet)

    @classmethod
    def load(cls, archive: Path) -> ArchiveState:
        """The committed state (after recovering what a stopped writer left)."""
        return Ledger(archive).load()


@dataclass(frozen=True)
class Workspace:
    """A batch's private directory and its held lock."""

    token: str
    path: Path


def _manifest_name(number: int) -> str:
    return f"{number:0{_NUMBER_DIGITS}d}.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Ledger:
    """The bookkeeping of one archive directory (see the module docstring)."""

    def __init__(self, archive: Path) -> None:
        self.archive = archive
        self.manifests = archive / LEDGER_DIR / MANIFESTS
        self.work = archive / LEDGER_DIR / WORK

    # -- reading ---------------------------------------------------------------------------

    def _numbers(self) -> list[int]:
        try:
            names = os.listdir(self.manifests)
        except FileNotFoundError:
            return []
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def _read(self, number: int) -> dict[str, Any]:
        path = self.manifests / _manifest_name(number)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ConfigError(f"manifest {path} is not valid JSON ({exc}); restore it from a backup") from None
        if not isinstance(doc, dict) or doc.get("version") != _MANIFEST_VERSION:
            raise ConfigError(f"{path} is not an archive manifest of version {_MANIFEST_VERSION}")
        return doc

    def _read_kept(self, number: int) -> dict[str, Any] | None:
        """Manifest ``number``, or None when another writer removed it (an old one) meanwhile."""
        try:
            return self._read(number)
        except FileNotFoundError:
            return None

    def load(self) -> ArchiveState:
        """Recover (roll forward, clean up), then the newest committed state."""
        numbers = self._numbers()
        for number in numbers:
            doc = self._read_kept(number)
            if doc is not None:
                self._roll_forward(number, doc)
        self.clean_workspaces()
        if numbers:
            doc = self._read(numbers[-1])
            return ArchiveState(
                from_json(doc.get("offsets", {})), {str(k): int(v) for k, v in doc.get("dead", {}).items()}, numbers[-1]
            )
        return self._legacy()

    def _legacy(self) -> ArchiveState:
        path = self.archive / LEGACY_STATE_FILE
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return ArchiveState()
        except ValueError as exc:
            raise ConfigError(
                f"{path} is not valid JSON ({exc}); restore it, or archive into a new directory"
            ) from None
        if not isinstance(doc, dict) or doc.get("version") != _LEGACY_VERSION:
            raise ConfigError(f"{path} is not an archive state file of version {_LEGACY_VERSION}; use a new directory")
        return ArchiveState(from_json(doc.get("offsets", {})), {str(k): int(v) for k, v in doc.get("dead", {}).items()})

    # -- workspaces --------------------------------------------------------------------------

    @contextlib.contextmanager
    def workspace(self) -> Iterator[Workspace]:
        """A locked directory for one batch; removed on leaving (its files moved or not)."""
        self.work.mkdir(parents=True, exist_ok=True)
        for _ in range(10):  # bounded: a cleaner removing a fresh lock file is rare
            token = f"{time.time_ns() // 1_000_000}-{secrets.token_hex(4)}"
            lock_path = self.work / f"{token}.lock"
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # a cleaner took it between create and lock: take another
        else:
            raise QmqError(f"could not lock a workspace in {self.work}; is another process cleaning it in a loop?")
        path = self.work / token
        try:
            path.mkdir()
            yield Workspace(token, path)
        finally:
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)
            os.close(fd)

    def clean_workspaces(self) -> int:
        """Remove the workspaces of writers that are gone (their lock is free); how many."""
        try:
            names = os.listdir(self.work)
        except FileNotFoundError:
            return 0
        removed = 0
        tokens = {n[: -len(".lock")] for n in names if n.endswith(".lock")}
        for name in names:
            if name.endswith(".lock"):
                continue
            if name not in tokens:  # a directory without its lock: its writer is gone
                shutil.rmtree(self.work / name, ignore_errors=True)
                removed += 1
        for token in tokens:
            lock_path = self.work / f"{token}.lock"
            try:
                fd = os.open(lock_path, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # a live writer's
                raise
            try:
                shutil.rmtree(self.work / token, ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock_path)
                removed += 1
                log.info("removed workspace %s of an archive batch that was never committed", token)
            finally:
                os.close(fd)
        return removed

    # -- committing --------------------------------------------------------------------------

    @staticmethod
    def staged_files(ws: Workspace) -> list[str]:
        """The Parquet files written into ``ws``, relative to it (Spark's own ``_temporary``,
        ``_SUCCESS`` and checksum files left out)."""
        out = []
        for path in sorted(ws.path.rglob("*.parquet")):
            rel = path.relative_to(ws.path)
            if any(part.startswith(".") or part == "_temporary" for part in rel.parts):
                continue
            out.append(rel.as_posix())
        return out

    def commit(self, before: ArchiveState, after: ArchiveState, ws: Workspace, info: dict[str, Any]) -> int:
        """Commit the batch of ``ws`` as manifest ``before.number + 1`` and move its files into
        place; ConflictError when another writer committed that number first. Returns it."""
        number, doc = self.write_manifest(before, after, ws, info)
        self._roll_forward(number, doc)
        self._drop_old(number)
        legacy = self.archive / LEGACY_STATE_FILE
        if legacy.exists():  # its state now lives in the manifests
            legacy.unlink()
        return number

    def write_manifest(
        self, before: ArchiveState, after: ArchiveState, ws: Workspace, info: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        """The commit point alone (its files not moved yet): the manifest's number and content."""
        number = before.number + 1
        files = self.staged_files(ws)
        doc = {
            "version": _MANIFEST_VERSION,
            "number": number,
            "committed_at_ms": time.time_ns() // 1_000_000,
            "workspace": ws.token,
            "files": files,
            "offsets": to_json(after.offsets),
            "dead": dict(sorted(after.dead.items())),
            **info,
        }
        self.manifests.mkdir(parents=True, exist_ok=True)
        tmp = self.manifests / f".{ws.token}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.manifests / _manifest_name(number))
        except FileExistsError:
            raise ConflictError(
                f"another archive run committed batch {number} of {self.archive} first"
            ) from None
        finally:
            os.unlink(tmp)
        _fsync_dir(self.manifests)
        after.number = number
        return number, doc

    def _roll_forward(self, number: int, doc: dict[str, Any]) -> None:
        """Move what is left of manifest ``number``'s files from its workspace into place."""
        ws = self.work / str(doc.get("workspace", ""))
        if not doc.get("workspace") or not ws.is_dir():
            return
        parents: set[Path] = set()
        for rel in doc.get("files", []):
            src = ws / rel
            dst = self.archive / rel
            if not src.exists():
                continue  # moved before
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(src, dst)
            except FileNotFoundError:
                continue  # another process finishing the same manifest moved it first
            parents.add(dst.parent)
        for parent in parents:
            _fsync_dir(parent)
        # the files are in place: the workspace (its lock is its writer's, or free) goes
        shutil.rmtree(ws, ignore_errors=True)
        log.debug("manifest %d: files in place", number)

    def _drop_old(self, newest: int) -> None:
        for number in self._numbers():
            if number > newest - MANIFESTS_KEPT:
                break
            doc = self._read_kept(number)
            if doc is not None and not (self.work / str(doc.get("workspace", ""))).is_dir():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.manifests / _manifest_name(number))
