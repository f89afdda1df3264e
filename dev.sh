#!/usr/bin/env bash
# One entry point for a fresh Linux x86_64 machine with Python 3.10-3.13:
#   ./dev.sh test              set up the pinned environment, lint (ruff), run every test tier
#   ./dev.sh example [ARGS]    set up, then run example_train.py with ARGS
#   ./dev.sh bench [ARGS]      set up, then run bench/bench.py with ARGS
# The environment lives in ~/.cache/seamless_tpu/, keyed by the pins, so a second
# run on the same machine reuses it (the torch + torch_xla venv is ~7 GB, ~4 min).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))' || {
  echo "dev.sh: needs Python 3.10-3.13 (torch_xla 2.9.0 has wheels for those only); got $("$PY" -V 2>&1)." \
       "Set PYTHON=python3.12 (for example)." >&2; exit 2; }
key=$({ "$PY" -c 'import sys; print(sys.version_info[:2])'; cat requirements-dev.txt; } | sha256sum | cut -c1-12)
VENV=${SEAMLESS_TPU_VENV:-$HOME/.cache/seamless_tpu/venv-$key}
if [ ! -f "$VENV/.complete" ]; then
  echo "dev.sh: creating $VENV" >&2
  rm -rf "$VENV"
  # Debian/Ubuntu ship venv separately (python3-venv); virtualenv from pip does the same job.
  "$PY" -m venv "$VENV" 2>/dev/null || { "$PY" -m pip install -q --user virtualenv && "$PY" -m virtualenv -q "$VENV"; }
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r requirements-dev.txt
  touch "$VENV/.complete"
fi
export PATH="$VENV/bin:$PATH"
cmd=${1:-test}; shift || true
case "$cmd" in
  # 2 workers (SEAMLESS_TPU_TEST_WORKERS=0: one process); a Ray cluster's tests share one (conftest.py)
  test)    ruff check && exec python -m pytest -n "${SEAMLESS_TPU_TEST_WORKERS:-2}" --dist loadgroup "$@" ;;
  example) exec python example_train.py "$@" ;;
  bench)   exec python bench/bench.py "$@" ;;
  env)     echo "$VENV" ;;
  *) echo "usage: ./dev.sh {test|example|bench|env} [ARGS]" >&2; exit 2 ;;
esac
