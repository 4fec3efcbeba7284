#!/usr/bin/env bash
# Set up qmq in .venv (once: the servers, the `qmq` command and transactional sends, with the
# versions of constraints.txt) and start `qmq standalone` with data in ./qmq-data, then run a
# short demo that sends a message and consumes it. Ctrl-C stops the server.
# PYTHON=/path/to/python3.12 picks the interpreter (.venv is rebuilt if another one made it).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh
ensure_venv .venv "${PYTHON:-}" server,tx
exec .venv/bin/qmq standalone --data-dir ./qmq-data --demo "$@"
