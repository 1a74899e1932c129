#!/usr/bin/env bash
# Agreement with aiperf: kvmesh's load generator and NVIDIA's aiperf measure the same
# endpoint (`kvmesh serve`) under the same load, and their TTFT and ITL medians should agree.
#
# What it runs, against one `kvmesh serve` on a free loopback port (warmed up by one request):
#   1. kvmesh bench serve --url URL --model NAME --api completions --ignore-eos \
#        --workload synthetic:input=IN,output=OUT --load concurrency:C --requests N \
#        --out OUT/kvmesh-before
#   2. aiperf profile --url URL --model NAME --endpoint-type completions --streaming \
#        --tokenizer DIR --synthetic-input-tokens-mean IN --synthetic-input-tokens-stddev 0 \
#        --output-tokens-mean OUT --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
#        --extra-inputs temperature:0 (kvmesh's generator samples greedily too) \
#        --use-server-token-count --concurrency C --request-count N --warmup-request-count C \
#        --artifact-dir OUT/aiperf
#   3. aiperf's own request stream replayed by kvmesh's generator: its send times (from
#      profile_export.jsonl) as an Azure-format CSV (OUT/aiperf-sends.csv) of IN-token
#      prompts and OUT-token answers, then kvmesh bench serve --workload azure:CSV
#      --load trace, into OUT/kvmesh-replay
#   4. step 1 again, into OUT/kvmesh-after
#   (kvmesh's prompts are token ids, exactly IN tokens; aiperf's are text of IN tokens by its
#   tokenizer, re-tokenized by the server: the lengths each saw are printed.)
# then prints the medians, the ratio of aiperf's to the mean of kvmesh's two runs and whether
# it is within the tolerance; the spread between kvmesh's two runs is the machine's drift.
#
# How to read it: TTFT is the same statistic in both (send to first token), judged on the
# closed loops, the same workload for both tools. When C requests end in one engine step,
# kvmesh's generator sends the next C within microseconds and aiperf's workers within a
# millisecond or two; the server's gather window (an idle worker waits 2 ms for requests
# sent together) makes both start in one step. The replay (3), aiperf's send times as an
# open loop, is printed for reference: replayed without the closed loop's feedback, sends
# land while earlier requests still run, so its TTFT is not the closed loop's.
# Each run's mean TTFT is also set beside the server's own (its kvmesh_router_ttft_seconds
# histogram, read before and after the run): whether each tool measures what the server did. aiperf's
# "inter_token_latency" is per request (e2e - ttft) / (output tokens - 1), one value per
# request: kvmesh's TPOT, which is what it is compared with. kvmesh's own ITL (every gap
# between streamed chunks, pooled over requests) is printed beside it for reference only.
# Both count output tokens from the server's usage chunk (aiperf: --use-server-token-count;
# by default it re-tokenizes the streamed text); with ignore_eos both see OUT tokens.
#
# aiperf needs a tokenizer and there is no hub access: bench/serve/gguf_tokenizer.py writes
# a Hugging Face tokenizer.json for the GGUF's byte-level BPE vocabulary into the cache.
# aiperf (PyPI, pinned) and gguf are installed into a virtual environment under the cache,
# never system-wide.
#
# Usage: bench/serve/compare_aiperf.sh [options]
#   --model GGUF       (default: ~/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --input N          prompt tokens (default 128)
#   --output N         output tokens (default 64)
#   --concurrency C    requests in flight (default 4)
#   --requests N       requests per tool (default 100)
#   --tolerance F      largest |aiperf/kvmesh - 1| that agrees (default 0.10)
#   --out DIR          logs and both tools' results (default target/bench-aiperf)
#   --wait-idle S      first wait up to S s for the 1-min load average to drop below 0.5
#   --server-cpus L    run kvmesh serve on these CPUs (taskset list, e.g. 1)
#   --client-cpus L    run both load generators on these CPUs (e.g. 0): on a small machine a
#                      generator that takes CPU from the server slows what it measures, and
#                      pinning the two apart judges the generators, not their overhead
#   -h, --help
# Environment: KVMESH_BIN, KVMESH_SERVE_ARGS, KVMESH_BENCH as for compare_llamaserver.sh;
#   KVMESH_CACHE (default ~/.cache/kvmesh: the venv in aiperf-venv/, the tokenizer in
#   tokenizers/NAME/); KVMESH_PYTHON (python3 >= 3.10 for the venv, default python3).
# Exit status: 0 when both medians agree, 1 when either does not, 2 on bad usage.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
# shellcheck source=lib.sh
source "$HERE/lib.sh"

MODEL="$HOME/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf"
INPUT=128
OUTPUT=64
CONCURRENCY=4
REQUESTS=100
TOLERANCE=0.10
WAIT_IDLE=0
SERVER_CPUS=""
CLIENT_CPUS=""
OUT="$ROOT/target/bench-aiperf"
SERVED_NAME="SmolLM2-135M-Instruct"
CACHE="${KVMESH_CACHE:-$HOME/.cache/kvmesh}"
AIPERF_VERSION="0.13.0"
GGUF_VERSION="0.19.0"

usage() { sed -n '2,61p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --input) INPUT="$2"; shift 2 ;;
    --output) OUTPUT="$2"; shift 2 ;;
    --concurrency) CONCURRENCY="$2"; shift 2 ;;
    --requests) REQUESTS="$2"; shift 2 ;;
    --tolerance) TOLERANCE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --wait-idle) WAIT_IDLE="$2"; shift 2 ;;
    --server-cpus) SERVER_CPUS="$2"; shift 2 ;;
    --client-cpus) CLIENT_CPUS="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

log() { echo "[compare_aiperf] $*" >&2; }

[[ -f "$MODEL" ]] || { log "model not found: $MODEL (kvmesh fetch-model downloads it)"; exit 1; }
MODEL="$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")"
command -v python3 >/dev/null 2>&1 || { log "python3 is required"; exit 1; }
kvmesh_binary
bench_command
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# ---- aiperf and its tokenizer ------------------------------------------------------
VENV="$CACHE/aiperf-venv"
if [[ ! -x "$VENV/bin/aiperf" ]]; then
  log "installing aiperf $AIPERF_VERSION and gguf $GGUF_VERSION into $VENV"
  "${KVMESH_PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "aiperf==$AIPERF_VERSION" "gguf==$GGUF_VERSION" >&2
fi
TOKENIZER="$CACHE/tokenizers/$(basename "$MODEL" .gguf)"
if [[ ! -f "$TOKENIZER/tokenizer.json" ]]; then
  "$VENV/bin/python" "$HERE/gguf_tokenizer.py" "$MODEL" "$TOKENIZER" >&2
fi

# ---- the server -------------------------------------------------------------------
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
wait_idle "$WAIT_IDLE"
port="$(free_port)"
URL="http://127.0.0.1:$port"
extra=()
# shellcheck disable=SC2206
[[ -n "${KVMESH_SERVE_ARGS:-}" ]] && extra=(${KVMESH_SERVE_ARGS})
log "starting kvmesh serve on 127.0.0.1:$port (log: $OUT/kvmesh-serve.log)"
pinned "$SERVER_CPUS" "$KVMESH" serve --model "$MODEL" --listen "127.0.0.1:$port" "${extra[@]}" \
  >"$OUT/kvmesh-serve.log" 2>&1 &
SERVER_PID=$!
wait_ready "$URL/health" "$OUT/kvmesh-serve.log"
warm_up "$URL" "$SERVED_NAME"
# snapshot NAME: the server's TTFT histogram sum and count now, into OUT/ttft-NAME.txt.
snapshot() {
  curl -sf --max-time 10 "$URL/metrics" | awk '
    /^kvmesh_router_ttft_seconds_(sum|count)/ { split($1, a, "{"); s[a[1]] += $2 }
    END { printf "%s %s\n", s["kvmesh_router_ttft_seconds_sum"] + 0, s["kvmesh_router_ttft_seconds_count"] + 0 }' \
    >"$OUT/ttft-$1.txt"
}
snapshot start

# ---- kvmesh's load generator, before and after aiperf (their spread is the drift) ----
# kvmesh_run NAME [WORKLOAD LOAD]: the closed loop by default. Each run has a seed of its
# own, so it sends prompts no earlier run sent (the same seed twice would find the first
# run's prompts in the prefix cache).
RUNS=0
kvmesh_run() {
  local dir="$OUT/kvmesh-$1"
  RUNS=$((RUNS + 1))
  local workload="${2:-synthetic:input=$INPUT,output=$OUTPUT}" load="${3:-concurrency:$CONCURRENCY}"
  log "kvmesh bench serve ($1): load average $(loadavg)"
  rm -rf "$dir"
  pinned "$CLIENT_CPUS" "${BENCH[@]}" "${SERVE_CMD[@]}" --url "$URL" --model "$SERVED_NAME" --api completions --ignore-eos \
    --workload "$workload" --load "$load" \
    --requests "$REQUESTS" --seed "$RUNS" --out "$dir" >"$dir.txt" 2>"$dir.log" &
  BENCH_PID=$!
  wait "$BENCH_PID" || { log "kvmesh bench serve failed:"; tail -n 20 "$dir.log" >&2; exit 1; }
  BENCH_PID=""
}
kvmesh_run before
snapshot before

# ---- 2: aiperf ------------------------------------------------------------------
log "aiperf profile: load average $(loadavg)"
rm -rf "$OUT/aiperf"
# (Not HF_HUB_OFFLINE: aiperf 0.13 then looks a local tokenizer directory up in the hub cache.)
pinned "$CLIENT_CPUS" "$VENV/bin/aiperf" profile \
  --url "$URL" --model "$SERVED_NAME" --endpoint-type completions --streaming \
  --tokenizer "$TOKENIZER" \
  --synthetic-input-tokens-mean "$INPUT" --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean "$OUTPUT" --output-tokens-stddev 0 \
  --extra-inputs ignore_eos:true --extra-inputs temperature:0 \
  --use-server-token-count \
  --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --warmup-request-count "$CONCURRENCY" \
  --random-seed 0 \
  --artifact-dir "$OUT/aiperf" >"$OUT/aiperf.log" 2>&1 &
BENCH_PID=$!
wait "$BENCH_PID" || { log "aiperf failed:"; tail -n 30 "$OUT/aiperf.log" >&2; exit 1; }
BENCH_PID=""
snapshot aiperf

# ---- 3: aiperf's request stream, replayed ------------------------------------------
python3 - "$OUT/aiperf" "$INPUT" "$OUTPUT" "$OUT/aiperf-sends.csv" <<'EOF'
import datetime, glob, json, sys
aiperf_dir, tokens_in, tokens_out, csv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
records = glob.glob(f"{aiperf_dir}/**/profile_export.jsonl", recursive=True)
if not records:
    sys.exit(f"no profile_export.jsonl under {aiperf_dir}")
rows = [json.loads(line)["metadata"] for line in open(records[0]) if line.strip()]
starts = sorted(m["request_start_ns"] for m in rows if m.get("benchmark_phase") == "profiling")
with open(csv, "w") as f:
    f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    for ns in starts:
        t = datetime.datetime.fromtimestamp(ns // 10**9, datetime.timezone.utc)
        f.write(f"{t:%Y-%m-%d %H:%M:%S}.{ns % 10**9:09d},{tokens_in},{tokens_out}\n")
print(f"{len(starts)} sends of aiperf's profiling phase", file=sys.stderr)
EOF
kvmesh_run replay "azure:$OUT/aiperf-sends.csv" trace
snapshot replay
kvmesh_run after
snapshot after
log "load average after: $(loadavg)"
stop_server

# ---- the comparison -----------------------------------------------------------------
python3 - "$OUT/kvmesh-before/report.json" "$OUT/kvmesh-after/report.json" "$OUT/aiperf" "$TOLERANCE" "$OUT/kvmesh-replay/report.json" "$OUT" <<'EOF'
import glob, json, sys
before, after, aiperf_dir, tolerance, replay, out = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5], sys.argv[6]
runs = [json.load(open(p))["points"][0]["slo"] for p in (before, after)]
replayed = json.load(open(replay))["points"][0]["slo"]
exports = glob.glob(f"{aiperf_dir}/**/profile_export_aiperf.json", recursive=True)
if not exports:
    sys.exit(f"no profile_export_aiperf.json under {aiperf_dir}")
a = json.load(open(exports[0]))
def aiperf(name):
    m = a.get(name)
    if m is None or m.get("p50") is None:
        sys.exit(f"{exports[0]}: no {name} p50")
    return float(m["p50"]) * {"ms": 1.0, "ns": 1e-6, "s": 1e3}[m.get("unit", "ms")]
print(f"kvmesh before / after: {runs[0]['ok']} / {runs[1]['ok']} ok, "
      f"{runs[0]['output_tokens'] / max(runs[0]['ok'], 1):.1f} output tokens a request; "
      f"aiperf: {a['request_count']['avg']:.0f} requests, "
      f"{a['input_sequence_length']['avg']:.1f} in / {a['output_sequence_length']['avg']:.1f} out tokens")
# (name, kvmesh's value from a run's summary, aiperf's, judged?)
rows = [
    ("TTFT p50, closed loops", lambda r: r["ttft"]["p50"], aiperf("time_to_first_token"), True),
    ("TPOT p50 | aiperf ITL p50", lambda r: r["tpot"]["p50"], aiperf("inter_token_latency"), True),
    ("ITL p50, pooled gaps (reference)", lambda r: r["itl"]["p50"], None, False),
]
print(f"{'metric (ms)':34} {'kvmesh before':>13} {'after':>8} {'aiperf':>8} {'aiperf/kvmesh':>14}")
agree = True
for name, pick, v, judged in rows:
    k0, k1 = (pick(r) * 1e3 for r in runs)
    k = (k0 + k1) / 2
    if v is None:
        print(f"{name:34} {k0:13.2f} {k1:8.2f} {'-':>8} {'-':>14}")
        continue
    ratio = v / k
    ok = abs(ratio - 1) <= tolerance
    agree &= ok or not judged
    verdict = ("agree" if ok else "DISAGREE") if judged else "(reference)"
    print(f"{name:34} {k0:13.2f} {k1:8.2f} {v:8.2f} {ratio:14.3f}  {verdict}")
# For reference: aiperf's send times replayed as an open loop.
k = replayed["ttft"]["p50"] * 1e3
v = aiperf("time_to_first_token")
print(f"{'TTFT p50, aiperf sends replayed':34} {k:13.2f} {'':8} {v:8.2f} {v / k:14.3f}  (reference)")
print(f"  (replay: {replayed['ok']} ok of {replayed['requests']})")
# What the server itself saw of each run's requests (mean TTFT, its histogram's sum / count).
snaps = {n: [float(x) for x in open(f"{out}/ttft-{n}.txt").read().split()] for n in
         ("start", "before", "aiperf", "replay", "after")}
def served(prev, name):
    (s0, c0), (s1, c1) = snaps[prev], snaps[name]
    return (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else float("nan")
print(f"{'mean TTFT (ms)':34} {'the tool':>13} {'server':>8} {'tool/server':>14}")
for name, prev, tool in [
    ("kvmesh before", "start", runs[0]["ttft"]["mean"] * 1e3),
    ("aiperf", "before", a["time_to_first_token"]["avg"] * {"ms": 1.0, "ns": 1e-6, "s": 1e3}[a["time_to_first_token"].get("unit", "ms")]),
    ("kvmesh replay of aiperf's sends", "aiperf", replayed["ttft"]["mean"] * 1e3),
    ("kvmesh after", "replay", runs[1]["ttft"]["mean"] * 1e3),
]:
    server = served(prev, {"start": "before", "before": "aiperf", "aiperf": "replay", "replay": "after"}[prev])
    print(f"{name:34} {tool:13.2f} {server:8.2f} {tool / server:14.3f}")
print(f"aiperf against kvmesh (TTFT and TPOT p50: the mean of its two closed loops), within {tolerance:.0%}: {'yes' if agree else 'no'}")
sys.exit(0 if agree else 1)
EOF
