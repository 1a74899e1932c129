#!/usr/bin/env bash
# Build the reference llama.cpp (the copy vendored in llama-cpp-python 0.3.16)
# natively for this CPU, cached outside the repository.
#
# Usage: bench/llamacpp_build.sh [--force]
#   KVMESH_LLAMACPP_DIR   cache dir (default: $HOME/.cache/kvmesh/llama.cpp)
#   KVMESH_LLAMACPP_JOBS  parallel build jobs (default: nproc)
#
# Idempotent: if llama-bench, llama-batched-bench and llama-server already
# exist under $KVMESH_LLAMACPP_DIR/build/bin it does nothing.
# On success the binaries are in $KVMESH_LLAMACPP_DIR/build/bin.
set -euo pipefail

LLAMA_CPP_PY_VERSION=0.3.16
DIR="${KVMESH_LLAMACPP_DIR:-$HOME/.cache/kvmesh/llama.cpp}"
JOBS="${KVMESH_LLAMACPP_JOBS:-$(nproc 2>/dev/null || echo 2)}"
TARGETS=(llama-bench llama-batched-bench llama-server)
FORCE=0

for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

log() { echo "[llamacpp_build] $*" >&2; }

have_all() {
  local t
  for t in "${TARGETS[@]}"; do
    [[ -x "$DIR/build/bin/$t" ]] || return 1
  done
}

if [[ $FORCE -eq 0 ]] && have_all; then
  log "already built: $DIR/build/bin"
  exit 0
fi

# ---- system prerequisites --------------------------------------------------
need_pkgs=()
command -v cmake >/dev/null 2>&1 || need_pkgs+=(cmake)
command -v cc    >/dev/null 2>&1 || need_pkgs+=(gcc)
command -v c++   >/dev/null 2>&1 || need_pkgs+=(g++)
command -v make  >/dev/null 2>&1 || need_pkgs+=(make)
command -v git   >/dev/null 2>&1 || need_pkgs+=(git)
command -v python3 >/dev/null 2>&1 || need_pkgs+=(python3)
if ! python3 -m pip --version >/dev/null 2>&1; then need_pkgs+=(python3-pip); fi
if [[ ${#need_pkgs[@]} -gt 0 ]]; then
  log "installing system packages: ${need_pkgs[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update
  $SUDO apt-get install -y --no-install-recommends "${need_pkgs[@]}"
fi

# ---- fetch the llama.cpp source (vendored in the llama-cpp-python sdist) ---
mkdir -p "$DIR"
SRC="$DIR/src"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  log "downloading llama-cpp-python==$LLAMA_CPP_PY_VERSION sdist"
  python3 -m pip download --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMA_CPP_PY_VERSION" -d "$tmp"
  sdist="$(find "$tmp" -maxdepth 1 -name 'llama*cpp*python-*.tar.gz' -print -quit)"
  [[ -n "$sdist" ]] || { log "sdist not found in $tmp"; exit 1; }
  tar -xzf "$sdist" -C "$tmp"
  vendor="$(find "$tmp" -maxdepth 4 -type d -path '*/vendor/llama.cpp' -print -quit)"
  [[ -n "$vendor" && -f "$vendor/CMakeLists.txt" ]] || { log "vendor/llama.cpp not found in sdist"; exit 1; }
  rm -rf "$SRC"
  mv "$vendor" "$SRC"
  echo "llama-cpp-python==$LLAMA_CPP_PY_VERSION ($(basename "$sdist"))" > "$DIR/SOURCE"
fi

# ---- build -------------------------------------------------------------------
start=$(date +%s)
log "configuring ($SRC -> $DIR/build)"
cmake -S "$SRC" -B "$DIR/build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_SERVER=ON
log "building ${TARGETS[*]} with -j$JOBS"
cmake --build "$DIR/build" --config Release -j"$JOBS" --target "${TARGETS[@]}"
end=$(date +%s)

have_all || { log "build finished but binaries are missing in $DIR/build/bin"; exit 1; }
echo "build_seconds=$((end - start)) date=$(date -u +%FT%TZ) host_cpu=\"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')\"" > "$DIR/BUILD_INFO"
log "built in $((end - start))s: $DIR/build/bin"
