"""W12 "ordered", W13 "TLS" and W14 "filtered": features measured by benches of their own
(bench/ordered.py and ordered_rabbitmq.py, secure_throughput.py, filter_cost.py), each run here
as a subprocess that prints its figures as one JSON line, as W8 runs bench/gateway_throughput.py.

- W12 runs bench.ordered against the run's qmq server (handler-bound 1/2/4/8 consumers, ordered
  and unordered, then the CPU-bound drain), and bench.ordered_rabbitmq against the run's RabbitMQ
  node (single-active-consumer queues); the server's CPU per cell comes from the bench itself.
- W13 runs bench.secure_throughput, which starts servers of its own (qmq plain and with TLS + auth
  under the run's flush policy; a private RabbitMQ node with a plain and a TLS listener, on ports
  apart from the run's): the run's own server stays idle meanwhile.
- W14 runs bench.filter_cost against the run's qmq server.
"""

from __future__ import annotations

from typing import Any

from bench.cell import Cell, CellError
from bench.settings import HOST

# Slowest rates we still wait for, to turn a cell's size into a time limit.
_SLOWEST_FILL_MSGS_PER_S = 500
_SLOWEST_SECURE_MSGS_PER_S = 1_000
_SERVER_START_S = 90.0
# The names W13 gives the variants of bench.secure_throughput's summary.
_VARIANTS = {"qmq plain": "plain", "qmq secure": "secure", "rabbitmq plain": "plain", "rabbitmq tls": "secure"}


def _pids(cell: Cell) -> str:
    return ",".join(str(pid) for pid in cell.server.pids())


def w12_ordered(cell: Cell, family: str) -> dict[str, Any]:
    """qmq: an ordered and an unordered group per consumer count, then the CPU-bound drain;
    RabbitMQ: single-active-consumer queues per consumer count."""
    s = cell.settings
    total = s.ordered_keys * s.ordered_per_key
    counts = s.ordered_consumer_counts
    handled_s = sum(total * s.ordered_handler_ms / 1000 / n for n in counts)
    common = ["--keys", str(s.ordered_keys), "--per-key", str(s.ordered_per_key), "--handler-ms",
              str(s.ordered_handler_ms), "--consumers", ",".join(str(n) for n in counts), "--server-pids", _pids(cell),
              "--json"]  # fmt: skip
    if cell.system == "rabbitmq":
        url = f"amqp://guest:guest@{HOST}:{cell.endpoint['port']}/%2F"
        args = ["--url", url, "--queues", str(s.ordered_rabbitmq_queues), *common]
        handled = total * len(counts)
        expected_s = 2 * handled_s + handled / _SLOWEST_FILL_MSGS_PER_S
        module = "bench.ordered_rabbitmq"
    else:
        drain_total = s.ordered_drain_keys * s.ordered_drain_per_key
        args = ["--meta-server", cell.endpoint["meta_server"], "--subject-prefix", family, "--drain-keys",
                str(s.ordered_drain_keys), "--drain-per-key", str(s.ordered_drain_per_key), *common]  # fmt: skip
        handled = 2 * (total * len(counts) + drain_total)
        expected_s = 2 * 2 * handled_s + (total + drain_total) / _SLOWEST_FILL_MSGS_PER_S
        module = "bench.ordered"
    limit_s = cell.worker_limit_s(expected_s + 10.0 * len(counts))
    result, server = cell.run_bench(module, args, limit_s, f"{module} (W12)", handled)
    if cell.system == "rabbitmq":  # one shape for both: handler_bound[listener][count]
        result["handler_bound"] = {"sac": result["handler_bound"]}
    return {**result, "server": server}


def w13_tls(cell: Cell, family: str) -> dict[str, Any]:
    """W1 and W3 plain and with TLS + auth (RabbitMQ: TLS), on servers of the bench's own."""
    del family  # the bench names its own subjects, on servers of its own
    s = cell.settings
    if cell.system.startswith("qmq-"):
        key, args = "qmq", ["--flush", cell.system.removeprefix("qmq-"), "--peers", ""]
    else:
        key, args = "rabbitmq", ["--no-qmq", "--peers", "rabbitmq"]
    args += ["--repeats", str(s.tls_repeats), "--settings", s.to_json()]
    one_s = 2 * _SERVER_START_S + s.w1_messages / _SLOWEST_SECURE_MSGS_PER_S + s.w3_duration_s + s.worker_slack_s
    result, _ = cell.run_bench("bench.secure_throughput", args, 2 * s.tls_repeats * one_s,
                         "bench.secure_throughput (W13)")
    figures = result.get(key)
    errors = result.get("errors") or []
    if figures is None:
        raise CellError("; ".join(result.get("notes") or errors or ["no figures"]))
    for field, value in list(figures.items()):
        if isinstance(value, dict) and set(value) <= set(_VARIANTS):
            figures[field] = {_VARIANTS[variant]: v for variant, v in value.items()}
    ok = figures.get("W1_ratio_secure_to_plain") is not None
    return {
        "ok": ok, "parts": "tls" if key == "rabbitmq" else result.get("qmq_secure_parts"),
        "repeats": result.get("repeats"), **figures,
        "load_average_at_end": result.get("load_average_at_end"),
        **({"errors": errors} if errors else {}),
        **({} if ok else {"error": "; ".join(errors) or "no W1 ratio"}),
    }  # fmt: skip


def w14_filtered(cell: Cell, family: str) -> dict[str, Any]:
    """A group with the server-side filter and one without, draining the same subject."""
    s = cell.settings
    broker = cell.server.role_pids().get("broker")
    if not broker:
        raise CellError("the qmq server of the run printed no broker_pid=N")
    args = ["--meta-server", cell.endpoint["meta_server"], "--broker-pid", str(broker[0]), "--messages",
            str(s.filter_messages), "--match-every", str(s.filter_match_every), "--rounds", str(s.filter_rounds),
            "--subject-prefix", f"{family}r", "--json"]  # fmt: skip
    stored = s.filter_messages * s.filter_rounds
    limit_s = cell.worker_limit_s(s.filter_rounds * (3 * s.filter_messages / _SLOWEST_FILL_MSGS_PER_S + 2.0))
    result, server = cell.run_bench("bench.filter_cost", args, limit_s, "bench.filter_cost (W14)", stored)
    return {**result, "server": server}
