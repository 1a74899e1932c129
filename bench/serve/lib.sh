# Shared by the bench/serve scripts (sourced, not run): a server's lifecycle on a free
# loopback port, and the measuring command. The caller defines log(), sets ROOT, and
# traps EXIT to stop_server.

SERVER_PID=""
BENCH_PID=""

# The scripts' own variables stay readable here but leave the environment of the servers
# they start (kvmesh warns about KVMESH_* variables it does not read).
export -n KVMESH_BIN KVMESH_BENCH KVMESH_SERVE_ARGS KVMESH_LLAMACPP_DIR

# Stops the measurement in flight, then the server (TERM, then KILL after 5 s).
stop_server() {
  if [[ -n "$BENCH_PID" ]] && kill -0 "$BENCH_PID" 2>/dev/null; then
    kill -TERM "$BENCH_PID" 2>/dev/null || true
    wait "$BENCH_PID" 2>/dev/null || true
  fi
  BENCH_PID=""
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}

# pinned LIST CMD... &: CMD on the CPUs in LIST (all of them when LIST is empty). Only in the
# background: it execs, so that $! is CMD's own pid (which stop_server signals), not a
# subshell's that would leave CMD running.
pinned() {
  local cpus="$1"; shift
  if [[ -n "$cpus" ]]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}

# cpu_count LIST: how many CPUs a taskset list names ("1", "0-3", "0,2-3"); all of this
# machine's when LIST is empty.
cpu_count() {
  [[ -n "$1" ]] || { nproc; return; }
  python3 -c '
import sys
n = 0
for part in sys.argv[1].split(","):
    lo, _, hi = part.partition("-")
    n += int(hi or lo) - int(lo) + 1
print(n)' "$1"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# wait_ready URL LOG: poll GET URL until 200 (bounded by READY_TIMEOUT, default 180 s),
# failing fast if the server ($SERVER_PID) died.
wait_ready() {
  python3 - "$1" "${READY_TIMEOUT:-180}" "$SERVER_PID" <<'EOF' || { log "---- $2 (tail) ----"; tail -n 30 "$2" >&2; return 1; }
import os, sys, time, urllib.request, urllib.error
url, limit, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
end, last = time.monotonic() + limit, "no answer"
while time.monotonic() < end:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"server exited before becoming ready ({url})")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except urllib.error.HTTPError as e:
        last = f"HTTP {e.code}"
    except Exception as e:
        last = repr(e)
    time.sleep(0.2)
sys.exit(f"not ready after {limit}s: {last}")
EOF
}

# warm_up URL MODEL: one short completion, so a server's first-request setup lands in no
# measurement.
warm_up() {
  python3 - "$1" "$2" <<'EOF' || log "warm-up request failed (measuring anyway)"
import json, sys, urllib.request
body = json.dumps({"model": sys.argv[2], "prompt": "Hello", "max_tokens": 8}).encode()
req = urllib.request.Request(sys.argv[1] + "/v1/completions", body, {"Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=120).read()
EOF
}

loadavg() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?"; }

# wait_idle S: wait up to S seconds for the 1-minute load average to drop below 0.5.
wait_idle() {
  [[ "$1" -gt 0 ]] || return 0
  local deadline=$(( $(date +%s) + $1 ))
  while awk -v l="$(loadavg)" 'BEGIN { exit !(l >= 0.5) }' && [[ $(date +%s) -lt $deadline ]]; do
    sleep 5
  done
}

# kvmesh_binary: sets KVMESH (KVMESH_BIN, else target/release/kvmesh, built when missing).
kvmesh_binary() {
  KVMESH="${KVMESH_BIN:-$ROOT/target/release/kvmesh}"
  if [[ -z "${KVMESH_BIN:-}" && ! -x "$KVMESH" ]]; then
    log "building kvmesh (cargo build --release -p kvmesh)"
    (cd "$ROOT" && cargo build --release -p kvmesh) >&2
  fi
  [[ -x "$KVMESH" ]] || { log "kvmesh binary not executable: $KVMESH"; exit 1; }
}

# bench_command: sets BENCH (`$KVMESH bench`, or KVMESH_BENCH word-split) and SERVE_CMD (its `serve` word).
bench_command() {
  if [[ -n "${KVMESH_BENCH:-}" ]]; then
    # shellcheck disable=SC2206
    BENCH=(${KVMESH_BENCH})
  else
    BENCH=("$KVMESH" bench)
  fi
  SERVE_CMD=(serve)
  log "measuring with: ${BENCH[*]} ${SERVE_CMD[*]}"
}
