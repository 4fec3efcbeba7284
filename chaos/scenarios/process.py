"""Process faults: ``kill -9`` of a random role (broker master, slave, delay server, meta
server, consumer, producer) at random moments under mixed load, each started again with its
own command line after a random pause."""

from __future__ import annotations

import random
import time

from chaos.cluster import ChaosCluster
from chaos.scenario import Result, Settings, drain

KILLS_FULL = 100
KILLS_QUICK = 9


def run(settings: Settings) -> list[Result]:
    result = Result(
        "process kill",
        "kill -9 of a random role (broker master or slave, delay server, meta server, consumer, producer) "
        "under realtime, delay, retried and transactional load, then a restart",
        command="start the killed process again with its command line (`argv` in DATA_DIR/cluster.json)",
    )
    cluster = ChaosCluster(settings.work_dir / "process")
    t0 = time.monotonic()
    try:
        cluster.start()
        cluster.start_load(consumers_per_group=2 if not settings.quick else 1)
        roles = cluster.names("broker") + cluster.names("delay") + cluster.names("meta") + list(cluster.workers)
        kills = KILLS_QUICK if settings.quick else KILLS_FULL
        order: list[str] = []
        rng = random.Random(17)
        while len(order) < kills:  # every role in every round, in a random order
            batch = list(roles)
            rng.shuffle(batch)
            order += batch
        killed: dict[str, int] = {}
        for i, name in enumerate(order[:kills]):
            time.sleep(rng.uniform(0.2, 1.5))  # load runs between faults
            t_kill = time.monotonic()
            cluster.kill(name)
            time.sleep(rng.uniform(0.0, 1.0))
            cluster.restart(name)
            result.recovery_s = max(result.recovery_s, time.monotonic() - t_kill)
            result.fault_count += 1
            killed[name] = killed.get(name, 0) + 1
            if (i + 1) % 10 == 0:
                settings.log(f"  {i + 1} kills")
        result.notes.append("kills per process: " + ", ".join(f"{k} {v}" for k, v in sorted(killed.items())))
        result.figures = drain(cluster, settings.log)
    except Exception as exc:  # the scenario failed: say so in the results, clean up
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        cluster.close()
        result.duration_s = time.monotonic() - t0
    return [result]
