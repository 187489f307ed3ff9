#!/usr/bin/env bash
# Builds the e2e control plane's binaries (etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager), the matching kubectl and helm from Go modules into
# ${RLJOB_CACHE:-$HOME/.cache/rljob}/bin/<name>-<version>/<name>, skipping what is already there.
# Versions are pinned by hack/k8s/go.mod, hack/etcd/go.mod and HELM_VERSION below.
# Unattended: needs only `go` and the Go module proxy. Usage: hack/build-binaries.sh [--print]
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${RLJOB_CACHE:-$HOME/.cache/rljob}"
HELM_VERSION="v3.22.0"
# helm's own Makefile derives its offline default KubeVersion from its client-go (v0.37 -> 1.37).
HELM_KUBE_MINOR="37"

gomod_version() { # <go.mod> <module path>: the version a consumer module requires
  awk -v m="$2" '$1 == m { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$1"
}
K8S_VERSION="$(gomod_version "$HACK/k8s/go.mod" k8s.io/kubernetes)"
ETCD_VERSION="$(gomod_version "$HACK/etcd/go.mod" go.etcd.io/etcd/server/v3)"

bin_path() { echo "$CACHE/bin/$1-$2/$1"; }
# Built from hack/k8s (one consumer module, one GOCACHE: the later ones reuse most compiled packages).
K8S_COMMANDS="kube-apiserver kube-scheduler kube-controller-manager kubectl"

if [[ "${1:-}" == "--print" ]]; then
  for cmd in $K8S_COMMANDS; do echo "$cmd $(bin_path "$cmd" "$K8S_VERSION")"; done
  echo "etcd $(bin_path etcd "$ETCD_VERSION")"
  echo "helm $(bin_path helm "$HELM_VERSION")"
  exit 0
fi

command -v go >/dev/null || { echo "build-binaries: 'go' not found in PATH" >&2; exit 1; }
# Never let `go` fetch another toolchain; -mod=mod lets it complete go.sum on a fresh machine.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"

# build <name> <version> <command...>: runs the command with $OUTDIR set to a temporary dir and
# moves it into place only on success, so an interrupted build never looks cached.
build() {
  local name="$1" version="$2"; shift 2
  local final; final="$(dirname "$(bin_path "$name" "$version")")"
  if [[ -x "$final/$name" ]]; then
    echo "build-binaries: $name $version cached at $final"
    return 0
  fi
  mkdir -p "$CACHE/bin"
  OUTDIR="$(mktemp -d "$CACHE/bin/.$name-$version.XXXXXX")" && chmod 755 "$OUTDIR"
  trap 'rm -rf "$OUTDIR"' EXIT
  echo "build-binaries: building $name $version (cold, all six: ~10-15 min on 2 busy cores)"
  local start=$SECONDS
  "$@"
  rm -rf "$final"
  mv "$OUTDIR" "$final"
  trap - EXIT
  echo "build-binaries: built $name $version in $((SECONDS - start))s -> $final/$name"
}

k8s_ldflags() {
  local v="$K8S_VERSION" minor; minor="$(echo "$K8S_VERSION" | cut -d. -f2)"
  local flags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  echo "$flags"
}

build_k8s() { # <command>: one of $K8S_COMMANDS, from k8s.io/kubernetes/cmd/<command>
  (cd "$HACK/k8s" && nice -n 10 go build -trimpath -pgo=off -ldflags "$(k8s_ldflags)" \
    -o "$OUTDIR/$1" "k8s.io/kubernetes/cmd/$1")
}

build_etcd() {
  (cd "$HACK/etcd" && nice -n 10 go build -trimpath -pgo=off \
    -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCD_VERSION" \
    -o "$OUTDIR/etcd" go.etcd.io/etcd/server/v3)
}

build_helm() {
  local ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$HELM_KUBE_MINOR"
  done
  # helm's go.mod has no replace directives, so a plain `go install pkg@version` works; run it
  # outside any module so the hack/ modules' pins do not apply.
  (cd "$OUTDIR" && GOFLAGS=-buildvcs=false GOBIN="$OUTDIR" nice -n 10 go install -trimpath -pgo=off \
    -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION")
}

total=$SECONDS
build etcd "$ETCD_VERSION" build_etcd
build kube-apiserver "$K8S_VERSION" build_k8s kube-apiserver
build helm "$HELM_VERSION" build_helm
for cmd in kube-scheduler kube-controller-manager kubectl; do
  build "$cmd" "$K8S_VERSION" build_k8s "$cmd"
done
echo "build-binaries: done in $((SECONDS - total))s; cache $(du -sh "$CACHE/bin" | cut -f1) in $CACHE/bin"
"$HACK/build-kueue.sh"  # Kueue for the e2e queueing tests (hack/kueue/go.mod pins it)
