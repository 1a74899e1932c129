#!/usr/bin/env bash
# Sets up a fresh machine, builds kvmesh, fetches the model if missing and starts it.
# Extra arguments go to the kvmesh command.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo build --release -p kvmesh
target/release/kvmesh fetch-model
exec target/release/kvmesh serve "$@"
