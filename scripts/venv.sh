# Sourced by run.sh, test.sh and .ci/run: find a Python, and keep a venv with qmq installed in
# it, with the exact versions of constraints.txt.
#
# A venv is rebuilt when it was made by another Python than the one asked for, when its
# python or pip does not run, or when its first install never finished (no marker file).
# pip runs only when the venv lacks the asked-for extras for the current pyproject.toml and
# constraints.txt (the marker records what was installed), and then shows its progress: the
# first install of the test tools downloads over a gigabyte with PySpark.

QMQ_VENV_MARKER=.qmq-installed

# The marker line for an install of EXTRAS from the current pyproject.toml and constraints.txt.
_qmq_install_key() {
  echo "$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16) $1"
}

# The test extra holds every other extra but bench: a venv with it needs no install for them.
_qmq_covered_by_test() {
  local extra
  grep -qxF "$(_qmq_install_key test)" "$1/$QMQ_VENV_MARKER" || return 1
  for extra in ${2//,/ }; do
    case $extra in server | cli | tx | spark | otel | otel-server | all | test) ;; *) return 1 ;; esac
  done
}

_qmq_identity() {
  "$1" -c 'import sys; print(sys.base_prefix, sys.version.replace(chr(10), " "))' 2>/dev/null
}

# find_python VERSION: print the path of a working pythonVERSION (on PATH, or under pyenv's
# versions), or say which one is missing and how to install it, and fail.
find_python() {
  local version=$1 candidate
  local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  for candidate in "$(command -v "python$version" 2>/dev/null)" \
      $(ls -d "$pyenv_root"/versions/"$version".*/bin/"python$version" 2>/dev/null | sort -rV); do
    # a pyenv shim is on PATH even where that version is not selected: run it to know
    if [ -n "$candidate" ] && "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$version'.split('.'))))" 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "error: Python $version is missing: neither python$version on PATH nor $pyenv_root/versions/$version.*/bin/python$version runs; install it (e.g. \`pyenv install $version\`, or apt-get install python$version) and rerun" >&2
  return 1
}

# ensure_venv DIR PYTHON EXTRAS: DIR is a venv of PYTHON with this checkout installed in
# editable mode with EXTRAS (e.g. test, or server,cli). PYTHON empty: keep any working venv
# of Python 3.11 or newer, else make one with python3.11 (or python3). Call it as a command
# of its own under `set -e`: a failed step stops the calling script.
ensure_venv() {
  local dir=$1 python=$2 extras=$3 reason="" candidate key
  key=$(_qmq_install_key "$extras")
  if [ ! -e "$dir" ]; then
    reason="new"
  elif ! "$dir/bin/python" -m pip --version >/dev/null 2>&1; then
    reason="its python or pip does not run"
  elif [ ! -f "$dir/$QMQ_VENV_MARKER" ]; then
    reason="its first install never finished"
  elif [ -n "$python" ] && [ "$(_qmq_identity "$dir/bin/python")" != "$(_qmq_identity "$python")" ]; then
    reason="it was made by another Python than $python"
  elif [ -z "$python" ] && ! "$dir/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    reason="its Python is older than 3.11"
  fi
  if [ -n "$reason" ]; then
    if [ -z "$python" ]; then
      for candidate in python3.11 python3; do
        if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
          python=$candidate
          break
        fi
      done
    fi
    if [ -z "$python" ] || ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "error: qmq needs Python 3.11 or newer, and ${python:-neither python3.11 nor python3} does not run or is older: set PYTHON=/path/to/python3.11 (or 3.12, 3.13)" >&2
      return 1
    fi
    if [ "$reason" != "new" ]; then
      echo "rebuilding $dir: $reason" >&2
      rm -rf "$dir"
    fi
    echo "creating $dir with $python ($("$python" --version 2>&1)) and installing qmq[$extras] with the versions of constraints.txt" >&2
    "$python" -m venv "$dir"
  elif grep -qxF "$key" "$dir/$QMQ_VENV_MARKER" || _qmq_covered_by_test "$dir" "$extras"; then
    return 0
  else
    echo "installing qmq[$extras] into $dir (new extras, or pyproject.toml or constraints.txt changed)" >&2
  fi
  # A pip configuration may name index or find-links folders that do not exist: pip warns
  # about each on every run; the filter drops that noise and nothing else.
  if ! "$dir/bin/python" -m pip install --disable-pip-version-check -c constraints.txt -e ".[$extras]" \
      2> >(grep -v '^WARNING: Location .* is ignored' >&2); then
    echo "error: installing qmq[$extras] into $dir failed (pip's error above)" >&2
    return 1
  fi
  echo "$key" >>"$dir/$QMQ_VENV_MARKER"
}
