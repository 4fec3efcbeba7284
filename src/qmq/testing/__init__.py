"""Start real qmq servers for tests: bound to 127.0.0.1 on port 0, ready when they say so.

``running_standalone(data_dir, config={...})`` starts ``qmq standalone`` as a child process,
waits for its ``qmq ready`` line (with a deadline, never a sleep) and yields what it printed;
leaving the block sends SIGTERM and waits for a clean exit. ``running_role`` does the same for
one role (``qmq broker ...``, ``qmq meta ...``), ``running_gateway`` for an HTTP gateway.
``metric_value`` reads one sample of a server's ``/metrics``, ``health`` its ``/health``.
"""

from qmq.testing.metrics import health, metric_value
from qmq.testing.processes import ReadyProcess, running_gateway, running_role, running_standalone, write_config

__all__ = [
    "ReadyProcess",
    "health",
    "metric_value",
    "running_gateway",
    "running_role",
    "running_standalone",
    "write_config",
]
