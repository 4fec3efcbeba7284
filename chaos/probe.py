"""One send straight to a broker, from wherever it runs (the network scenario runs it inside
an isolated master's namespace): prints the answer's status name, or ``no-answer``.

    python -m chaos.probe HOST:PORT MESSAGE_ID [TIMEOUT_S]
"""

from __future__ import annotations

import socket
import sys
import time

from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame, FrameDecoder, encode_frame
from qmq.protocol.message import encode_message


def main(argv: list[str]) -> int:
    address, message_id = argv[0], argv[1]
    timeout_s = float(argv[2]) if len(argv) > 2 else 10.0
    host, port = address.rsplit(":", 1)
    body = encode_message(b"chaos.orders", message_id.encode(), b"", 0, b"", message_id.encode(), 1, 0)
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
            s.sendall(encode_frame(Frame(RequestCode.SEND_MESSAGES, 1, {}, body)))
            decoder = FrameDecoder()
            while time.monotonic() < deadline:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                data = s.recv(65536)
                if not data:
                    break
                decoder.receive_data(data)
                frame = decoder.next_frame()
                if frame is not None:
                    print(Status(frame.status).name, flush=True)
                    return 0
    except OSError:
        pass
    print("no-answer", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
