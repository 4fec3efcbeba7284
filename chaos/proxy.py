"""A small userspace TCP proxy with delay and loss, for the network scenario (``tc netem`` is
not available on this kernel): every chunk it forwards waits ``delay_ms`` plus up to
``jitter_ms``, and each chunk ends its connection with probability ``reset_ratio`` (a lost
link, as TCP sees loss it cannot repair). Runs its own event loop on a thread of the campaign;
its settings may change while it runs."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from dataclasses import dataclass

_CHUNK_BYTES = 65536
_CONNECTIONS_MAX = 1000


@dataclass
class Faults:
    delay_ms: int = 0
    jitter_ms: int = 0
    reset_ratio: float = 0.0


class Proxy:
    def __init__(self, listen_host: str, target_host: str, target_port: int) -> None:
        self.listen_host, self.target = listen_host, (target_host, target_port)
        self.faults = Faults()
        self.port = 0
        self.resets = 0
        self.connections = 0
        self._rng = random.Random(17)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, self.listen_host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= _CONNECTIONS_MAX:
            writer.close()
            return
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), 5)
        except (OSError, TimeoutError):
            writer.close()
            self.connections -= 1
            return
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
            self.connections -= 1

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(_CHUNK_BYTES):
                f = self.faults
                if f.reset_ratio and self._rng.random() < f.reset_ratio:
                    self.resets += 1
                    writer.transport.abort()
                    return
                if f.delay_ms or f.jitter_ms:
                    await asyncio.sleep((f.delay_ms + self._rng.uniform(0, f.jitter_ms)) / 1000)
                writer.write(data)
                await writer.drain()
        writer.close()

    def close(self) -> None:
        def stop() -> None:
            if self._server is not None:
                self._server.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(stop)
        self._thread.join(10)
