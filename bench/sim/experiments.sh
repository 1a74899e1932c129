#!/usr/bin/env bash
# What the simulator shows at a scale this machine cannot run: 1,000 H200 nodes on copies
# of the Mooncake conversation trace (docs/sim.md).
#
#   1. routing policies: kv_aware, random and round_robin on one disaggregated mesh (300
#      prefill, 700 decode nodes): TTFT p50/p99 and the prefix-cache hit rate;
#   2. disaggregated against aggregated serving at equal node count: the most requests per
#      second each carries with TTFT <= 2 s and ITL <= 50 ms for 95% of requests;
#   3. the local-prefill threshold (`--local-prefill-max-tokens`) swept on the mesh of 1.
#
# Usage: bench/sim/experiments.sh [--quick] [--out DIR] [--kvmesh BIN]
#   --quick   100 nodes (30 prefill, 70 decode) on a tenth of the requests: a few minutes
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
KVMESH="$ROOT/target/release/kvmesh"
OUT="$ROOT/target/sim-experiments"
PREFILL=300
DECODE=700
COPIES=200
REQUESTS=50000
while (($#)); do
  case "$1" in
    --quick) PREFILL=30; DECODE=70; COPIES=20; REQUESTS=5000; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --kvmesh) KVMESH="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x "$KVMESH" ]] || (cd "$ROOT" && cargo build --release -p kvmesh)
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" >&2; }

NODES=$((PREFILL + DECODE))
WORKLOAD=(--workload mooncake,scale=1 --copies "$COPIES" --requests "$REQUESTS" --block-size 512
  --seed 1 --plots none --slo ttft=2s,itl=50ms)

# summary DIR...: one line per run: TTFT p50/p99, goodput, prefix hits, busy shares.
summary() {
  python3 - "$@" <<'EOF'
import json, sys
for d in sys.argv[1:]:
    r = json.load(open(f"{d}/report.json"))
    mg = r.get("max_goodput")
    p = r["points"][-1] if not mg else next(p for p in r["points"] if p["label"] == mg["label"])
    s, m = p["slo"], p["mesh"]
    busy = {}
    for n in m["nodes"]:
        busy.setdefault(n["role"], []).append(n["utilization"])
    roles = ", ".join(f"{k} busy {100 * sum(v) / len(v):.0f}%" for k, v in busy.items())
    hits = m["prefix_cache"]["device_rate"] or 0
    line = (f"{d.split('/')[-1]:>24}: TTFT p50 {1e3 * s['ttft']['p50']:7.0f} ms, p99 {1e3 * s['ttft']['p99']:7.0f} ms,"
            f" ITL p99 {1e3 * s['itl']['p99']:5.1f} ms, goodput {s['goodput']['rate']:6.1f} req/s,"
            f" prefix hits {100 * hits:4.1f}%, remote prefills {m['remote_prefills']}, {roles}")
    if mg:
        line += f"  [max goodput at {p['load']}]"
    print(line)
EOF
}

log "1. routing policies on $PREFILL prefill + $DECODE decode nodes"
for policy in kv_aware random round_robin; do
  "$KVMESH" sim --prefill-nodes "$PREFILL" --decode-nodes "$DECODE" --routing "$policy" \
    --load trace "${WORKLOAD[@]}" --out "$OUT/policy-$policy" >/dev/null
done
summary "$OUT"/policy-{kv_aware,random,round_robin}

log "2. disaggregated ($PREFILL + $DECODE) against aggregated ($NODES) at the most goodput"
SEARCH=(--max-goodput --search-axis rate --search-start 16 --search-max 4096 --search-max-probes 12)
"$KVMESH" sim --prefill-nodes "$PREFILL" --decode-nodes "$DECODE" "${SEARCH[@]}" "${WORKLOAD[@]}" \
  --out "$OUT/disaggregated" >/dev/null
"$KVMESH" sim --decode-nodes "$NODES" "${SEARCH[@]}" "${WORKLOAD[@]}" --out "$OUT/aggregated" >/dev/null
summary "$OUT"/{disaggregated,aggregated}

log "3. the local-prefill threshold on $PREFILL + $DECODE nodes"
for t in 0 1024 4096 16384; do
  "$KVMESH" sim --prefill-nodes "$PREFILL" --decode-nodes "$DECODE" --local-prefill-max-tokens "$t" \
    --load trace "${WORKLOAD[@]}" --out "$OUT/threshold-$t" >/dev/null
done
summary "$OUT"/threshold-{0,1024,4096,16384}
