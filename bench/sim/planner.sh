#!/usr/bin/env bash
# The planner benchmark: a day of Azure conversations compressed into an hour of virtual
# time on simulated H200s (Llama-3.1-8B-FP8), served by
#   slo        the `slo` planner (bench/sim/planner-slo.toml)
#   load       the `load` planner (bench/sim/planner-load.toml)
#   peak       a static allocation sized for the peak
#   mean       a static allocation sized for the mean
#   slo-fixed  the `slo` planner with allow_role_switch = false
#   load-fixed the `load` planner with allow_role_switch = false
# and a table of SLO attainment and node-hours (docs/sim.md, "Planner").
#
# The load: requests with the Azure 2023 conversation trace's prompt and output lengths
# (drawn jointly, row by row), arriving as a day compressed into an hour (`day:MIN..MAX@1h`:
# a sine from MIN requests/s at midnight to MAX at noon and back). The bundled trace covers
# one hour, not a day, so the day's shape is the load shape's, its requests the trace's.
# With --trace-order the requests are the trace's own, in its order (its prompt:output mix
# shifts over its hour, so the prefill:decode need shifts over the day), 25 copies of it
# offset within a minute of each other (`--copies 25 --copies-within 60s`).
#
# Usage: bench/sim/planner.sh [--quick | --trace-order]   (--quick: a smaller day in 20
# minutes; a trace-order run takes about a minute of CPU and 0.6 GB, a first-day one about
# five minutes)
# Environment: KVMESH (the binary, default target/release/kvmesh), SEED (default 1), OUT
# (default target/bench-sim/planner[-MODE]-seedSEED), RUNS (the configurations to run, default
# "slo load peak mean slo-fixed load-fixed"; one already in OUT is read, not rerun, when
# RUNS leaves it out), PEAK_HOURS (the peak's node-hours when its run is not in OUT).
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=${1:-full}
case "$mode" in
--quick | --trace-order | full) ;;
*)
	echo "usage: $0 [--quick | --trace-order]" >&2
	exit 2
	;;
esac

kvmesh=${KVMESH:-target/release/kvmesh}
suffix=${mode#--}
[[ $mode == full ]] && suffix="" || suffix="-$suffix"
seed=${SEED:-1}
out=${OUT:-target/bench-sim/planner$suffix-seed$seed}
if [[ ! -x $kvmesh ]]; then
	cargo build --release --bin kvmesh
fi

workload=(--workload synthetic:input=azure,output=azure)
case "$mode" in
--quick)
	load=day:12..50@20m
	requests=40000
	peak=(2 2) # prefill, decode
	mean=(1 1)
	;;
--trace-order)
	load=day:2..8@1h
	requests=450000
	workload=(--workload azure --copies 25 --copies-within 60s)
	peak=(7 6)
	mean=(5 3)
	;;
full)
	load=day:50..200@1h
	requests=450000
	# The smallest static allocation that meets the SLO for 99% of the day's requests.
	peak=(6 5)
	# The smallest that meets it for 99% of requests at a constant load of the day's mean
	# rate (125 requests/s, Poisson).
	mean=(5 3)
	;;
esac
common=(
	--hardware h200-llama8b-fp8
	"${workload[@]}"
	--load "$load" --requests "$requests"
	--block-size 64
	--slo ttft=2s,itl=100ms
	--startup-delay 30s --switch-delay 5s
	--seed "$seed" --plots none
)

mkdir -p "$out"
for policy in slo load; do
	sed 's/^allow_role_switch = true$/allow_role_switch = false/' "bench/sim/planner-$policy.toml" \
		>"$out/planner-$policy-no-switch.toml"
	grep -q '^allow_role_switch = false$' "$out/planner-$policy-no-switch.toml"
done

run() {
	local name=$1
	shift
	echo "$name: $kvmesh sim ${common[*]} $*" >&2
	"$kvmesh" sim "${common[@]}" "$@" --out "$out/$name" >"$out/$name.txt" 2>"$out/$name.err"
}

all_runs="slo load peak mean slo-fixed load-fixed"
runs=" ${RUNS:-$all_runs} "
for name in $runs; do
	[[ " $all_runs " == *" $name "* ]] || {
		echo "RUNS: unknown configuration $name (known: $all_runs)" >&2
		exit 2
	}
done
wanted() { [[ $runs == *" $1 "* ]]; }

# The planners start from the allocation for the mean and find their own from there.
planned=(--prefill-nodes "${mean[0]}" --decode-nodes "${mean[1]}")
if wanted slo; then run slo "${planned[@]}" --planner bench/sim/planner-slo.toml; fi
if wanted load; then run load "${planned[@]}" --planner bench/sim/planner-load.toml; fi
if wanted peak; then run peak --prefill-nodes "${peak[0]}" --decode-nodes "${peak[1]}"; fi
if wanted mean; then run mean "${planned[@]}"; fi
if wanted slo-fixed; then run slo-fixed "${planned[@]}" --planner "$out/planner-slo-no-switch.toml"; fi
if wanted load-fixed; then run load-fixed "${planned[@]}" --planner "$out/planner-load-no-switch.toml"; fi

# One row per configuration: a static run's node-hours are its nodes over the run.
row() {
	jq -r --arg name "$1" --argjson peak "$2" '
		.points[0] as $p
		| ($p.slo.objectives | map({(.objective): .share}) | add) as $o
		| ($p.planner.node_hours_total // (($p.mesh.nodes | length) * $p.slo.duration_s / 3600)) as $h
		| ($p.planner // null) as $pl
		| [ $name,
		    (if $pl then "\($pl.timeline | map(.prefill_serving) | min)-\($pl.timeline | map(.prefill_serving) | max) + \($pl.timeline | map(.decode_serving) | min)-\($pl.timeline | map(.decode_serving) | max)"
		     else "\($p.mesh.nodes | map(select(.role == "prefill")) | length) + \($p.mesh.nodes | map(select(.role == "decode")) | length)" end),
		    "\($p.slo.all.share * 100 * 100 | round / 100)%",
		    "\($o.ttft * 100 * 100 | round / 100)%",
		    "\($o.itl * 100 * 100 | round / 100)%",
		    "\($h * 100 | round / 100)",
		    (if $peak > 0 then "\($h / $peak * 100 | round)%" else "-" end),
		    (if $pl then "\($pl.role_switches)" else "-" end) ]
		| "| " + join(" | ") + " |"' "$out/$1/report.json"
}
if [[ -f $out/peak/report.json ]]; then
	peak_hours=$(jq '.points[0] | (.mesh.nodes | length) * .slo.duration_s / 3600' "$out/peak/report.json")
else
	peak_hours=${PEAK_HOURS:-0}
fi
{
	echo "${workload[*]} --load $load, $requests requests, SLO ttft=2s,itl=100ms, seed $seed"
	echo
	echo "| configuration | prefill + decode nodes | SLO attainment | TTFT | ITL | node-hours | of peak | role switches |"
	echo "|---|---|---|---|---|---|---|---|"
	for name in $all_runs; do
		if [[ -f $out/$name/report.json ]]; then row "$name" "$peak_hours"; fi
	done
} | tee "$out/table.md"
