#!/usr/bin/env bash
# Builds the images deploy/ uses, without pulling anything:
#   kvmesh:local       target/release/kvmesh, its libraries and the default model
#   etcd:local         Debian's etcd
#   prometheus:local   Debian's Prometheus
# each a root filesystem of one binary and the shared libraries `ldd` names, imported with
# `docker import`; and, with --dockerfile,
#   debian:bookworm-slim  a minimal Debian made with debootstrap (what deploy/Dockerfile
#                         starts from; skipped when the image exists)
#   kvmesh:dockerfile     deploy/Dockerfile built over it
# Prints each image's size. --no-build takes target/release/kvmesh as it is.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
dockerfile=false build=true
for arg in "$@"; do
  case "$arg" in
    --dockerfile) dockerfile=true ;;
    --no-build) build=false ;;
    *) echo "usage: $0 [--dockerfile] [--no-build]" >&2; exit 2 ;;
  esac
done

scripts/setup.sh
if $build; then cargo build --release -p kvmesh; fi
MODEL="$(target/release/kvmesh fetch-model | tail -1)"

# image NAME BINARY CMD [EXTRA_FILE DEST]...
image() {
  local name=$1 bin=$2 cmd=$3; shift 3
  local root; root="$(mktemp -d)"
  trap 'rm -rf "$root"' RETURN
  mkdir -p "$root/usr/bin" "$root/tmp" "$root/etc" "$root/certs" "$root/data"
  chmod 1777 "$root/tmp"
  # A fresh named volume mounted here takes this owner: the unprivileged user writes there.
  chown 65534:65534 "$root/certs" "$root/data"
  # Without debug line tables (backtraces keep function names): kvmesh shrinks from 141 MB.
  strip --strip-debug -o "$root/usr/bin/$(basename "$bin")" "$bin"
  # The loader and every library the binary links, at the paths it expects.
  { ldd "$bin" || true; } | grep -o '/[^ ]*' | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"; cp -L "$lib" "$root$lib"
  done
  while (($#)); do mkdir -p "$root$(dirname "$2")"; cp -L "$1" "$root$2"; shift 2; done
  echo "nobody:x:65534:65534::/tmp:/usr/sbin/nologin" > "$root/etc/passwd"
  echo "nogroup:x:65534:" > "$root/etc/group"
  tar -C "$root" -c . | docker import -c "ENTRYPOINT [\"$cmd\"]" -c "USER 65534" \
    -c "ENV XDG_CACHE_HOME=/cache" - "$name" >/dev/null
}

size() { docker image inspect -f '{{.Size}}' "$1" | awk -v n="$1" '{printf "%-22s %6.1f MB\n", n, $1/1e6}'; }

image kvmesh:local target/release/kvmesh /usr/bin/kvmesh \
  "$MODEL" /cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf
image etcd:local "$(command -v etcd)" /usr/bin/etcd "$(command -v etcdctl)" /usr/bin/etcdctl
image prometheus:local "$(command -v prometheus)" /usr/bin/prometheus
images=(kvmesh:local etcd:local prometheus:local)

if $dockerfile; then
  if ! docker image inspect debian:bookworm-slim >/dev/null 2>&1; then
    # The Debian mirror this machine's apt uses.
    suite="$(. /etc/os-release && echo "$VERSION_CODENAME")"
    mirror="$(apt-cache policy | awk -v s="$suite/main" '$3 == s {print $2; exit}')"
    [ "$suite" = bookworm ] && [ -n "$mirror" ] || {
      echo "build-images: need a Debian bookworm host with apt sources to debootstrap from" >&2
      exit 1
    }
    base="$(mktemp -d)"
    debootstrap --variant=minbase "$suite" "$base" "$mirror" >/dev/null
    # Slim: no package lists, caches, documentation or locales.
    rm -rf "$base"/var/lib/apt/lists/* "$base"/var/cache/apt/*.bin "$base"/usr/share/doc/* \
      "$base"/usr/share/man/* "$base"/usr/share/locale/* "$base"/var/log/*.log
    tar -C "$base" -c . | docker import -c 'CMD ["bash"]' - debian:bookworm-slim >/dev/null
    rm -rf "$base"
  fi
  docker build -q -f deploy/Dockerfile -t kvmesh:dockerfile . >/dev/null
  images+=(debian:bookworm-slim kvmesh:dockerfile)
fi
for i in "${images[@]}"; do size "$i"; done
