"""A blocking client that speaks frames directly, to test the broker below the SDK, and a
broker of its own (with chosen settings) to speak them to."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame, FrameDecoder, encode_frame
from qmq.protocol.message import encode_message, encode_properties, encode_tags
from qmq.protocol.record import RECORD_HEADER_BYTES, read_record_header
from qmq.testing import running_role, write_config


def message(
    subject: str,
    message_id: str,
    body: bytes = b"",
    props: dict[str, Any] | None = None,
    tags: tuple[str, ...] = (),
    deliver_at_ms: int = 0,
) -> bytes:
    return encode_message(
        subject.encode(),
        message_id.encode(),
        encode_tags(tags),
        len(tags),
        encode_properties(props or {}),
        body,
        1,
        deliver_at_ms,
    )


def split_records(body: bytes) -> list[tuple[int, bytes]]:
    """(sequence, message bytes) of each record in a pull response body."""
    out = []
    pos = 0
    while pos < len(body):
        h = read_record_header(body, pos)
        assert h is not None, f"no record at {pos}"
        out.append((h.sequence, body[pos + RECORD_HEADER_BYTES : pos + RECORD_HEADER_BYTES + h.length]))
        pos += RECORD_HEADER_BYTES + h.length
    return out


class RawClient:
    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.decoder = FrameDecoder()
        self.ids = itertools.count(1)

    def send_frame(self, code: int, header: dict[str, Any] | None = None, body: bytes = b"") -> int:
        request_id = next(self.ids)
        self.sock.sendall(encode_frame(Frame(code, request_id, header or {}, body)))
        return request_id

    def read_frame(self) -> Frame:
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                return frame
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self.decoder.receive_data(data)

    def call(self, code: int, header: dict[str, Any] | None = None, body: bytes = b"") -> Frame:
        request_id = self.send_frame(code, header, body)
        frame = self.read_frame()
        assert frame.response, frame
        assert frame.request_id == request_id, frame
        return frame

    def send(self, *messages: bytes) -> Frame:
        return self.call(RequestCode.SEND_MESSAGES, {}, b"".join(messages))

    def pull(
        self,
        subject: str,
        group: str,
        consumer: str = "c1",
        session: str = "s1",
        max_n: int = 100,
        timeout_ms: int = 0,
        start: str = "earliest",
        ack: list[list[int]] | None = None,
    ) -> Frame:
        header: dict[str, Any] = {
            "subject": subject,
            "group": group,
            "consumer_id": consumer,
            "session": session,
            "max": max_n,
            "timeout_ms": timeout_ms,
            "start": start,
        }
        if ack:
            header["ack"] = ack
        return self.call(RequestCode.PULL, header)

    def close(self) -> None:
        self.sock.close()


@contextmanager
def broker_client(tmp_path: Path, settings: Mapping[str, Any]) -> Iterator[RawClient]:
    """A broker alone, with ``settings`` in the [broker] table of its config file and its data in
    ``tmp_path/data``, and a client connected to it; both stopped afterwards."""
    config = write_config(tmp_path / "broker.toml", {"broker": settings})
    argv = ["broker", "--data-dir", str(tmp_path / "data"), "--port", "0", "--http-port", "0", "--config", str(config)]
    with running_role(argv) as proc:
        client = RawClient(proc.ready["address"])
        try:
            yield client
        finally:
            client.close()
