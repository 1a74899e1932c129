#!/usr/bin/env bash
# Builds the images compose.yaml uses, without pulling anything: each image is a root
# filesystem of one binary, the shared libraries `ldd` names, and (for kvmesh) the model,
# imported with `docker import`.
#   kvmesh:local  target/release/kvmesh + the default model (fetched if missing)
#   etcd:local    Debian's etcd (scripts/setup.sh installs it)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh
cargo build --release -p kvmesh
MODEL="$(target/release/kvmesh fetch-model | tail -1)"

# image NAME BINARY CMD [EXTRA_FILE DEST]...
image() {
  local name=$1 bin=$2 cmd=$3; shift 3
  local root; root="$(mktemp -d)"
  trap 'rm -rf "$root"' RETURN
  mkdir -p "$root/usr/bin" "$root/tmp" "$root/etc" "$root/certs"
  chmod 1777 "$root/tmp"
  # A fresh named volume mounted here takes this owner: the unprivileged user writes certs.
  chown 65534:65534 "$root/certs"
  cp "$bin" "$root/usr/bin/"
  # The loader and every library the binary links, at the paths it expects.
  ldd "$bin" | grep -o '/[^ ]*' | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"; cp -L "$lib" "$root$lib"
  done
  while (($#)); do mkdir -p "$root$(dirname "$2")"; cp -L "$1" "$root$2"; shift 2; done
  echo "nobody:x:65534:65534::/tmp:/usr/sbin/nologin" > "$root/etc/passwd"
  tar -C "$root" -c . | docker import -c "ENTRYPOINT [\"$cmd\"]" -c "USER 65534" \
    -c "ENV XDG_CACHE_HOME=/cache" - "$name" >/dev/null
  echo "built $name" >&2
}

image kvmesh:local target/release/kvmesh /usr/bin/kvmesh \
  "$MODEL" /cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf
image etcd:local "$(command -v etcd)" /usr/bin/etcd
