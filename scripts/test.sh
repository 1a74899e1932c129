#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every test, against the real model.
# Builds once in release (the tests run the real forward pass), fetches the model if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings
# The RDMA transport must build (no device here: at run time it reports that and falls back).
cargo clippy -p kvmesh-transfer --all-targets --release --features rdma -- -D warnings
# The CUDA backend must build (cudarc loads the driver at run time: none is needed here), and
# every kernel source must compile with NVRTC (installed by setup.sh; the test fails without it).
cargo clippy -p kvmesh-kernels -p kvmesh-engine --all-targets --release --features cuda -- -D warnings
cargo build --release -p kvmesh
target/release/kvmesh fetch-model
cargo test --workspace --release "$@"
cargo test -p kvmesh-kernels --release --features cuda "$@"
# End to end through real HTTP with the official openai client (its own venv, its own server).
tests/e2e/run.sh
# The Compose cluster under real Docker, Prometheus, the dashboards' and alerts' queries,
# the Dockerfile's image, the Kubernetes manifests.
deploy/test.sh --no-build
# The profile-guided build trains and builds, and its simulator reports are the plain build's
# bytes (its code is laid out anew, never computing anything else).
pgo=$(scripts/build-pgo.sh)
sim_args=(sim --prefill-nodes 30 --decode-nodes 70 --workload mooncake,scale=1 --load trace
  --copies 10 --block-size 16 --fault die:5@60s --seed 7 --plots none --duration 120s)
target/release/kvmesh "${sim_args[@]}" --out target/pgo/check/plain >/dev/null
"$pgo" "${sim_args[@]}" --out target/pgo/check/pgo >/dev/null
for f in report.json requests.csv; do
  cmp target/pgo/check/plain/$f target/pgo/check/pgo/$f
done
