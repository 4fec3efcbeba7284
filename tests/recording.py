"""A responder that records answers instead of writing frames, for handlers tested without a server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from qmq.protocol.codes import Status

# (code, request id, header or answer document, status) of one answer
Answer = tuple[int, int, dict[str, Any] | None, int]


class RecordingResponder:
    """A ``qmq.serving.connection.Responder`` that keeps every answer in ``answers``: its header,
    or for an answer carried in the body (``qmq.protocol.answers``) its document."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []

    def respond(
        self,
        code: int,
        request_id: int,
        header: dict[str, Any] | None,
        chunks: Sequence[bytes] = (),
        status: int = Status.OK,
    ) -> None:
        if header is None and chunks:
            header = msgpack.unpackb(b"".join(chunks))
        self.answers.append((code, request_id, header, status))
