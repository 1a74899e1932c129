#!/usr/bin/env bash
# Serving benchmark: `kvmesh serve` vs llama.cpp's `llama-server -np 32 -cb`, same GGUF,
# same Azure-conversation-shaped requests, measured by kvmesh's load generator: the most
# goodput each server carries within an SLO (`kvmesh bench serve --max-goodput`).
#
# Usage: bench/serve/compare_llamaserver.sh [options]
#   --model GGUF         (default: ~/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --workload SPEC      (default: synthetic:input=azure,output=azure,scale=4,max_input=1024,max_output=128:
#                        (ContextTokens, GeneratedTokens) pairs drawn from the bundled Azure LLM
#                        inference trace 2023, divided by 4 and capped at 1024 / 128 tokens)
#   --slo SPEC           per-request objectives (default: ttft=2s,itl=100ms; itl is a
#                        request's longest gap between tokens)
#   --attainment F       share of completed requests that must meet every objective, judged
#                        by the low end of its 95% Wilson interval (default: 0.99)
#   --requests N         requests per probe (default: 400: at 0.99 a probe passes only with
#                        at least 381 requests in a row meeting the SLO)
#   --duration D         no new requests after D in a probe (default: 90s; a retried probe
#                        runs twice as long)
#   --ctx N              llama-server context per slot; -c is 32*N (default: 2048)
#   --only NAME          run just `kvmesh` or `llama-server`
#   --out DIR            logs and per-server reports (default: target/bench-serve)
#   --wait-idle S        first wait up to S s for the 1-min load average to drop below 0.5
#   -h, --help
# Environment:
#   KVMESH_BIN           kvmesh binary (default target/release/kvmesh; built when missing)
#   KVMESH_SERVE_ARGS    extra arguments for `kvmesh serve` (word-split)
#   KVMESH_LLAMACPP_DIR  llama.cpp cache (default ~/.cache/kvmesh/llama.cpp; built by
#                        bench/llamacpp_build.sh when llama-server is missing)
#   KVMESH_BENCH         the measuring command, word-split (default: "$KVMESH_BIN bench",
#                        else, where that binary has no `bench serve`, the library's own
#                        target/release/examples/serve_goodput, built when missing)
#
# Each server runs alone on a free loopback port: llama-server as
#   llama-server -m GGUF -t 2 -np 32 -cb -c 32*ctx --host 127.0.0.1 --port P
# and kvmesh as `kvmesh serve --model GGUF --listen 127.0.0.1:P`, then is measured with
#   kvmesh bench serve --url http://127.0.0.1:P --model NAME --workload SPEC --ignore-eos \
#     --max-goodput --slo SPEC --attainment F --requests N --duration D --out OUT/NAME
# streamed POST /v1/completions, temperature 0, ignore_eos (both servers emit exactly
# max_tokens tokens). The search doubles the concurrency from 1 until a probe fails, then
# bisects; a load passes when its attainment's 95% interval lies at or above the target.
# `kvmesh bench compare` then sets the two reports side by side, and the last lines give
# each server's max goodput (req/s meeting the SLO) and their ratio. The load generator
# shares the CPUs with the server: read the load averages printed before and after.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

MODEL="$HOME/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf"
WORKLOAD="synthetic:input=azure,output=azure,scale=4,max_input=1024,max_output=128"
SLO="ttft=2s,itl=100ms"
ATTAINMENT="0.99"
REQUESTS=400
DURATION="90s"
CTX=2048
ONLY=""
WAIT_IDLE=0
OUT="$ROOT/target/bench-serve"
SERVED_NAME="SmolLM2-135M-Instruct"
READY_TIMEOUT=180

usage() { sed -n '2,45p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --workload) WORKLOAD="$2"; shift 2 ;;
    --slo) SLO="$2"; shift 2 ;;
    --attainment) ATTAINMENT="$2"; shift 2 ;;
    --requests) REQUESTS="$2"; shift 2 ;;
    --duration) DURATION="$2"; shift 2 ;;
    --ctx) CTX="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --wait-idle) WAIT_IDLE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$ONLY" in ""|kvmesh|llama-server) ;; *) echo "--only must be kvmesh or llama-server" >&2; exit 2 ;; esac

log() { echo "[compare_llamaserver] $*" >&2; }

[[ -f "$MODEL" ]] || { log "model not found: $MODEL (kvmesh fetch-model downloads it)"; exit 1; }
MODEL="$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")"
# (python3, standard library only, for a free port and the readiness poll.)
command -v python3 >/dev/null 2>&1 || { log "python3 is required"; exit 1; }

# ---- binaries --------------------------------------------------------------------
LLAMA_DIR="${KVMESH_LLAMACPP_DIR:-$HOME/.cache/kvmesh/llama.cpp}"
LLAMA_SERVER="$LLAMA_DIR/build/bin/llama-server"
if [[ "$ONLY" != kvmesh && ! -x "$LLAMA_SERVER" ]]; then
  log "llama-server not built in $LLAMA_DIR; building (several minutes)"
  KVMESH_LLAMACPP_DIR="$LLAMA_DIR" bash "$ROOT/bench/llamacpp_build.sh" >&2
fi
KVMESH="${KVMESH_BIN:-$ROOT/target/release/kvmesh}"
if [[ -z "${KVMESH_BIN:-}" && ! -x "$KVMESH" ]]; then
  log "building kvmesh (cargo build --release -p kvmesh)"
  (cd "$ROOT" && cargo build --release -p kvmesh) >&2
fi
[[ -x "$KVMESH" ]] || { log "kvmesh binary not executable: $KVMESH"; exit 1; }

# The measuring command: `kvmesh bench`, or the library's example with the same flags.
if [[ -n "${KVMESH_BENCH:-}" ]]; then
  # shellcheck disable=SC2206
  BENCH=(${KVMESH_BENCH})
elif "$KVMESH" bench serve --help >/dev/null 2>&1; then
  BENCH=("$KVMESH" bench)
else
  EXAMPLE="$ROOT/target/release/examples/serve_goodput"
  if [[ ! -x "$EXAMPLE" ]]; then
    log "building the load generator (cargo build --release -p kvmesh-bench --example serve_goodput)"
    (cd "$ROOT" && cargo build --release -p kvmesh-bench --example serve_goodput) >&2
  fi
  BENCH=("$EXAMPLE")
fi
if [[ "${BENCH[0]}" == "$KVMESH" ]]; then SERVE_CMD=(serve); else SERVE_CMD=(); fi
log "measuring with: ${BENCH[*]} ${SERVE_CMD[*]}"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# ---- server lifecycle -----------------------------------------------------------
SERVER_PID=""
BENCH_PID=""
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
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# wait_ready URL LOG: poll GET URL until 200 (bounded), failing fast if the server died.
wait_ready() {
  python3 - "$1" "$READY_TIMEOUT" "$SERVER_PID" <<'EOF' || { log "---- $2 (tail) ----"; tail -n 30 "$2" >&2; return 1; }
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

# warm_up URL: one short completion, so neither server's first-request setup lands in a probe.
warm_up() {
  python3 - "$1" "$SERVED_NAME" <<'EOF' || log "warm-up request failed (measuring anyway)"
import json, sys, urllib.request
body = json.dumps({"model": sys.argv[2], "prompt": "Hello", "max_tokens": 8}).encode()
req = urllib.request.Request(sys.argv[1] + "/v1/completions", body, {"Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=120).read()
EOF
}

loadavg() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?"; }

# bench NAME: start server NAME, search its max goodput, stop it; report in $OUT/NAME/
bench() {
  local name="$1" port log
  port="$(free_port)"
  log="$OUT/$name.log"
  case "$name" in
    kvmesh)
      local extra=()
      # shellcheck disable=SC2206
      [[ -n "${KVMESH_SERVE_ARGS:-}" ]] && extra=(${KVMESH_SERVE_ARGS})
      log "starting kvmesh serve on 127.0.0.1:$port (log: $log)"
      "$KVMESH" serve --model "$MODEL" --listen "127.0.0.1:$port" "${extra[@]}" >"$log" 2>&1 &
      ;;
    llama-server)
      log "starting llama-server -t 2 -np 32 -cb -c $((32 * CTX)) on 127.0.0.1:$port (log: $log)"
      LD_LIBRARY_PATH="$LLAMA_DIR/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$LLAMA_SERVER" -m "$MODEL" --alias "$SERVED_NAME" -t 2 -np 32 -cb -c $((32 * CTX)) \
        --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
      ;;
  esac
  SERVER_PID=$!
  wait_ready "http://127.0.0.1:$port/health" "$log"
  warm_up "http://127.0.0.1:$port"
  log "$name: load average $(loadavg); measuring (progress: $OUT/$name.bench.log)"
  "${BENCH[@]}" "${SERVE_CMD[@]}" --url "http://127.0.0.1:$port" --model "$SERVED_NAME" \
    --workload "$WORKLOAD" --ignore-eos --max-goodput --slo "$SLO" --attainment "$ATTAINMENT" \
    --requests "$REQUESTS" --duration "$DURATION" --out "$OUT/$name" \
    >"$OUT/$name.txt" 2>"$OUT/$name.bench.log" &
  BENCH_PID=$!
  # (waiting on a background job lets INT/TERM traps run at once)
  wait "$BENCH_PID" || { log "$name: the measurement failed:"; tail -n 20 "$OUT/$name.bench.log" >&2; exit 1; }
  BENCH_PID=""
  stop_server
  cat "$OUT/$name.txt"
}

if [[ "$WAIT_IDLE" -gt 0 ]]; then
  deadline=$(( $(date +%s) + WAIT_IDLE ))
  while awk -v l="$(loadavg)" 'BEGIN { exit !(l >= 0.5) }' && [[ $(date +%s) -lt $deadline ]]; do
    sleep 5
  done
fi
log "load average before the run: $(loadavg) (other work on these CPUs skews the numbers)"

reports=()
if [[ "$ONLY" != llama-server ]]; then bench kvmesh; reports+=("$OUT/kvmesh/report.json"); fi
if [[ "$ONLY" != kvmesh ]]; then bench llama-server; reports+=("$OUT/llama-server/report.json"); fi
log "load average after the run: $(loadavg)"

if [[ ${#reports[@]} -eq 2 ]]; then
  echo
  echo "== A: kvmesh, B: llama-server =="
  "${BENCH[@]}" compare "${reports[@]}"
fi
# Each server's max goodput and the ratio, from the reports (docs/bench-report.md).
python3 - "${reports[@]}" <<'EOF'
import json, sys
rates = []
for path in sys.argv[1:]:
    r = json.load(open(path))
    name = path.split("/")[-2]
    m = r.get("max_goodput")
    if m:
        g = m["goodput"]
        print(f"{name}: max goodput {g['rate']:.3f} req/s at {m['load']} (SLO {r['slo']})")
        rates.append(g["rate"])
    else:
        first = r["points"][0]["slo"] if r["points"] else None
        seen = f"; at {r['points'][0]['load']}: {first['all']['share']:.1%} met, goodput {first['goodput']['rate']:.3f} req/s" if first and first['all']['share'] is not None else ""
        print(f"{name}: no load passed (SLO {r['slo']}){seen}")
        rates.append(None)
if len(rates) == 2:
    a, b = rates
    if a is not None and b:
        print(f"max goodput kvmesh / llama-server: {a / b:.2f}x")
    else:
        print("max goodput kvmesh / llama-server: undefined (a server carried no load within the SLO)")
EOF
