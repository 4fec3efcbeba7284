#!/usr/bin/env bash
# Set up .venv with the test tools (once) and run the whole suite: ruff, mypy --strict, pytest.
# Tests use the PostgreSQL, MariaDB and Redis servers on 127.0.0.1; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3.11}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v '^WARNING: Location' >&2 || true
.venv/bin/ruff check src tests bench
.venv/bin/mypy
exec .venv/bin/pytest "$@"
