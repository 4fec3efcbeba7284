#!/usr/bin/env bash
# Set up qmq in .venv (once) and start `qmq standalone` with data in ./qmq-data, then run a
# short demo that sends a message and consumes it. Ctrl-C stops the server.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3.11}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -e . 2>&1 | grep -v '^WARNING: Location' >&2 || true
exec .venv/bin/qmq standalone --data-dir ./qmq-data --demo "$@"
