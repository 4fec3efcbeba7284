"""The subjects of a broker's store: each one's consume log and sequences, found by name or
by the raw name bytes a send carries; and when each one's new messages become visible.

A subject's ``next_seq`` is the sequence its next message gets; pulls see the sequences below
its ``visible_seq``. Under the sync policy a message becomes visible once the fsync of its
batch returns (``publish`` queues the batch, ``flushed`` releases it); under the periodic
policy as soon as it is written.

The consume logs' files are opened when used and closed least recently used first, at most
``files_max`` at once whatever the number of subjects (``files``, see open_files.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from qmq.common.errors import InvalidSubjectError
from qmq.common.limits import Limits
from qmq.common.naming import check_subject, parse_internal_subject, subject_file_name
from qmq.store import fileio
from qmq.store.consume_log import ConsumeLog
from qmq.store.open_files import OpenFiles, files_max_within_limit

_DEAD_NAMES_CACHED_MAX = 10_000


@dataclass(slots=True, eq=False)
class SubjectState:
    name: str
    clog: ConsumeLog
    next_seq: int
    visible_seq: int
    pending: bytearray = field(default_factory=bytearray)  # entries packed, not yet appended


class Subjects:
    def __init__(self, consume_dir: Path, entries_per_segment: int, limits: Limits, files_max: int) -> None:
        self.consume_dir = consume_dir
        fileio.make_dirs(consume_dir)
        self._entries_per_segment = entries_per_segment
        self._limits = limits
        self.files = OpenFiles(files_max_within_limit(files_max))
        self.by_name: dict[str, SubjectState] = {}
        self._by_raw: dict[bytes, SubjectState] = {}
        self._dead_names: dict[bytes, str] = {}
        # sync policy: appended batches waiting for fsync: (end_offset, [(subject state, next_seq)])
        self._unflushed: deque[tuple[int, list[tuple[SubjectState, int]]]] = deque()
        self.unflushed_bytes = 0

    # -- lookups -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[SubjectState]:
        return iter(self.by_name.values())

    def get(self, name: str) -> SubjectState | None:
        return self.by_name.get(name)

    def state(self, name: str, directory: str | None = None, names: list[str] | None = None) -> SubjectState:
        """The subject named ``name``, its consume log opened (and created) if it was not yet
        (in ``directory``, holding ``names``, when recovery found it there)."""
        st = self.by_name.get(name)
        if st is None:
            if directory is None:
                directory = f"{self.consume_dir}/{subject_file_name(name)}"
            clog = ConsumeLog(directory, name, self._entries_per_segment, self.files, names)
            st = SubjectState(name, clog, clog.next_seq, clog.next_seq)
            self.by_name[name] = st
            self._by_raw[name.encode("utf-8")] = st
        return st

    def for_raw(self, raw: bytes) -> SubjectState:
        """The subject a send names by ``raw``, checked (``InvalidSubjectError``) the first time."""
        st = self._by_raw.get(raw)
        if st is not None:
            return st
        name = _decoded(raw)
        check_subject(name, self._limits)
        return self.state(name)

    def dead_name(self, raw: bytes) -> str:
        """The name of the dead-letter subject a send names by ``raw``, checked."""
        name = self._dead_names.get(raw)
        if name is None:
            name = _decoded(raw)
            parse_internal_subject(name, self._limits)
            if len(self._dead_names) < _DEAD_NAMES_CACHED_MAX:
                self._dead_names[raw] = name
        return name

    def open_all(self) -> list[Path]:
        """Open the consume log of every subject in the directory; returns the directories
        that name no subject (ignored)."""
        unnamed = []
        for entry in sorted(fileio.listdir(self.consume_dir)):  # names, not Paths: 40,000 sort fast
            directory = f"{self.consume_dir}/{entry}"
            try:
                names = fileio.listdir(directory)  # listed once: for its subject and its segments
            except NotADirectoryError:
                unnamed.append(Path(directory))
                continue
            name = ConsumeLog.subject_in(directory, names)
            if name is None:
                unnamed.append(Path(directory))
            else:
                self.state(name, directory, names)
        return unnamed

    # -- visibility --------------------------------------------------------------------

    def publish(
        self, touched: dict[SubjectState, int], log_end: int, nbytes: int, sync_policy: bool, visible_now: bool
    ) -> None:
        """One append's messages (``touched``: each subject's first new sequence; its
        ``next_seq`` is already past them, and ``nbytes`` end at ``log_end``) become visible
        now, or once what they were written with is fsynced.

        ``visible_now`` (copies of held records, already durable) skips waiting for the fsync
        wherever nothing earlier of the subject still waits for one.
        """
        if not sync_policy:
            for st in touched:
                st.visible_seq = st.next_seq
        elif not visible_now:
            self._unflushed.append((log_end, [(st, st.next_seq) for st in touched]))
            self.unflushed_bytes += nbytes
        else:
            waiting = []
            for st, first in touched.items():
                if st.visible_seq == first:
                    st.visible_seq = st.next_seq
                else:  # an earlier message of the subject waits for its fsync: this one waits behind it
                    waiting.append((st, st.next_seq))
            if waiting:
                self._unflushed.append((log_end, waiting))
                self.unflushed_bytes += nbytes

    def flushed(self, offset: int, unflushed_bytes: int) -> set[str]:
        """The message log is fsynced up to ``offset`` (``unflushed_bytes`` after it): what
        waited for it becomes visible. Returns the subjects that moved."""
        moved: set[str] = set()
        unflushed = self._unflushed
        while unflushed and unflushed[0][0] <= offset:
            _end, seqs = unflushed.popleft()
            for st, seq in seqs:
                if seq > st.visible_seq:
                    st.visible_seq = seq
                    moved.add(st.name)
        self.unflushed_bytes = unflushed_bytes if unflushed else 0
        return moved

    def close(self) -> None:
        for st in self.by_name.values():
            st.clog.close()
        self.by_name = {}
        self._by_raw = {}


def _decoded(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidSubjectError(f"subject {raw[:60]!r} is not valid UTF-8") from None
