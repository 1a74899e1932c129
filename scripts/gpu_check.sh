#!/usr/bin/env bash
# The CUDA backend's device run (issue 18, docs/gpu.md), in two halves:
#
#   scripts/gpu_check.sh --build     here, with Rust: builds kvmesh with `--features cuda`,
#                                    stripped, into target/gpu/kvmesh, and fills
#                                    target/gpu/kernels with the kernels' PTX for sm_90 (NVRTC
#                                    from scripts/setup.sh), so the GPU machine needs neither
#                                    a toolchain nor NVRTC. Carry target/gpu (about 30 MiB).
#   scripts/gpu_check.sh [OUT_DIR [MODEL.gguf]] [-- GPU_CHECK_FLAGS...]
#                                    on the GPU machine: runs `kvmesh gpu-check` (ops against
#                                    the CPU; whole-model agreement, with and without CUDA
#                                    graphs, and throughput on random SmolLM2- and
#                                    Llama-3-8B-shaped models; a GPU prefill worker handing KV
#                                    over QUIC to a CPU decode worker; the SmolLM2 golden
#                                    prompts when MODEL.gguf is given) and writes
#                                    OUT_DIR/gpu_check.json (default: the current directory).
#                                    Flags after `--` go to `kvmesh gpu-check` (e.g.
#                                    `-- --checks ops,handoff --shapes smollm2`).
#   scripts/gpu_check.sh --split-model [MODEL.gguf]
#                                    here: cuts the GGUF (default: the model `kvmesh
#                                    fetch-model` keeps) into parts of 24 MiB under
#                                    target/gpu-model, with its sha256, since a device run
#                                    carries at most 64 MiB. Carry the parts over successive
#                                    calls to the warm machine (a call keeps what earlier calls
#                                    carried); a run given no MODEL.gguf joins them, checks the
#                                    sha256 and uses the model (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_DIR=target/gpu

if [ "${1:-}" = "--build" ]; then
  scripts/setup.sh
  cargo build --release -p kvmesh --features cuda
  mkdir -p "$GPU_DIR"
  cp target/release/kvmesh "$GPU_DIR/kvmesh"
  strip "$GPU_DIR/kvmesh"
  rm -rf "$GPU_DIR/kernels"
  KVMESH_KERNEL_CACHE="$GPU_DIR/kernels" "$GPU_DIR/kvmesh" gpu-check --fill-cache compute_90
  du -sh "$GPU_DIR"
  size_mib=$(du -sm "$GPU_DIR" | cut -f1)
  if [ "$size_mib" -ge 64 ]; then
    echo "gpu_check: $GPU_DIR is $size_mib MiB, over the 64 MiB a device run can carry" >&2
    exit 1
  fi
  exit 0
fi

MODEL_DIR=target/gpu-model
if [ "${1:-}" = "--split-model" ]; then
  src="${2:-$(target/release/kvmesh fetch-model 2>/dev/null | tail -n 1)}"
  [ -f "$src" ] || { echo "gpu_check: no model at '$src'" >&2; exit 1; }
  rm -rf "$MODEL_DIR"
  mkdir -p "$MODEL_DIR"
  split -b 24M -d -a 1 "$src" "$MODEL_DIR/model.gguf.part-"
  (cd "$(dirname "$src")" && sha256sum "$(basename "$src")") | cut -d' ' -f1 > "$MODEL_DIR/model.gguf.sha256"
  ls -la "$MODEL_DIR"
  exit 0
fi

out="."
model=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then out="$1"; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then model="$1"; shift; fi
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi
mkdir -p "$out"
[ -x "$GPU_DIR/kvmesh" ] || { echo "gpu_check: no $GPU_DIR/kvmesh: run scripts/gpu_check.sh --build and carry $GPU_DIR" >&2; exit 1; }

# cudarc opens libcuda, libcublas and libcublasLt by name: put the directories that hold them
# (the driver's, a CUDA toolkit's, pip's nvidia-* wheels') on the library path.
dirs=()
for lib in libcuda.so.1 libcublas.so.13 libcublasLt.so.13; do
  found=$(find /usr/local/nvidia /usr/local/cuda* /usr/lib/x86_64-linux-gnu /opt /usr/local/lib \
    -name "$lib" 2>/dev/null | head -1 || true)
  if [ -n "$found" ]; then dirs+=("$(dirname "$found")"); else echo "gpu_check: $lib not found" >&2; fi
done
LD_LIBRARY_PATH="$(IFS=:; echo "${dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
export KVMESH_KERNEL_CACHE="$PWD/$GPU_DIR/kernels"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
# No model given but parts carried: join them, and refuse a model that is not the one cut.
if [ -z "$model" ] && [ -f "$MODEL_DIR/model.gguf.sha256" ]; then
  model="$MODEL_DIR/model.gguf"
  cat "$MODEL_DIR"/model.gguf.part-* > "$model"
  if [ "$(sha256sum "$model" | cut -d' ' -f1)" != "$(cat "$MODEL_DIR/model.gguf.sha256")" ]; then
    echo "gpu_check: the model's parts in $MODEL_DIR do not join into the model cut (a part missing?):" >&2
    ls -la "$MODEL_DIR" >&2
    rm -f "$model"
    exit 1
  fi
fi
model_args=()
if [ -n "$model" ]; then model_args=(--model "$model"); fi
"$GPU_DIR/kvmesh" gpu-check --out "$out/gpu_check.json" "${model_args[@]}" "$@"
