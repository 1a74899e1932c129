#!/usr/bin/env bash
# Builds kvmesh optimized with a profile of its own runs (profile-guided optimization, PGO):
# an instrumented build runs the simulator (routing, the prefix index, the engine's scheduler
# and block pools on 1,000 nodes, and a node dying on 100) and the CPU engine (prefill and
# batched decode on the real model); the release build then lays out and inlines its code by
# those counts. The simulator's event loop runs about 7% faster than a plain release build's;
# its reports are the same bytes (`kvmesh sim`, docs/sim.md). Its CPU engine prefills about
# 10% slower than the plain build's: serve with that one. Takes two release builds.
#
# Prints the binary's path: target/pgo/build/<host>/release/kvmesh. Needs llvm-profdata: rustup's
# llvm-tools component (matching rustc's LLVM), added if missing, or else Debian's.
set -euo pipefail
cd "$(dirname "$0")/.."

host=$(rustc -vV | sed -n 's/^host: //p')
profdata="$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata"
if [ ! -x "$profdata" ] && ! rustup component add llvm-tools >&2; then
  # No toolchain server (a machine that reaches only package registries): Debian 12's newest
  # LLVM, whose llvm-profdata reads the raw profiles of rustc 1.95's LLVM 22 runtime (their
  # format is versioned; merging fails loudly where it cannot read one).
  echo "build-pgo: no llvm-tools component; using Debian's llvm-19" >&2
  scripts/setup.sh llvm-19 >&2
  profdata=llvm-profdata-19
fi
pgo="$PWD/target/pgo"
runs="$pgo/runs"
rm -rf "$runs" "$pgo/train-out"
mkdir -p "$runs"

# `--target` keeps the flags off build scripts and proc macros: only kvmesh's own code is
# instrumented, and only it runs during training.
build() {
  RUSTFLAGS="$1" cargo build --release -p kvmesh --target "$host" --target-dir "$2" >&2
}

build "-Cprofile-generate=$runs" "$pgo/train"
train="$pgo/train/$host/release/kvmesh"
out="$pgo/train-out"
echo "build-pgo: training" >&2
"$train" sim --prefill-nodes 300 --decode-nodes 700 --workload mooncake,scale=1 --load trace \
  --copies 100 --block-size 512 --seed 1 --plots none --duration 600s --out "$out/mesh" >&2
"$train" sim --prefill-nodes 30 --decode-nodes 70 --workload mooncake,scale=1 --load trace \
  --copies 10 --block-size 16 --fault die:5@60s --seed 1 --plots none --duration 300s \
  --out "$out/fault" >&2
"$train" fetch-model >&2
"$train" bench engine --threads 1 --prefill-tokens 256 --batches 1,16 --decode-tokens 16 \
  --budgets 512 --interference-prompt 256 --repeats 1 >&2
"$profdata" merge -o "$pgo/kvmesh.profdata" "$runs"

build "-Cprofile-use=$pgo/kvmesh.profdata" "$pgo/build"
echo "$pgo/build/$host/release/kvmesh"
