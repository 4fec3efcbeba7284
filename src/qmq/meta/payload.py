"""What the meta server accepts from the network: the register body, the promote body and the
subjects asked for.

Each check names the field, the value and what is allowed, so a server or client that
sends something wrong learns what to fix from the 400 answer alone. Unknown keys in a
register body are ignored, so newer servers can report more to an older meta server.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any, Final

from qmq.common.errors import InvalidSubjectError
from qmq.common.limits import META_SUBJECTS_PER_REQUEST_MAX
from qmq.common.naming import check_name, check_subject
from qmq.meta.decisions import ROLES, ROLES_IN_GROUP, WRITE_STATES, Registration, Role, RoleInGroup, WriteState
from qmq.meta.store import ADDRESS_CHARS_MAX

# A register body is a handful of short strings; anything larger is not one.
REGISTER_BODY_BYTES_MAX: Final = 16 * 1024
# META_SUBJECTS_PER_REQUEST_MAX bounds the routing work of one GET /meta/address: 256
# subjects of up to 100 characters fit in REQUEST_LINE_BYTES_MAX.
# Longest request line (method, path and query) the server reads.
REQUEST_LINE_BYTES_MAX: Final = 64 * 1024
# Process ids, epochs, offsets and times fit in a signed 64-bit column.
_INT_MAX: Final = (1 << 63) - 1


class PayloadError(ValueError):
    """A request field is missing or wrong; ``field`` names it."""

    def __init__(self, field: str, text: str) -> None:
        self.field = field
        super().__init__(text)


def _host_port(field: str, value: object) -> str:
    if not isinstance(value, str):
        raise PayloadError(field, f'{field} must be a string "host:port", got {type(value).__name__} {value!r}')
    if len(value) > ADDRESS_CHARS_MAX:
        raise PayloadError(field, f"{field} {value[:40]!r}… is longer than {ADDRESS_CHARS_MAX} characters")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise PayloadError(
            field,
            f'{field} {value!r} is not "host:port" with a port from 1 to 65535 (e.g. "127.0.0.1:20881")',
        )
    if any(ch.isspace() for ch in host):
        raise PayloadError(field, f"{field} {value!r} has whitespace in its host")
    return value


def _choice(field: str, value: object, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise PayloadError(field, f"{field} {value!r} is not allowed; use one of {', '.join(map(repr, allowed))}")
    return typing.cast(str, value)


def parse_registration(body: object) -> Registration:
    """The Registration in a decoded JSON register body; PayloadError naming the first bad field."""
    if not isinstance(body, dict):
        raise PayloadError("body", f"the register body must be a JSON object, got {type(body).__name__}")
    for name in ("role", "group", "address", "http", "pid"):
        if name not in body:
            raise PayloadError(name, f"{name} is missing from the register body")
    fields: dict[str, Any] = body
    role = typing.cast(Role, _choice("role", fields["role"], ROLES))
    try:
        group = check_name("group", fields["group"])
    except InvalidSubjectError as exc:
        raise PayloadError("group", str(exc)) from None
    address = _host_port("address", fields["address"])
    http = _host_port("http", fields["http"])
    pid = fields["pid"]
    if not _is_int(pid) or not 0 < pid <= _INT_MAX:
        raise PayloadError("pid", f"pid must be a positive whole number (the process id), got {pid!r}")
    role_in_group = typing.cast(
        RoleInGroup, _choice("role_in_group", fields.get("role_in_group", "master"), ROLES_IN_GROUP)
    )
    epoch = fields.get("epoch")
    if epoch is not None:
        epoch = _count("epoch", epoch, "the epoch the server works in, 0 when it never knew one")
    write_state = fields.get("write_state")
    if write_state is not None:
        write_state = typing.cast(WriteState, _choice("write_state", write_state, WRITE_STATES))
    return Registration(
        role=role,
        group=group,
        address=address,
        http=http,
        pid=pid,
        role_in_group=role_in_group,
        epoch=epoch,
        log_end=_count("log_end", fields.get("log_end", 0), "the end offset of the message log"),
        action_end=_count("action_end", fields.get("action_end", 0), "the end offset of the action log"),
        replicated_ms=_count(
            "replicated_ms", fields.get("replicated_ms") or 0, "when the slave last heard from its master, epoch ms"
        ),
        write_state=write_state,
    )


def _is_int(value: object) -> typing.TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(field: str, value: object, meaning: str) -> int:
    if not _is_int(value) or not 0 <= value <= _INT_MAX:
        raise PayloadError(field, f"{field} must be a whole number from 0 ({meaning}), got {value!r}")
    return value


def parse_promote(body: object) -> tuple[Role, str]:
    """(role, group) of a decoded JSON promote body ``{"group": ..., "role": "broker"}``."""
    if not isinstance(body, dict):
        raise PayloadError("body", f"the promote body must be a JSON object, got {type(body).__name__}")
    if "group" not in body:
        raise PayloadError("group", 'group is missing from the promote body; send {"group": "b1", "role": "broker"}')
    role = typing.cast(Role, _choice("role", body.get("role", "broker"), ROLES))
    try:
        group = check_name("group", body["group"])
    except InvalidSubjectError as exc:
        raise PayloadError("group", str(exc)) from None
    return role, group


def parse_subjects(values: Sequence[str]) -> list[str]:
    """The subjects of ``?subject=`` parameters, checked, without repeats; PayloadError on a bad one."""
    if len(values) > META_SUBJECTS_PER_REQUEST_MAX:
        raise PayloadError(
            "subject",
            f"{len(values)} subjects asked for in one request; the limit is {META_SUBJECTS_PER_REQUEST_MAX}, "
            "ask in several requests",
        )
    out: list[str] = []
    for value in dict.fromkeys(values):
        try:
            out.append(check_subject(value))
        except InvalidSubjectError as exc:
            raise PayloadError("subject", str(exc)) from None
    return out
