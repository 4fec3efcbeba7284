"""The broker's listings — SUBJECTS, LAG and DEAD_LETTERS — one page at a time: each function
reads a request header and the store and returns the page's answer document, cut at its
``limit`` or at ``answers.PAGE_BYTES_MAX`` with a ``next`` cursor when more follow
(docs/protocol.md). Nothing here answers: the handlers send what it returns."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Any

from qmq.common.naming import dead_subject
from qmq.protocol.answers import Page, encode_answer, pack
from qmq.serving.requests import BadRequest, get_group, get_int, get_subject
from qmq.store.broker_store import BrokerStore

# items of one SUBJECTS or LAG page at most (a page's bytes are bounded too: PAGE_BYTES_MAX)
_LIST_ITEMS_MAX = 10_000
_DEAD_LIST_MAX = 1000
# DEAD_LETTERS of one message id answers its body up to this much (and says how long it is)
_BODY_SHOWN_BYTES_MAX = 64 * 1024
_MESSAGE_ID_CHARS_MAX = 256
# what a subject's item takes besides its groups: the "groups" key and the array's header
_GROUPS_OVERHEAD_BYTES = 16


def subjects_page(store: BrokerStore, header: dict[str, Any]) -> bytes:
    """Every subject with messages or consumer groups (a group may wait for a subject's first
    message), by name, with its groups by name. A subject's groups may run on into the next
    page, which then lists the subject again with the rest of them; the cursor is the last
    (subject, group) listed, the group None for a subject without groups."""
    after = header.get("after")
    if after is not None and not _is_subjects_cursor(after):
        raise BadRequest(f"'after' = {after!r:.300} is not a SUBJECTS cursor; pass back the 'next' of the last page")
    limit = get_int(header, "limit", 1, _LIST_ITEMS_MAX, default=_LIST_ITEMS_MAX)
    groups_of: dict[str, list[str]] = {}
    for subject, group in store.progress.groups:
        groups_of.setdefault(subject, []).append(group)
    names = sorted(set(store.subjects) | set(groups_of))
    page = Page(limit)
    last: list[Any] | None = None
    for name in names[bisect_left(names, after[0]) if after else 0 :]:
        groups = sorted(groups_of.get(name, ()))
        if after and name == after[0]:
            if after[1] is None:
                continue  # listed whole
            groups = groups[bisect_right(groups, after[1]) :]
            if not groups:
                continue
        if not page.has_room():
            break
        st = store.subjects.get(name)
        item = {"subject": name, "messages": st.visible_seq if st else 0, "first": st.clog.min_seq if st else 0}
        room = page.room_bytes - len(pack(item)) - _GROUPS_OVERHEAD_BYTES
        taken = _names_within(groups, room, first=not page.items)
        if groups and not taken:
            page.full = True
            break
        if not page.add_packed(pack({**item, "groups": groups[:taken]})):
            break
        last = [name, groups[taken - 1] if taken else None]
        if taken < len(groups):
            page.full = True
            break
    fields: dict[str, Any] = {"next": last} if page.full else {}
    return encode_answer(fields, {"subjects": page.items})


def lag_page(store: BrokerStore, header: dict[str, Any], now_ms: int, consumer_offline_ms: int) -> bytes:
    """How far a group is behind, and one page of its consumers by id (``limit`` 0: none).

    Each consumer has the time it was last seen (its last pull or ack, broker's clock) and
    ``offline``: silent for ``consumer_offline_ms`` or longer, so its unacknowledged messages
    go to retry. The answer carries the broker's ``time_ms``, so a reader can say how long
    ago without trusting its own clock."""
    subject = get_subject(header)
    group = get_group(header)
    after = header.get("after")
    if after is not None and not isinstance(after, str):
        raise BadRequest(f"'after' must be a consumer id (a string), got {type(after).__name__}")
    limit = get_int(header, "limit", 0, _LIST_ITEMS_MAX, default=_LIST_ITEMS_MAX)
    st = store.subjects.get(subject)
    messages = st.visible_seq if st else 0
    gp = store.progress.get(subject, group)
    if gp is None:
        if st is None and not store.progress.groups_of(subject):
            raise BadRequest(f"subject {subject!r} is unknown here: it has no messages and no consumer groups")
        raise BadRequest(f"consumer group {group!r} has never pulled {subject!r}")
    page = Page(limit)
    last: str | None = None
    if limit:
        ids = sorted(gp.consumers)
        for consumer_id in ids[bisect_right(ids, after) if after is not None else 0 :]:
            cp = gp.consumers[consumer_id]
            row = {
                "consumer_id": consumer_id,
                "pulled": cp.pull_log_end,
                "ack_offset": cp.ack_offset,
                "unacked": cp.unacked,
                "last_seen_ms": cp.last_seen_ms,
                "since_ms": cp.since_ms or None,
                "offline": now_ms - cp.last_seen_ms >= consumer_offline_ms,
            }
            if not page.add(row):
                break
            last = consumer_id
    fields: dict[str, Any] = {
        "subject": subject,
        "group": group,
        "messages": messages,
        "pull_offset": gp.pull_offset,
        "backlog": max(0, messages - gp.pull_offset),
        "unacked": sum(cp.unacked for cp in gp.consumers.values()),
        "consumers_total": len(gp.consumers),
        "ordered": gp.ordered,
        "consumers_offline": sum(now_ms - cp.last_seen_ms >= consumer_offline_ms for cp in gp.consumers.values()),
        "consumer_offline_ms": consumer_offline_ms,
        "time_ms": now_ms,
    }
    if page.full:
        fields["next"] = last
    return encode_answer(fields, {"consumers": page.items})


def dead_letters_page(store: BrokerStore, header: dict[str, Any]) -> bytes:
    """A group's live dead letters after letter ``after``, oldest first; with ``message_id``, only
    that message's, each with its properties and body (the first 64 KiB)."""
    subject = get_subject(header)
    group = get_group(header)
    limit = get_int(header, "limit", 1, _DEAD_LIST_MAX, default=100)
    after = get_int(header, "after", -1, 1 << 62, default=-1)
    message_id = header.get("message_id")
    if message_id is not None and (not isinstance(message_id, str) or len(message_id) > _MESSAGE_ID_CHARS_MAX):
        raise BadRequest(f"message_id must be a string of at most {_MESSAGE_ID_CHARS_MAX} characters")
    name = dead_subject(subject, group)
    page = Page(limit)
    last = after
    # one more than the limit: whether a next page has any
    for letter in store.dead.letters(name, after=after, limit=limit + 1, message_id=message_id):
        described = letter.describe()
        if message_id is not None:  # one message's letters: with what it carried (the console shows it)
            described.update(letter.contents(_BODY_SHOWN_BYTES_MAX))
        if not page.add(described):
            break
        last = letter.number
    fields: dict[str, Any] = {"total": store.dead.live(name)}
    if page.full:
        fields["next"] = last
    return encode_answer(fields, {"letters": page.items})


def _is_subjects_cursor(value: object) -> bool:
    """``[subject, group or None]``, as SUBJECTS answers it in ``next``."""
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and (value[1] is None or isinstance(value[1], str))
    )


def _names_within(names: list[str], room_bytes: int, *, first: bool) -> int:
    """How many of ``names`` fit ``room_bytes`` packed (at least one when ``first``: the first
    item of a page always fits)."""
    used = 0
    for n, name in enumerate(names):
        used += len(pack(name))
        if used > room_bytes:
            return max(n, 1) if first else n
    return len(names)
