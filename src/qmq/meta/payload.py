"""What the meta server accepts from the network: the register body and the subjects asked for.

Each check names the field, the value and what is allowed, so a server or client that
sends something wrong learns what to fix from the 400 answer alone. Unknown keys in a
register body are ignored, so newer servers can report more to an older meta server.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any, Final

from qmq.common.errors import InvalidSubjectError
from qmq.common.naming import check_name, check_subject
from qmq.meta.registry import ROLES, ROLES_IN_GROUP, Registration, Role, RoleInGroup
from qmq.meta.store import ADDRESS_CHARS_MAX

# A register body is a handful of short strings; anything larger is not one.
REGISTER_BODY_BYTES_MAX: Final = 16 * 1024
# Subjects one GET /meta/address may ask for: bounds the routing work of one request.
# 256 subjects of up to 100 characters fit in REQUEST_LINE_BYTES_MAX.
SUBJECTS_PER_REQUEST_MAX: Final = 256
# Longest request line (method, path and query) the server reads.
REQUEST_LINE_BYTES_MAX: Final = 64 * 1024
# Process ids fit in a signed 64-bit column.
_PID_MAX: Final = (1 << 63) - 1


class PayloadError(ValueError):
    """A request field is missing or wrong; ``field`` names it."""

    def __init__(self, field: str, text: str) -> None:
        self.field = field
        super().__init__(text)


def _host_port(field: str, value: object) -> str:
    if not isinstance(value, str):
        raise PayloadError(
            field, f'{field} must be a string "host:port", got {type(value).__name__} {value!r}'
        )
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
        raise PayloadError(
            field, f"{field} {value!r} is not allowed; use one of {', '.join(map(repr, allowed))}"
        )
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
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _PID_MAX:
        raise PayloadError("pid", f"pid must be a positive whole number (the process id), got {pid!r}")
    role_in_group = typing.cast(
        RoleInGroup, _choice("role_in_group", fields.get("role_in_group", "master"), ROLES_IN_GROUP)
    )
    return Registration(
        role=role, group=group, address=address, http=http, pid=pid, role_in_group=role_in_group
    )


def parse_subjects(values: Sequence[str]) -> list[str]:
    """The subjects of ``?subject=`` parameters, checked, without repeats; PayloadError on a bad one."""
    if len(values) > SUBJECTS_PER_REQUEST_MAX:
        raise PayloadError(
            "subject",
            f"{len(values)} subjects asked for in one request; the limit is {SUBJECTS_PER_REQUEST_MAX}, "
            "ask in several requests",
        )
    out: list[str] = []
    for value in dict.fromkeys(values):
        try:
            out.append(check_subject(value))
        except InvalidSubjectError as exc:
            raise PayloadError("subject", str(exc)) from None
    return out
