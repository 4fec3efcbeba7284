"""W11: W1 publish and W2 drain with large bodies (64 KiB and 1 MiB), each size its own pair of
cells, beside the disk's own group-commit rate: write + fdatasync of the same batch bytes."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from bench.cell import Cell, timed
from bench.settings import Settings
from bench.workloads_basic import Shape, w1_publish, w2_drain

# The disk probe: at most this long and this many bytes per batch size.
DISK_PROBE_S = 2.0
DISK_PROBE_BYTES_MAX = 256 * 1024 * 1024


def size_label(size: int) -> str:
    """64 KiB, 1 MiB: how the report names a size."""
    if size % (1024 * 1024) == 0:
        return f"{size // (1024 * 1024)} MiB"
    if size % 1024 == 0:
        return f"{size // 1024} KiB"
    return f"{size} B"


def large_shape(settings: Settings, size: int) -> Shape:
    """About large_bytes_per_size of `size` bodies; a batch of about large_batch_bytes and a
    window of about large_window_bytes (at least one message each), prefetch half the window."""
    batch = max(1, settings.large_batch_bytes // size)
    window = max(batch, settings.large_window_bytes // size)
    return Shape(
        messages=max(batch, settings.large_bytes_per_size // size), body_bytes=size, batch=batch, window=window,
        prefetch=max(1, window // 2),
    )


def disk_group_commit(directory: str, batch_bytes: int, seconds: float = DISK_PROBE_S,
                      bytes_max: int = DISK_PROBE_BYTES_MAX) -> dict[str, Any]:
    """Append batch_bytes and fdatasync, again and again, in a file of `directory` (the server's
    own file system): the rate a log that fsyncs every batch could reach on this disk."""
    path = os.path.join(directory, f"disk-probe-{os.getpid()}")
    buf = os.urandom(batch_bytes)
    writes = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started = time.perf_counter()
        while time.perf_counter() - started < seconds and (writes + 1) * batch_bytes <= max(bytes_max, batch_bytes):
            view = memoryview(buf)
            while view:
                view = view[os.write(fd, view):]
            os.fdatasync(fd)
            writes += 1
        elapsed = time.perf_counter() - started
    finally:
        os.close(fd)
        os.unlink(path)
    return {
        "batch_bytes": batch_bytes,
        "writes": writes,
        "seconds": round(elapsed, 3),
        "fdatasync_per_s": round(writes / elapsed, 1),
        "MB_per_s": round(writes * batch_bytes / elapsed / 1e6, 2),
    }


def w11_large(cell: Cell, family: str) -> dict[str, Any]:
    """For each size: the disk's group-commit rate for its batch, then W1 and W2 of that size."""
    sizes: dict[str, Any] = {}
    for size in cell.settings.large_sizes:
        shape = large_shape(cell.settings, size)
        name = f"{family}b{size}"
        disk = disk_group_commit(cell.server.dir, (shape.batch or 1) * size)
        published = timed(functools.partial(w1_publish, cell, name, shape))
        drained = (timed(functools.partial(w2_drain, cell, name, shape)) if published.get("ok")
                   else {"ok": False, "error": "no backlog: the publish failed"})
        label = size_label(size)
        sizes[label] = {
            "body_bytes": size, "messages": shape.messages, "batch": shape.batch, "window": shape.window,
            "prefetch": shape.prefetch, "disk": disk, "publish": published, "drain": drained,
        }
        cell.log(f"    W11 {label}: publish {published.get('MB_per_s')} MB/s, drain {drained.get('MB_per_s')} MB/s, "
                 f"disk {disk['MB_per_s']} MB/s")
    errors = [f"{label} {part}: {r[part].get('error')}" for label, r in sizes.items()
              for part in ("publish", "drain") if not r[part].get("ok")]
    return {"ok": not errors, "sizes": sizes, **({"error": "; ".join(errors)} if errors else {})}
