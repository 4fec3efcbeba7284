#!/usr/bin/env bash
# Set up .venv with the test tools (once, with the versions of constraints.txt) and run the
# whole suite: ruff, mypy --strict, pytest. Tests use the PostgreSQL, MariaDB and Redis
# servers on 127.0.0.1; extra arguments go to pytest.
# pytest runs on two worker processes (pytest-xdist): most tests wait on servers, not on the
# CPU. A test module's tests run on one worker, and tests/spark's all on one (they share a Spark
# session), the longest handed out first (tests/conftest.py). QMQ_TEST_WORKERS=4 runs
# four, QMQ_TEST_WORKERS=0 one process.
# PYTHON=/path/to/python3.12 picks the interpreter (.venv is rebuilt if another one made it).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh
ensure_venv .venv "${PYTHON:-}" test
.venv/bin/ruff check src tests bench chaos
.venv/bin/mypy
exec .venv/bin/pytest -n "${QMQ_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
