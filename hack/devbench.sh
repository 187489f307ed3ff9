#!/usr/bin/env bash
# The control benchmark on a machine with no package index (its image: Python 3.12 without kopf,
# kubernetes or pydantic), where the files travel in transfers of limited size, in two steps:
#   here:  bash hack/devbench.sh pack    -> .whl/ (wheels), .devbench/a (etcd, kube-apiserver) and
#                                           .devbench/b (kube-scheduler, kube-controller-manager, kubectl)
#   there: bash hack/devbench.sh setup   -> the wheels under /tmp/site, the binaries where ensure_binaries
#                                           looks; run it in each call, carrying .whl + .devbench/a in the
#                                           first and .devbench/b in the second. pack fails if either
#                                           would not fit one transfer of RLJOB_TRANSFER_MIB (default 64)
#                                           beside the repository's tracked files.
# Both read .devbench/versions, written by pack from the versions this checkout pins. The image has
# uvloop (the package's loop) already; py-spy is carried for --profile.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${RLJOB_BIN_CACHE:-$HOME/.cache/rljob/bin}

pinned() {  # a version operator/rljob/testing/cluster.py pins: NAME = "vX.Y.Z"
  sed -n "s/^$1 = \"\(.*\)\"$/\1/p" operator/rljob/testing/cluster.py
}

pack() {
  local k8s etcd helm
  k8s=$(pinned K8S_VERSION); etcd=$(pinned ETCD_VERSION); helm=$(pinned HELM_VERSION)
  mkdir -p .devbench/a .devbench/b .whl
  printf 'etcd %s\nkube-apiserver %s\nkube-scheduler %s\nkube-controller-manager %s\nkubectl %s\nhelm %s\n' \
    "$etcd" "$k8s" "$k8s" "$k8s" "$k8s" "$helm" > .devbench/versions
  for name in etcd kube-apiserver kube-scheduler kube-controller-manager kubectl; do
    local dir=b ver
    case $name in etcd|kube-apiserver) dir=a ;; esac
    ver=$(awk -v n="$name" '$1==n{print $2}' .devbench/versions)
    [ -s ".devbench/$dir/$name.xz" ] || xz -6 -T0 -c "$BIN/$name-$ver/$name" > ".devbench/$dir/$name.xz"
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl kopf kubernetes pydantic pydantic_core annotated-types typing-inspection typing_extensions \
    iso8601 jsonpatch jsonpointer python-json-logger durationpy oauthlib requests-oauthlib \
    websocket-client aiohttp-retry aiohttp py-spy
  du -sh .whl .devbench/a .devbench/b
  local limit repo first second
  limit=$(( ${RLJOB_TRANSFER_MIB:-64} << 20 ))
  repo=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}')
  first=$(du -cb .whl .devbench/a | tail -1 | cut -f1)
  second=$(du -cb .devbench/b | tail -1 | cut -f1)
  if (( repo + first >= limit || repo + second >= limit )); then
    echo "devbench.sh: a transfer would carry $(( (repo + first) >> 20 )) and $(( (repo + second) >> 20 )) MiB, over RLJOB_TRANSFER_MIB" >&2
    return 1
  fi
}

setup() {
  if [ -d .whl ] && [ ! -d /tmp/site/kopf ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  local f name ver
  for f in .devbench/a/*.xz .devbench/b/*.xz; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .xz)
    ver=$(awk -v n="$name" '$1==n{print $2}' .devbench/versions)
    [ -x "$BIN/$name-$ver/$name" ] && continue
    mkdir -p "$BIN/$name-$ver"
    xz -dc "$f" > "$BIN/$name-$ver/$name"
    chmod +x "$BIN/$name-$ver/$name"
  done
  # The benchmark never runs helm; ensure_binaries looks for it with the others.
  ver=$(awk '$1=="helm"{print $2}' .devbench/versions)
  if [ ! -x "$BIN/helm-$ver/helm" ]; then
    mkdir -p "$BIN/helm-$ver"
    printf '#!/bin/sh\necho "helm: not carried to this machine" >&2\nexit 1\n' > "$BIN/helm-$ver/helm"
    chmod +x "$BIN/helm-$ver/helm"
  fi
}

case "${1:-}" in
  pack) pack ;;
  setup) setup ;;
  *) echo "usage: $0 pack|setup" >&2; exit 2 ;;
esac
