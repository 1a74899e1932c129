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
#   --slo SPEC           objectives (default: ttft=2s,itl=100ms)
#   --attainment F       share that must be within the SLO, judged by the low end of its 95%
#                        Wilson interval (default: 0.99)
#   --judge J            what that share counts (default: percentiles: each objective over
#                        its own samples, ITL over every gap, so the defaults ask TTFT p99
#                        <= 2 s and ITL p99 <= 100 ms; per-request: requests meeting every
#                        objective, ITL on a request's longest gap)
#   --requests N         requests per probe (default: 400: at 0.99 a probe passes only with
#                        at least 381 requests in a row meeting the SLO; a retried probe
#                        sends twice as many; a probe stops at the first miss after which
#                        it cannot pass)
#   --duration D         a safety cap: no new requests after D in a probe (default: 900s,
#                        long enough for 400 requests at 0.5 req/s)
#   --ctx N              llama-server context per slot; -c is 32*N (default: 2048)
#   --only NAME          run just `kvmesh` or `llama-server`
#   --out DIR            logs and per-server reports (default: target/bench-serve)
#   --wait-idle S        first wait up to S s for the 1-min load average to drop below 0.5
#   --server-cpus L      run each server on these CPUs (taskset list, e.g. 1), with one compute
#                        thread per CPU (llama-server's -t, kvmesh's own count)
#   --client-cpus L      run the load generator on these CPUs (e.g. 0): on a small machine it
#                        then takes no CPU from the server it measures
#   -h, --help
# Environment:
#   KVMESH_BIN           kvmesh binary (default target/release/kvmesh; built when missing)
#   KVMESH_SERVE_ARGS    extra arguments for `kvmesh serve` (word-split)
#   KVMESH_LLAMACPP_DIR  llama.cpp cache (default ~/.cache/kvmesh/llama.cpp; built by
#                        bench/llamacpp_build.sh when llama-server is missing)
#   KVMESH_BENCH         the measuring command, word-split (default: "$KVMESH_BIN bench")
#
# Each server runs alone on a free loopback port: llama-server as
#   llama-server -m GGUF -t T -np 32 -cb -c 32*ctx --host 127.0.0.1 --port P
# (T: the server's CPUs, this machine's unless --server-cpus says)
# and kvmesh as `kvmesh serve --model GGUF --listen 127.0.0.1:P`, then is measured with
#   kvmesh bench serve --url http://127.0.0.1:P --model NAME --workload SPEC --ignore-eos \
#     --max-goodput --slo SPEC --attainment F --judge J --requests N --duration D --out OUT/NAME
# streamed POST /v1/completions, temperature 0, ignore_eos (both servers emit exactly
# max_tokens tokens). The search doubles the concurrency from 1 until a probe fails, then
# bisects; a load passes when its attainment's 95% interval lies at or above the target.
# `kvmesh bench compare` then sets the two reports side by side, and the last lines give
# each server's max goodput (req/s meeting the SLO) and their ratio. The load generator
# shares the CPUs with the server unless --client-cpus keeps it apart: read the load
# averages printed before and after.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
# shellcheck source=lib.sh
source "$HERE/lib.sh"

MODEL="$HOME/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf"
WORKLOAD="synthetic:input=azure,output=azure,scale=4,max_input=1024,max_output=128"
SLO="ttft=2s,itl=100ms"
ATTAINMENT="0.99"
JUDGE="percentiles"
REQUESTS=400
DURATION="900s"
CTX=2048
ONLY=""
WAIT_IDLE=0
OUT="$ROOT/target/bench-serve"
SERVED_NAME="SmolLM2-135M-Instruct"
READY_TIMEOUT=180
SERVER_CPUS=""
CLIENT_CPUS=""

usage() { sed -n '2,52p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --workload) WORKLOAD="$2"; shift 2 ;;
    --slo) SLO="$2"; shift 2 ;;
    --attainment) ATTAINMENT="$2"; shift 2 ;;
    --judge) JUDGE="$2"; shift 2 ;;
    --requests) REQUESTS="$2"; shift 2 ;;
    --duration) DURATION="$2"; shift 2 ;;
    --ctx) CTX="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --wait-idle) WAIT_IDLE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --server-cpus) SERVER_CPUS="$2"; shift 2 ;;
    --client-cpus) CLIENT_CPUS="$2"; shift 2 ;;
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
kvmesh_binary
bench_command

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

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
      pinned "$SERVER_CPUS" "$KVMESH" serve --model "$MODEL" --listen "127.0.0.1:$port" \
        "${extra[@]}" >"$log" 2>&1 &
      ;;
    llama-server)
      local threads
      threads="$(cpu_count "$SERVER_CPUS")"
      log "starting llama-server -t $threads -np 32 -cb -c $((32 * CTX)) on 127.0.0.1:$port (log: $log)"
      LD_LIBRARY_PATH="$LLAMA_DIR/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" pinned "$SERVER_CPUS" \
        "$LLAMA_SERVER" -m "$MODEL" --alias "$SERVED_NAME" -t "$threads" -np 32 -cb -c $((32 * CTX)) \
        --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
      ;;
  esac
  SERVER_PID=$!
  wait_ready "http://127.0.0.1:$port/health" "$log"
  warm_up "http://127.0.0.1:$port" "$SERVED_NAME"
  log "$name: load average $(loadavg); measuring (progress: $OUT/$name.bench.log)"
  pinned "$CLIENT_CPUS" "${BENCH[@]}" "${SERVE_CMD[@]}" --url "http://127.0.0.1:$port" --model "$SERVED_NAME" \
    --workload "$WORKLOAD" --ignore-eos --max-goodput --slo "$SLO" --attainment "$ATTAINMENT" \
    --judge "$JUDGE" --requests "$REQUESTS" --duration "$DURATION" --out "$OUT/$name" \
    >"$OUT/$name.txt" 2>"$OUT/$name.bench.log" &
  BENCH_PID=$!
  # (waiting on a background job lets INT/TERM traps run at once)
  wait "$BENCH_PID" || { log "$name: the measurement failed:"; tail -n 20 "$OUT/$name.bench.log" >&2; exit 1; }
  BENCH_PID=""
  stop_server
  cat "$OUT/$name.txt"
}

wait_idle "$WAIT_IDLE"
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
        print(f"{name}: max goodput {g['rate']:.3f} req/s at {m['load']} (SLO {r['slo']}, judged {m.get('judge', 'per_request')})")
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
