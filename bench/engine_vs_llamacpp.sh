#!/usr/bin/env bash
# Run llama.cpp (reference) and the kvmesh engine on the same GGUF with the
# same thread count, in one run, and print kvmesh/llama.cpp ratios.
#
# Usage: bench/engine_vs_llamacpp.sh [options]
#   --model PATH      GGUF model (default: ~/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --threads N       threads for both engines (default: 2)
#   --json            print one JSON object instead of the table
#   --check           exit 1 unless every target is met (3: met, but the machine
#                     was busy, so the numbers are not trustworthy)
#   --llamacpp-only   skip kvmesh (report llama.cpp numbers only)
#   --reps N          llama-bench repetitions (default: 5); llama-batched-bench
#                     is run ceil(N/2) times and the median S_TG is used
#   --keep DIR        keep raw outputs of every tool in DIR
#   --wait-idle SECS  first wait up to SECS for the 1-minute load average to drop
#                     below 0.5 (other builds on a 2-core box wreck the numbers)
#   -h, --help
#
# Environment:
#   KVMESH_BIN            kvmesh binary (default: target/release/kvmesh; built
#                         with `cargo build --release -p kvmesh` when missing)
#   KVMESH_LLAMACPP_DIR   llama.cpp cache (default: ~/.cache/kvmesh/llama.cpp;
#                         built by bench/llamacpp_build.sh when missing)
#
# llama.cpp side:
#   llama-bench -m M -t N -p 512 -n 128 -o json                        -> pp512, tg128
#   llama-batched-bench -m M -t N -c 8192 -npp 128 -ntg 64 -npl 1,8,32 -> S_TG per batch
# kvmesh side:
#   kvmesh bench engine --json --threads N --model M
#   -> {"threads":N,"prefill_tokens":512,"prefill_tok_s":F,
#       "decode":[{"batch":1,"tok_s":F},{"batch":8,...},{"batch":32,...}]}
# Targets (kvmesh/llama.cpp): prefill >= 1.5x, decode b1 >= 1.0x, decode b32 >= 2x.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"

MODEL="$HOME/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf"
THREADS=2
JSON=0
CHECK=0
LLAMA_ONLY=0
REPS=5
KEEP=""
WAIT_IDLE=0
PP=512
TG=128
BATCH_NPP=128
BATCH_NTG=64
BATCH_NPL=1,8,32
BATCH_CTX=8192

usage() { sed -n '2,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --model=*) MODEL="${1#*=}"; shift ;;
    --threads) THREADS="$2"; shift 2 ;;
    --threads=*) THREADS="${1#*=}"; shift ;;
    --json) JSON=1; shift ;;
    --check) CHECK=1; shift ;;
    --llamacpp-only) LLAMA_ONLY=1; shift ;;
    --reps) REPS="$2"; shift 2 ;;
    --reps=*) REPS="${1#*=}"; shift ;;
    --keep) KEEP="$2"; shift 2 ;;
    --keep=*) KEEP="${1#*=}"; shift ;;
    --wait-idle) WAIT_IDLE="$2"; shift 2 ;;
    --wait-idle=*) WAIT_IDLE="${1#*=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

log() { echo "[engine_vs_llamacpp] $*" >&2; }

[[ -f "$MODEL" ]] || { log "model not found: $MODEL"; exit 1; }
MODEL="$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")"
command -v python3 >/dev/null 2>&1 || { log "python3 is required"; exit 1; }

# ---- llama.cpp binaries --------------------------------------------------------
LLAMA_DIR="${KVMESH_LLAMACPP_DIR:-$HOME/.cache/kvmesh/llama.cpp}"
LLAMA_BIN="$LLAMA_DIR/build/bin"
if [[ ! -x "$LLAMA_BIN/llama-bench" || ! -x "$LLAMA_BIN/llama-batched-bench" ]]; then
  log "llama.cpp not built in $LLAMA_DIR; building (several minutes)"
  KVMESH_LLAMACPP_DIR="$LLAMA_DIR" bash "$HERE/llamacpp_build.sh" >&2
fi

# ---- kvmesh binary -----------------------------------------------------------
KVMESH="${KVMESH_BIN:-}"
if [[ $LLAMA_ONLY -eq 0 ]]; then
  if [[ -z "$KVMESH" ]]; then
    KVMESH="$ROOT/target/release/kvmesh"
    if [[ ! -x "$KVMESH" ]]; then
      log "building kvmesh (cargo build --release -p kvmesh)"
      (cd "$ROOT" && cargo build --release -p kvmesh) >&2
    fi
  fi
  [[ -x "$KVMESH" ]] || { log "kvmesh binary not executable: $KVMESH"; exit 1; }
fi

# ---- run -------------------------------------------------------------------
if [[ -n "$KEEP" ]]; then
  mkdir -p "$KEEP"; OUTDIR="$(cd "$KEEP" && pwd)"
else
  OUTDIR="$(mktemp -d)"; trap 'rm -rf "$OUTDIR"' EXIT
fi

loadavg() { cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo nan; }
if [[ "$WAIT_IDLE" -gt 0 ]]; then
  deadline=$(( $(date +%s) + WAIT_IDLE ))
  while awk -v l="$(loadavg)" 'BEGIN { exit !(l >= 0.5) }' && [[ $(date +%s) -lt $deadline ]]; do
    sleep 5
  done
  log "waited for idle: load now $(loadavg)"
fi
LOADS=()
log "model=$MODEL threads=$THREADS load=$(loadavg) (other CPU load skews results)"

t0=$(date +%s)
LOADS+=(--load "llama-bench=$(loadavg)")
log "llama-bench -p $PP -n $TG -r $REPS"
if ! "$LLAMA_BIN/llama-bench" -m "$MODEL" -t "$THREADS" -p "$PP" -n "$TG" -r "$REPS" -o json \
     >"$OUTDIR/llama_bench.json" 2>"$OUTDIR/llama_bench.log"; then
  log "llama-bench failed:"; tail -n 20 "$OUTDIR/llama_bench.log" >&2; exit 1
fi

LOADS+=(--load "llama-batched-bench=$(loadavg)")
BATCH_RUNS=$(( (REPS + 1) / 2 ))
log "llama-batched-bench -c $BATCH_CTX -npp $BATCH_NPP -ntg $BATCH_NTG -npl $BATCH_NPL (x$BATCH_RUNS)"
: >"$OUTDIR/batched_bench.jsonl"; : >"$OUTDIR/batched_bench.log"
for ((run = 1; run <= BATCH_RUNS; run++)); do
  if ! "$LLAMA_BIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -c "$BATCH_CTX" \
       -npp "$BATCH_NPP" -ntg "$BATCH_NTG" -npl "$BATCH_NPL" --output-format jsonl \
       >>"$OUTDIR/batched_bench.jsonl" 2>>"$OUTDIR/batched_bench.log"; then
    log "llama-batched-bench failed:"; tail -n 20 "$OUTDIR/batched_bench.log" >&2; exit 1
  fi
done
t1=$(date +%s)
log "llama.cpp done in $((t1 - t0))s"

KV_ARG=()
if [[ $LLAMA_ONLY -eq 0 ]]; then
  LOADS+=(--load "kvmesh=$(loadavg)")
  log "kvmesh bench engine --threads $THREADS"
  if ! "$KVMESH" bench engine --json --threads "$THREADS" --model "$MODEL" \
       >"$OUTDIR/kvmesh.json" 2>"$OUTDIR/kvmesh.log"; then
    log "kvmesh bench engine failed:"; tail -n 20 "$OUTDIR/kvmesh.log" >&2; exit 1
  fi
  log "kvmesh done in $(( $(date +%s) - t1 ))s"
  KV_ARG=(--kvmesh "$OUTDIR/kvmesh.json")
fi

CMP_ARGS=(--llama-bench "$OUTDIR/llama_bench.json" --batched "$OUTDIR/batched_bench.jsonl"
          --model "$MODEL" --threads "$THREADS" --pp "$PP" --tg "$TG" "${LOADS[@]}")
if [[ -f "$LLAMA_DIR/SOURCE" ]]; then CMP_ARGS+=(--llamacpp-version "$(head -n1 "$LLAMA_DIR/SOURCE")"); fi
[[ $JSON -eq 1 ]] && CMP_ARGS+=(--json)
[[ $CHECK -eq 1 ]] && CMP_ARGS+=(--check)
python3 "$HERE/scripts/engine_compare.py" "${CMP_ARGS[@]}" ${KV_ARG[@]+"${KV_ARG[@]}"}
