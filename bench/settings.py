"""Workload sizes, client knobs and loopback ports: everything a run is parameterised by.

One frozen `Settings` travels from the driver to every worker process as JSON, so a
figure can always be traced back to the exact knobs it was measured with.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Loopback ports of the servers this harness starts. The system services keep the
# defaults (5672 and its Erlang distribution port 25672, 4369, 4222, 6379) and the
# yardstick uses 15673/35673/14369/14222/16379, so both can run beside us.
RABBITMQ_PORT = 35682
RABBITMQ_DIST_PORT = 35683
RABBITMQ_EPMD_PORT = 34369
NATS_PORT = 34222
REDIS_PORT = 36379

HOST = "127.0.0.1"
PAYLOAD_BYTES = 1024

WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9", "W10", "W11", "W12", "W13", "W14", "W15")
# What the newer cells measure: the report names each by it.
CELL_NAMES = {"W9": "fan-out to 70 groups", "W10": "40,000 subjects", "W11": "64 KiB and 1 MiB messages",
              "W12": "ordered", "W13": "TLS", "W14": "filtered", "W15": "fan-out to 700 groups"}
PEERS = ("rabbitmq", "nats", "redis")
QMQ_FLUSH_POLICIES = ("sync", "periodic")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Counts, durations and client knobs of one run (identical for every system)."""

    quick: bool
    # W1/W2: acknowledged publish, then drain of the same backlog.
    w1_messages: int = 200_000
    # W3: paced end-to-end latency.
    w3_rate_per_s: float = 5_000.0
    w3_duration_s: float = 20.0
    # W4: delayed messages due uniformly over a spread.
    w4_messages: int = 100_000
    w4_spread_s: float = 30.0
    # W5: messages all due in one second, that second starting this long after the start.
    w5_messages: int = 200_000
    w5_lead_s: float = 15.0
    # W4/W5 on a freshly started server (full runs); quick runs save the restart.
    fresh_server_for_delay: bool = True
    # Redis W4/W5: the poller that moves due members of the sorted set into a stream.
    delay_poll_interval_ms: float = 10.0
    # W6: handler-bound elasticity, then the CPU-bound drain with 1 and 2 consumers.
    w6_messages: int = 20_000
    w6_consumer_counts: tuple[int, ...] = (1, 2, 4, 8)
    w6_handler_sleep_ms: float = 2.0
    w6_prefetch: int = 20
    w6_cpu_messages: int = 200_000
    w6_cpu_consumer_counts: tuple[int, ...] = (1, 2)
    # W7: many subjects.
    w7_subjects: int = 1_000
    w7_messages_per_subject: int = 200
    # W8: the HTTP gateway beside the SDK (qmq only): messages per row, HTTP connections (and SDK
    # batches in flight), rounds (medians reported).
    w8_messages: int = 100_000
    w8_connections: int = 16
    w8_rounds: int = 3
    # W9 fan-out: one subject read by every one of fanout_groups consumer groups (one consumer
    # process reading them all), a drained backlog, then live at a fixed rate.
    fanout_groups: int = 70
    fanout_messages: int = 20_000
    fanout_prefetch_per_group: int = 100
    fanout_live_rate_per_s: float = 1_000.0
    fanout_live_duration_s: float = 20.0
    # W15: the fan-out at 700 groups; live at a tenth of W9's rate (the same deliveries/s), for
    # fanout_live_duration_s.
    fanout_wide_groups: int = 700
    fanout_wide_messages: int = 2_000
    fanout_wide_prefetch_per_group: int = 20
    fanout_wide_live_rate_per_s: float = 100.0
    # W10: subjects created (one message each) in chunks, until all or the time limit; then drained.
    many_subjects: int = 40_000
    many_subjects_chunk: int = 1_000
    many_subjects_limit_s: float = 420.0
    many_subjects_server_rss_max_mib: int = 6_144
    # the restart on the data held (RabbitMQ's alone takes half a minute: quick runs leave it out)
    many_subjects_restart: bool = True
    # W11: W1/W2 with large bodies, each size its own cell; batch and window keep about
    # large_window_bytes in flight (a batch of large_batch_bytes, at least one message).
    large_sizes: tuple[int, ...] = (64 * 1024, 1024 * 1024)
    large_bytes_per_size: int = 256 * 1024 * 1024
    large_batch_bytes: int = 4 * 1024 * 1024
    large_window_bytes: int = 16 * 1024 * 1024
    # W12 ordered (bench/ordered.py; RabbitMQ: bench/ordered_rabbitmq.py): keys × messages a key,
    # drained by each consumer count (handler-bound, ordered and unordered), then one consumer's
    # CPU-bound drain of drain keys × messages a key (qmq), ordered and unordered.
    ordered_keys: int = 10_000
    ordered_per_key: int = 2
    ordered_handler_ms: float = 2.0
    ordered_consumer_counts: tuple[int, ...] = (1, 2, 4, 8)
    ordered_drain_keys: int = 10_000
    ordered_drain_per_key: int = 5
    ordered_rabbitmq_queues: int = 16
    # W13 TLS (bench/secure_throughput.py): the W1 and W3 cells with TLS + auth and plain, each on a
    # server of its own, tls_repeats times (which goes first alternating).
    tls_repeats: int = 2
    # W14 filtered (bench/filter_cost.py): filter_messages on a subject, one in filter_match_every
    # matching, drained by a group with the server-side filter and one without, filter_rounds times.
    filter_messages: int = 100_000
    filter_match_every: int = 10
    filter_rounds: int = 3
    # Client shape shared by every system.
    batch_messages: int = 100
    window_messages: int = 1_000
    prefetch_messages: int = 1_000
    recv_max_messages: int = 500
    repeats: int = 1
    event_loop: str = "uvloop"
    rabbitmq_queue_type: str = "quorum"
    qmq_flush_interval_ms: int = 1_000
    # Bounds: one worker process, one system, and the whole run.
    worker_slack_s: float = 60.0
    system_limit_s: float = 3_000.0
    run_limit_s: float = 9_000.0

    @classmethod
    def full(cls) -> Settings:
        return cls(quick=False)

    @classmethod
    def for_quick(cls) -> Settings:
        return cls(
            quick=True,
            w1_messages=20_000,
            w3_duration_s=5.0,
            w4_messages=10_000,
            w4_spread_s=10.0,
            w5_messages=20_000,
            w5_lead_s=4.0,
            fresh_server_for_delay=False,
            w6_messages=4_000,
            w6_cpu_messages=20_000,
            w7_messages_per_subject=20,
            w8_messages=20_000,
            fanout_messages=300,
            fanout_live_duration_s=1.0,
            fanout_wide_messages=30,
            many_subjects=300,
            many_subjects_restart=False,
            many_subjects_limit_s=60.0,
            large_bytes_per_size=16 * 1024 * 1024,
            ordered_keys=2_000,
            ordered_drain_keys=2_000,
            tls_repeats=1,
            filter_messages=20_000,
            filter_rounds=2,
            worker_slack_s=30.0,
            system_limit_s=600.0,
            run_limit_s=1_500.0,
        )

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Settings:
        raw = json.loads(text)
        for key in ("w6_consumer_counts", "w6_cpu_consumer_counts", "large_sizes", "ordered_consumer_counts"):
            raw[key] = tuple(raw[key])
        return cls(**raw)
