#!/usr/bin/env bash
# Build the local control plane (tools/k8s: one multicall binary) and helm (tools/helm) once per
# content key, then symlink them into <repo>/bin. The key hashes what determines the output (both
# modules' go.mod/go.sum, main.go, the build recipe number below, the Go version and platform), so a
# warm run — even from a fresh clone on the same machine — only re-creates the symlinks.
#
#   tools/build.sh            build if needed, link into bin/
#   tools/build.sh --print-dir  print the cache folder for the current key (no build)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools="$repo/tools"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"

command -v go >/dev/null || { echo "tools: Go is not on PATH (need Go >= 1.26)" >&2; exit 1; }

mod_version() {  # mod_version <go.mod> <module path>: the version it requires
  awk -v m="$2" '$1 == m && $2 ~ /^v/ {print $2; exit}' "$1"
}
k8s_version=$(mod_version "$tools/k8s/go.mod" k8s.io/kubernetes)
helm_version=$(mod_version "$tools/helm/go.mod" helm.sh/helm/v3)
[[ $k8s_version =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] || { echo "tools: bad k8s.io/kubernetes version '$k8s_version'" >&2; exit 1; }
k8s_minor=${BASH_REMATCH[1]}
[[ -n $helm_version ]] || { echo "tools: helm.sh/helm/v3 is not required in tools/helm/go.mod" >&2; exit 1; }

# Bump when the build commands or flags below change (editing comments here must not force a rebuild).
recipe=1
key=$(
  {
    echo "recipe $recipe"
    for f in k8s/go.mod k8s/go.sum k8s/main.go helm/go.mod helm/go.sum; do
      echo "== $f"; cat "$tools/$f"
    done
    go version
    go env GOOS GOARCH
  } | sha256sum | cut -d' ' -f1
)
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/batchknee/tools"
dir="$cache_root/$key"
if [[ ${1:-} == --print-dir ]]; then echo "$dir"; exit 0; fi

names=(kube-apiserver kube-controller-manager kube-scheduler etcd kubectl)

build() {
  # etcd must stay on 3.6 (Kubernetes 1.36's supported line); refuse a graph that moved it.
  local etcd_version
  etcd_version=$(cd "$tools/k8s" && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
  [[ $etcd_version == v3.6.* ]] || { echo "tools: etcd server is $etcd_version, need v3.6.x" >&2; exit 1; }

  local tmp="$dir.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  local start=$SECONDS
  echo "tools: cold build of Kubernetes $k8s_version (etcd $etcd_version) and helm $helm_version into $dir"
  echo "tools: this takes many minutes on a small machine; later runs reuse the cache"

  local kv=k8s.io/component-base/version cv=k8s.io/client-go/pkg/version ld=""
  for pkg in $kv $cv; do
    ld+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
    ld+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit="
  done
  (cd "$tools/k8s" && nice -n 10 go build -trimpath -ldflags "-s -w$ld" -o "$tmp/batchknee-k8s" .)
  echo "tools: batchknee-k8s built after $((SECONDS - start)) s"
  (cd "$tools/helm" && nice -n 10 go build -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version" \
    -o "$tmp/helm" helm.sh/helm/v3/cmd/helm)
  for n in "${names[@]}"; do ln -s batchknee-k8s "$tmp/$n"; done
  echo "$k8s_version" > "$tmp/KUBERNETES_VERSION"
  echo "$helm_version" > "$tmp/HELM_VERSION"
  rm -rf "$dir"; mv "$tmp" "$dir"
  trap - EXIT
  echo "tools: cold build took $((SECONDS - start)) s"
}

mkdir -p "$cache_root"
(
  # One builder per key at a time; a second `make tools` waits and then finds the cache warm.
  flock 9
  if [[ -x $dir/batchknee-k8s && -x $dir/helm ]]; then
    echo "tools: cached $dir (Kubernetes $k8s_version, helm $helm_version)"
  else
    build
  fi
) 9>"$cache_root/.lock"

mkdir -p "$repo/bin"
for n in batchknee-k8s helm "${names[@]}"; do
  ln -sfn "$dir/$n" "$repo/bin/$n"
done
echo "tools: linked into $repo/bin"
