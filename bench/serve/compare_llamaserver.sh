#!/usr/bin/env bash
# Serving benchmark: `kvmesh serve` vs llama.cpp's `llama-server`, same GGUF,
# same synthesized conversation-like requests, measured in one run.
#
# Usage: bench/serve/compare_llamaserver.sh [options]
#   --trace CSV          (ContextTokens, GeneratedTokens) trace
#                        (default: data/traces/azure_llm_conv_2023.csv in the repo)
#   --model GGUF         (default: ~/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --concurrency LIST   closed-loop client counts (default: 1,8,32)
#   --requests LIST      requests per level, one or one per level (default: 8,24,96)
#   --scale F            trace lengths are multiplied by F, then clipped to
#                        prompt 16..1024, output 4..128 tokens (default: 0.25)
#   --ctx N              llama-server context per slot; -c is 32*N (default: 2048)
#   --level-timeout S    no new requests after S seconds in a level (default: 120)
#   --only NAME          run just `kvmesh` or `llama-server`
#   --out DIR            logs and per-server JSON (default: target/bench-serve)
#   --wait-idle S        first wait up to S s for the 1-min load average to drop below 0.5
#   --json [PATH]        also write all results as JSON (default PATH: OUT/compare.json;
#                        `-` prints the JSON to stdout after the tables)
#   -h, --help
# Environment:
#   KVMESH_BIN           kvmesh binary (default target/release/kvmesh; built when missing)
#   KVMESH_SERVE_ARGS    extra arguments for `kvmesh serve` (word-split)
#   KVMESH_LLAMACPP_DIR  llama.cpp cache (default ~/.cache/kvmesh/llama.cpp; built by
#                        bench/llamacpp_build.sh when llama-server is missing)
#
# Each server runs alone on a free loopback port: llama-server as
#   llama-server -m GGUF -t 2 -np 32 -cb -c 32*ctx --host 127.0.0.1 --port P
# and kvmesh as `kvmesh serve --model GGUF --listen 127.0.0.1:P`. The load
# generator (bench/loadgen.py, stdlib only) streams POST /v1/completions with
# temperature 0, logit_bias {"2": -100} and ignore_eos so both servers emit
# exactly max_tokens tokens, and reports TTFT p50/p99, ITL p50/p99, output
# tokens/s per level. The load generator shares the CPUs with the server.
# Target: kvmesh >= 3x llama-server output tok/s at concurrency 32, with lower p99 TTFT.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

TRACE="$ROOT/data/traces/azure_llm_conv_2023.csv"
MODEL="$HOME/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf"
CONC="1,8,32"
REQS="8,24,96"
SCALE="0.25"
CTX=2048
LEVEL_TIMEOUT=120
ONLY=""
WAIT_IDLE=0
JSON=""
OUT="$ROOT/target/bench-serve"
SERVED_NAME="SmolLM2-135M-Instruct"
READY_TIMEOUT=180

usage() { sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --trace) TRACE="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --concurrency) CONC="$2"; shift 2 ;;
    --requests) REQS="$2"; shift 2 ;;
    --scale) SCALE="$2"; shift 2 ;;
    --ctx) CTX="$2"; shift 2 ;;
    --level-timeout) LEVEL_TIMEOUT="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --wait-idle) WAIT_IDLE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --json)
      if [[ $# -ge 2 && ( "$2" == "-" || "$2" != -* ) ]]; then JSON="$2"; shift 2
      else JSON="DEFAULT"; shift; fi ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$ONLY" in ""|kvmesh|llama-server) ;; *) echo "--only must be kvmesh or llama-server" >&2; exit 2 ;; esac

log() { echo "[compare_llamaserver] $*" >&2; }

[[ -f "$MODEL" ]] || { log "model not found: $MODEL (kvmesh fetch-model downloads it)"; exit 1; }
[[ -f "$TRACE" ]] || { log "trace not found: $TRACE"; exit 1; }
MODEL="$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")"
command -v python3 >/dev/null 2>&1 || { log "python3 is required"; exit 1; }
LOADGEN="$ROOT/bench/loadgen.py"

# ---- binaries --------------------------------------------------------------------
LLAMA_DIR="${KVMESH_LLAMACPP_DIR:-$HOME/.cache/kvmesh/llama.cpp}"
LLAMA_SERVER="$LLAMA_DIR/build/bin/llama-server"
if [[ "$ONLY" != kvmesh && ! -x "$LLAMA_SERVER" ]]; then
  log "llama-server not built in $LLAMA_DIR; building (several minutes)"
  KVMESH_LLAMACPP_DIR="$LLAMA_DIR" bash "$ROOT/bench/llamacpp_build.sh" >&2
fi
KVMESH="${KVMESH_BIN:-$ROOT/target/release/kvmesh}"
if [[ "$ONLY" != llama-server ]]; then
  if [[ -z "${KVMESH_BIN:-}" && ! -x "$KVMESH" ]]; then
    log "building kvmesh (cargo build --release -p kvmesh)"
    (cd "$ROOT" && cargo build --release -p kvmesh) >&2
  fi
  [[ -x "$KVMESH" ]] || { log "kvmesh binary not executable: $KVMESH"; exit 1; }
fi

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
[[ "$JSON" == DEFAULT ]] && JSON="$OUT/compare.json"

# ---- server lifecycle -----------------------------------------------------------
SERVER_PID=""
LOADGEN_PID=""
stop_server() {
  if [[ -n "$LOADGEN_PID" ]] && kill -0 "$LOADGEN_PID" 2>/dev/null; then
    kill -TERM "$LOADGEN_PID" 2>/dev/null || true
    wait "$LOADGEN_PID" 2>/dev/null || true
  fi
  LOADGEN_PID=""
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

# bench NAME: start server NAME, load it, stop it; results in $OUT/NAME.json
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
  python3 "$LOADGEN" run --url "http://127.0.0.1:$port" --label "$name" --model "$SERVED_NAME" \
    --trace "$TRACE" --gguf "$MODEL" --concurrency "$CONC" --requests "$REQS" --scale "$SCALE" \
    --max-prompt 1024 --max-output 128 --level-timeout "$LEVEL_TIMEOUT" --request-grace 30 \
    --json "$OUT/$name.json" >/dev/null &
  LOADGEN_PID=$!
  # (waiting on a background job lets INT/TERM traps run at once)
  wait "$LOADGEN_PID"
  LOADGEN_PID=""
  stop_server
}

loadavg() { cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0; }
if [[ "$WAIT_IDLE" -gt 0 ]]; then
  deadline=$(( $(date +%s) + WAIT_IDLE ))
  while awk -v l="$(loadavg)" 'BEGIN { exit !(l >= 0.5) }' && [[ $(date +%s) -lt $deadline ]]; do
    sleep 5
  done
fi
log "load average before the run: $(loadavg) (other work on these CPUs skews the numbers)"

runs=()
if [[ "$ONLY" != llama-server ]]; then bench kvmesh; runs+=("$OUT/kvmesh.json"); fi
if [[ "$ONLY" != kvmesh ]]; then bench llama-server; runs+=("$OUT/llama-server.json"); fi

report_args=("${runs[@]}")
if [[ -n "$JSON" ]]; then
  if [[ "$JSON" == "-" ]]; then report_args+=(--json "$OUT/compare.json")
  else mkdir -p "$(dirname "$JSON")"; report_args+=(--json "$JSON"); fi
fi
python3 "$LOADGEN" report "${report_args[@]}"
if [[ "$JSON" == "-" ]]; then cat "$OUT/compare.json"
elif [[ -n "$JSON" ]]; then log "JSON written to $JSON"; fi
