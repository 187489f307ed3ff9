#!/usr/bin/env bash
# Builds Kueue's manager binary (sigs.k8s.io/kueue/cmd/kueue) from the consumer module hack/kueue
# into ${RLJOB_CACHE:-$HOME/.cache/rljob}/bin/kueue-<version>/kueue, skipping it when already there.
# The version is pinned by hack/kueue/go.mod. Kueue's CRDs are not built: tests read them from the
# module cache (sigs.k8s.io/kueue@<version>/config/components/crd/bases), which this build fills.
# Unattended: needs only `go` and the Go module proxy. Usage: hack/build-kueue.sh [--print]
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${RLJOB_CACHE:-$HOME/.cache/rljob}"
KUEUE_VERSION="$(awk '$1 == "sigs.k8s.io/kueue" { print $2; exit }' "$HACK/kueue/go.mod")"
[[ -n "$KUEUE_VERSION" ]] || { echo "build-kueue: no sigs.k8s.io/kueue in hack/kueue/go.mod" >&2; exit 1; }
FINAL="$CACHE/bin/kueue-$KUEUE_VERSION"

if [[ "${1:-}" == "--print" ]]; then
  echo "kueue $FINAL/kueue"
  exit 0
fi

command -v go >/dev/null || { echo "build-kueue: 'go' not found in PATH" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"

if [[ -x "$FINAL/kueue" ]]; then
  echo "build-kueue: kueue $KUEUE_VERSION cached at $FINAL"
  exit 0
fi

mkdir -p "$CACHE/bin"
# Built into a temp dir and moved into place only on success, so an interrupted build never
# looks cached (the same rule as hack/build-binaries.sh).
OUTDIR="$(mktemp -d "$CACHE/bin/.kueue-$KUEUE_VERSION.XXXXXX")" && chmod 755 "$OUTDIR"
trap 'rm -rf "$OUTDIR"' EXIT
echo "build-kueue: building kueue $KUEUE_VERSION (cold: ~5 min of 2 idle cores, 13 min on 2 busy ones)"
start=$SECONDS
# The same version variables as Kueue's Makefile sets (Makefile:86-89@v0.17.0).
ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
ldflags+=" -X sigs.k8s.io/kueue/pkg/version.GitCommit=$KUEUE_VERSION"
ldflags+=" -X sigs.k8s.io/kueue/pkg/version.BuildDate=1970-01-01T00:00:00Z"
(cd "$HACK/kueue" && nice -n 10 go build -trimpath -pgo=off -ldflags "$ldflags" \
  -o "$OUTDIR/kueue" sigs.k8s.io/kueue/cmd/kueue)
# The module zip carries the CRDs; make sure the module cache has it even if the build came
# from a cached GOCACHE on a machine whose module cache was cleaned.
(cd "$HACK/kueue" && go mod download sigs.k8s.io/kueue)
rm -rf "$FINAL"
mv "$OUTDIR" "$FINAL"
trap - EXIT
echo "build-kueue: built kueue $KUEUE_VERSION in $((SECONDS - start))s -> $FINAL/kueue"
