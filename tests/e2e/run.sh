#!/usr/bin/env bash
# End-to-end tests of `kvmesh serve` through real HTTP with the official
# `openai` Python client.
#
# Usage: tests/e2e/run.sh [pytest args...]      e.g. tests/e2e/run.sh -k stream -x
#
#   KVMESH_BIN               server binary (default: target/release/kvmesh)
#   KVMESH_MODEL             GGUF model (default: ~/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   KVMESH_SERVE_ARGS        extra arguments for `kvmesh serve` (word-split)
#   KVMESH_E2E_VENV          virtualenv dir (default: target/e2e-venv)
#   KVMESH_E2E_READY_TIMEOUT seconds to wait for GET /health == 200 (default: 180)
#   KVMESH_E2E_BASE_URL      test an already running server instead of starting one
#
# Creates the venv and installs the pinned tests/e2e/requirements.txt when
# needed, starts the server on a free loopback port, waits until /health
# answers 200 (polling, bounded), runs pytest, always stops the server, and
# exits with pytest's status. The server log is target/e2e-logs/server.log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/tests/e2e"
VENV="${KVMESH_E2E_VENV:-$ROOT/target/e2e-venv}"
BIN="${KVMESH_BIN:-$ROOT/target/release/kvmesh}"
MODEL="${KVMESH_MODEL:-$HOME/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
READY_TIMEOUT="${KVMESH_E2E_READY_TIMEOUT:-180}"
LOG_DIR="$ROOT/target/e2e-logs"
REQS="$HERE/requirements.txt"

log() { echo "[e2e] $*" >&2; }

# ---- python venv with the pinned client packages ---------------------------
PY3="$(command -v python3 || true)"
if [[ -z "$PY3" ]]; then
  log "python3 not found; installing it"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 python3-venv
  PY3="$(command -v python3)"
fi

make_venv() { rm -rf "$VENV"; "$PY3" -m venv "$VENV"; }
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating venv $VENV"
  if ! make_venv 2>"$ROOT/target/e2e-venv.err"; then
    cat "$ROOT/target/e2e-venv.err" >&2 || true
    log "python3 -m venv failed; installing the venv module"
    pyver="$("$PY3" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3-venv "python${pyver}-venv" \
      || apt-get install -y -qq --no-install-recommends python3-venv
    make_venv
  fi
fi
PY="$VENV/bin/python"
stamp="$VENV/.kvmesh-e2e-requirements"
if ! cmp -s "$REQS" "$stamp"; then
  log "installing $(grep -v '^#' "$REQS" | tr '\n' ' ')"
  "$PY" -m pip install -q --disable-pip-version-check -r "$REQS"
  cp "$REQS" "$stamp"
fi

# ---- the server --------------------------------------------------------------
SERVER_PID=""
PYTEST_PID=""
cleanup() {
  if [[ -n "$PYTEST_PID" ]] && kill -0 "$PYTEST_PID" 2>/dev/null; then
    kill -TERM "$PYTEST_PID" 2>/dev/null || true
    wait "$PYTEST_PID" 2>/dev/null || true
  fi
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ -n "${KVMESH_E2E_BASE_URL:-}" ]]; then
  BASE_URL="${KVMESH_E2E_BASE_URL%/}"
  log "using the running server at $BASE_URL"
else
  if [[ ! -x "$BIN" ]]; then
    log "server binary $BIN not found (build it: cargo build --release -p kvmesh, or set KVMESH_BIN)"
    exit 2
  fi
  PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  BASE_URL="http://127.0.0.1:$PORT"
  mkdir -p "$LOG_DIR"
  SERVER_LOG="$LOG_DIR/server.log"
  args=(serve --listen "127.0.0.1:$PORT")
  [[ -n "${KVMESH_MODEL:-}" ]] && args+=(--model "$KVMESH_MODEL")
  # shellcheck disable=SC2206
  [[ -n "${KVMESH_SERVE_ARGS:-}" ]] && args+=(${KVMESH_SERVE_ARGS})
  log "starting $BIN ${args[*]} (log: $SERVER_LOG)"
  "$BIN" "${args[@]}" >"$SERVER_LOG" 2>&1 &
  SERVER_PID=$!

  # Readiness probe: poll GET /health until 200, bounded by READY_TIMEOUT, and
  # fail fast if the server process exits.
  if ! "$PY" - "$BASE_URL/health" "$READY_TIMEOUT" "$SERVER_PID" <<'EOF'
import os, sys, time, urllib.request, urllib.error
url, deadline, pid = sys.argv[1], time.monotonic() + float(sys.argv[2]), int(sys.argv[3])
last = "no answer"
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        print(f"[e2e] server process {pid} exited before becoming ready", file=sys.stderr)
        sys.exit(1)
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
            last = f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        last = f"HTTP {e.code}"
    except Exception as e:  # connection refused while starting up
        last = repr(e)
    time.sleep(0.1)
print(f"[e2e] server not ready after {sys.argv[2]}s (last: {last})", file=sys.stderr)
sys.exit(1)
EOF
  then
    log "---- server log (tail) ----"
    tail -n 50 "$SERVER_LOG" >&2 || true
    exit 1
  fi
  log "server ready at $BASE_URL"
fi

# ---- the tests ------------------------------------------------------------------
export KVMESH_E2E_BASE_URL="$BASE_URL"
export KVMESH_MODEL="$MODEL"
set +e
# In the background + wait, so that INT/TERM traps run at once.
"$PY" -m pytest -p no:cacheprovider -rfEs "$HERE" "$@" &
PYTEST_PID=$!
wait "$PYTEST_PID"
status=$?
PYTEST_PID=""
set -e
if [[ $status -ne 0 && -n "${SERVER_LOG:-}" ]]; then
  log "---- server log (tail) ----"
  tail -n 30 "$SERVER_LOG" >&2 || true
fi
exit $status
