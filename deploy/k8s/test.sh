#!/usr/bin/env bash
# The Kubernetes manifests, offline: renders every overlay with `kubectl kustomize` (with
# certificates made by `kvmesh certs` in a scratch copy), validates each object against
# the Kubernetes schemas (kubernetes-validate, strict) and checks what the schemas cannot
# (deploy/k8s/check.py: probes, drains, grace periods, GPU limits).
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v kubectl >/dev/null || { echo "deploy/k8s/test.sh: kubectl is needed (kustomize)" >&2; exit 1; }
venv="${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh/k8s-venv"
if ! "$venv/bin/kubernetes-validate" --version >/dev/null 2>&1; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q kubernetes-validate
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cp -r deploy/k8s "$scratch/"
for overlay in dev gpu; do
  target/release/kvmesh certs --out "$scratch/k8s/overlays/$overlay/certs" --nodes node --shared >/dev/null
  kubectl kustomize "$scratch/k8s/overlays/$overlay" > "$scratch/$overlay.yaml"
  "$venv/bin/kubernetes-validate" --strict --quiet "$scratch/$overlay.yaml"
  "$venv/bin/python" deploy/k8s/check.py "$overlay" "$scratch/$overlay.yaml"
done
