#!/usr/bin/env bash
# The Compose cluster under real Docker (scripts/test.sh runs it): builds the images from
# the release binary (deploy/build-images.sh, with the Dockerfile's image), checks the
# alert rules with promtool, runs deploy/compose_test.py, then checks the Kubernetes
# manifests offline (deploy/k8s/test.sh). Arguments go to
# build-images.sh (--no-build: use target/release/kvmesh as it is).
set -euo pipefail
cd "$(dirname "$0")/.."
docker info >/dev/null 2>&1 || {
  echo "deploy/test.sh: Docker is not running (start the daemon: the deploy tests need it)" >&2
  exit 1
}
start=$(date +%s)
deploy/build-images.sh --dockerfile "$@"
promtool check rules deploy/prometheus/alerts.yaml
promtool check config deploy/prometheus/prometheus.yml
python3 deploy/compose_test.py
deploy/k8s/test.sh
echo "deploy/test.sh: passed in $(( $(date +%s) - start )) s"
