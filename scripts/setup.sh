#!/usr/bin/env bash
# Installs the system packages kvmesh needs to build and test on a fresh Debian machine.
# Idempotent; runs apt-get only when something is missing.
set -euo pipefail

# Packages named on the command line, where missing (build-pgo.sh's LLVM fallback).
need=()
for pkg in "$@"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
# protoc's well-known types (google/protobuf/*.proto), which etcd-client's protos import.
dpkg -s libprotobuf-dev >/dev/null 2>&1 || need+=(libprotobuf-dev)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v python3 >/dev/null 2>&1 || need+=(python3 python3-pip python3-venv)
# Venvs (NVRTC's below, the e2e tests') need ensurepip, which Debian ships apart from python3.
command -v python3 >/dev/null 2>&1 && ! python3 -c 'import ensurepip' 2>/dev/null && need+=(python3-venv)
command -v unzip >/dev/null 2>&1 || need+=(unzip)
# The slow-link test: network namespaces, veth pairs, a token bucket (tc), and iptables for
# random loss and a queue that delays packets.
{ command -v ip && command -v tc; } >/dev/null 2>&1 || need+=(iproute2)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
# deploy/: etcdctl (the etcd image's health check), Prometheus and promtool (the monitoring
# image, the alert rules' check).
command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# deploy/build-images.sh --dockerfile: a Debian base image made here (none can be pulled).
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
# The CUDA GEMV's host test (kernels/tests/cuda_host.rs) compiles the .cu sources as C++20.
command -v c++ >/dev/null 2>&1 || need+=(g++)
# The `rdma` feature (ibverbs bindings are generated with bindgen and built with cmake).
for pkg in libibverbs-dev cmake pkg-config libclang-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done

if ((${#need[@]})); then
  echo "setup: installing ${need[*]}" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# NVRTC for the CUDA kernels' compile test (kernels/tests/cuda_nvrtc.rs; no driver or GPU
# needed): the wheel's libnvrtc in its own venv, where kvmesh-kernels looks for it. 13.0
# matches the CUDA 13.0 driver we run on (its PTX must not be newer than the driver).
NVRTC_VENV="$HOME/.cache/kvmesh/nvrtc"
NVRTC_VERSION="13.0.88"
if ! "$NVRTC_VENV/bin/python" -m pip show nvidia-cuda-nvrtc 2>/dev/null | grep -x "Version: $NVRTC_VERSION" >/dev/null; then
  echo "setup: installing NVRTC $NVRTC_VERSION into $NVRTC_VENV" >&2
  python3 -m venv "$NVRTC_VENV"
  "$NVRTC_VENV/bin/python" -m pip install -q --disable-pip-version-check "nvidia-cuda-nvrtc==$NVRTC_VERSION"
fi
