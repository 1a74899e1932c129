#!/usr/bin/env bash
# The simulator against the real mesh on this machine: one slice of the Mooncake trace
# replayed on a real two-prefill, two-decode mesh (`kvmesh bench trace`: etcd, a router and
# four node processes of one compute thread each, on loopback) and simulated with a timing
# profile `kvmesh profile` measures here first, the four nodes sharing this machine's cores as
# the real processes do. Prints TTFT p50 and throughput of both and their ratios
# (docs/sim.md reports them).
#
# Usage: bench/sim/agreement.sh [--requests N] [--rate R] [--conversations N] [--host-cores C]
#                               [--out DIR] [--kvmesh BIN]
#   --requests N       the slice's length (default 60)
#   --rate R           requests per second the trace is paced at, its bursts kept (default 1)
#   --conversations N  N whole multi-turn conversations instead of the trace's first requests
#   --host-cores C     the cores the simulated nodes share (default: this machine's)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
KVMESH="$ROOT/target/release/kvmesh"
OUT="$ROOT/target/sim-agreement"
REQUESTS=60
RATE=1
CONVERSATIONS=""
CORES="$(nproc)"
while (($#)); do
  case "$1" in
    --requests) REQUESTS="$2"; shift 2 ;;
    --rate) RATE="$2"; shift 2 ;;
    --conversations) CONVERSATIONS="$2"; shift 2 ;;
    --host-cores) CORES="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --kvmesh) KVMESH="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x "$KVMESH" ]] || (cd "$ROOT" && cargo build --release -p kvmesh)
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" >&2; }

WORKLOAD="mooncake,scale=32"
TRACE_ARGS=(--limit "$REQUESTS")
if [[ -n "$CONVERSATIONS" ]]; then
  WORKLOAD="$WORKLOAD,conversations=$CONVERSATIONS"
  TRACE_ARGS+=(--conversations "$CONVERSATIONS")
fi

log "profiling this machine's engine on one thread"
"$KVMESH" profile --threads 1 --out "$OUT/cpu.json" >"$OUT/profile.txt"
log "replaying $REQUESTS requests on a real 2+2 mesh at $RATE req/s"
"$KVMESH" bench trace --policies kv_aware "${TRACE_ARGS[@]}" --rate "$RATE" --node-threads 1 \
  --json --requests-csv "$OUT/real.csv" >"$OUT/real.json"
log "simulating the same requests on 2+2 nodes sharing $CORES cores"
"$KVMESH" sim --profile "$OUT/cpu.json" --prefill-nodes 2 --decode-nodes 2 --host-cores "$CORES" \
  --link same_host --workload "$WORKLOAD" --load "trace:rate=$RATE" --requests "$REQUESTS" \
  --plots none --out "$OUT/sim" --json >"$OUT/sim.json"

python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
real = json.load(open(f"{out}/real.json"))["kv_aware"]
sim = json.load(open(f"{out}/sim.json"))["points"][0]["slo"]
rows = [
    ("requests completed", real["completed"], sim["ok"]),
    ("TTFT p50 (s)", real["ttft_p50_s"], sim["ttft"]["p50"]),
    ("TTFT p99 (s)", real["ttft_p99_s"], sim["ttft"]["p99"]),
    ("E2E p50 (s)", real["e2e_p50_s"], sim["e2e"]["p50"]),
    ("throughput (req/s)", real["request_rate"], sim["request_throughput"]),
    ("prefix hits", real["prefix_hit_rate"], sim["cached_tokens"] / sim["prompt_tokens"]),
]
print(f"{'':20} {'real':>9} {'simulated':>10} {'sim/real':>9}")
for name, r, s in rows:
    print(f"{name:20} {r:9.3f} {s:10.3f} {s / r if r else float('nan'):9.2f}")
EOF
