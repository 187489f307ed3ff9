#!/usr/bin/env bash
# Builds the container images from images/*/Dockerfile: rljob-operator, rljob-agent (the product) and
# rljob-testing (product + test world, for examples/rljob.yaml's trainer). See docs/images.md.
#
#   hack/build-images.sh                 # docker when a Docker daemon answers, else buildah
#   hack/build-images.sh --builder buildah|docker
#   hack/build-images.sh --print         # the buildah storage flags, the base image and the tags
#
# With docker the Dockerfiles' default base (python:3.11.14-slim-bookworm) is pulled as usual. With
# buildah (daemonless, no registry needed) the base is made here from Debian packages: debootstrap a
# minimal bookworm with python3 + pip, cached as a tarball, imported as localhost/rljob-base:<key>, and
# passed as --build-arg BASE_IMAGE. The base tarball and buildah's storage live under
# ${RLJOB_CACHE:-$HOME/.cache/rljob}, so a warm run starts from the cached base.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${RLJOB_CACHE:-$HOME/.cache/rljob}"
REGISTRY="${RLJOB_IMAGE_REGISTRY:-ghcr.io/rljob}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)"
IMAGES="operator agent testing"  # images/<dir> -> $REGISTRY/rljob-<dir>:$VERSION

# The local base: a Debian bookworm with the packages the Dockerfiles use from python:slim (python3, pip).
SUITE=bookworm
MIRROR="${RLJOB_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES="python3,python3-pip,ca-certificates"
BASE_RECIPE=2  # bump when the trimming below changes: it is part of the cache key
BASE_KEY="$(printf '%s\n' "$SUITE" "$PACKAGES" "$BASE_RECIPE" | sha256sum | cut -c1-12)"
BASE_IMAGE="localhost/rljob-base:$SUITE-$BASE_KEY"
BASE_TAR="$CACHE/images/rljob-base-$SUITE-$BASE_KEY.tar"

STORAGE="$CACHE/containers"
BUILDAH=(buildah --root "$STORAGE/storage" --runroot "$STORAGE/run"
         --storage-driver "${RLJOB_STORAGE_DRIVER:-overlay}")

tag() { echo "$REGISTRY/rljob-$1:$VERSION"; }

builder="auto"
case "${1:-}" in
  --print)
    echo "buildah_flags ${BUILDAH[*]:1}"
    echo "base_image $BASE_IMAGE"
    for image in $IMAGES; do echo "image $image $(tag "$image")"; done
    exit 0 ;;
  --builder) builder="${2:?--builder buildah|docker}" ;;
  "") ;;
  *) echo "usage: $0 [--builder buildah|docker] [--print]" >&2; exit 2 ;;
esac
if [[ "$builder" == auto ]]; then
  if command -v docker >/dev/null && timeout 10 docker info >/dev/null 2>&1; then builder=docker; else builder=buildah; fi
fi

total=$SECONDS
if [[ "$builder" == docker ]]; then
  for image in $IMAGES; do
    start=$SECONDS
    DOCKER_BUILDKIT=1 docker build -f "$ROOT/images/$image/Dockerfile" -t "$(tag "$image")" "$ROOT"
    echo "build-images: $(tag "$image") built with docker in $((SECONDS - start))s"
  done
  docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep "^$REGISTRY/rljob-" || true
  echo "build-images: done in $((SECONDS - total))s (docker)"
  exit 0
fi

for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || {
    echo "build-images: '$tool' not found (Debian: apt-get install buildah debootstrap)" >&2; exit 1; }
done

make_base_tar() {  # debootstrap + trim into a temp dir; the tarball is moved in place only when complete
  mkdir -p "$CACHE/images"
  local tmp; tmp="$(mktemp -d "$CACHE/images/.base.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  echo "build-images: debootstrap $SUITE ($PACKAGES) from $MIRROR"
  local start=$SECONDS
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$tmp/rootfs" "$MIRROR" > "$tmp/debootstrap.log" 2>&1 \
    || { tail -20 "$tmp/debootstrap.log" >&2; exit 1; }
  local r="$tmp/rootfs"
  # What python:*-slim leaves out too: package caches and lists, docs, man pages, locales, bytecode.
  rm -rf "$r"/var/cache/apt/*.bin "$r"/var/cache/apt/archives/*.deb "$r"/var/lib/apt/lists/* \
         "$r"/usr/share/doc/* "$r"/usr/share/man/* "$r"/usr/share/info/* "$r"/usr/share/locale/* \
         "$r"/var/log/*.log "$r"/var/cache/debconf/*-old
  find "$r" -name __pycache__ -prune -exec rm -rf {} +
  # A container's interpreter belongs to the image (as python:slim's does): pip may install into it.
  rm -f "$r"/usr/lib/python3*/EXTERNALLY-MANAGED
  tar --numeric-owner -C "$r" -cf "$tmp/base.tar" .
  mv "$tmp/base.tar" "$BASE_TAR"
  rm -rf "$tmp"; trap - EXIT
  echo "build-images: base rootfs $(du -h "$BASE_TAR" | cut -f1) in $((SECONDS - start))s -> $BASE_TAR"
}

import_base() {
  local ctr
  ctr="$("${BUILDAH[@]}" from scratch)"
  "${BUILDAH[@]}" add "$ctr" "$BASE_TAR" / > /dev/null
  "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 \
    --label org.opencontainers.image.description="Debian $SUITE + $PACKAGES (debootstrap, hack/build-images.sh)" \
    "$ctr"
  "${BUILDAH[@]}" commit --rm -q "$ctr" "$BASE_IMAGE" > /dev/null
  echo "build-images: imported $BASE_IMAGE"
}

mkdir -p "$STORAGE/storage" "$STORAGE/run"
if ! "${BUILDAH[@]}" images -q > /dev/null 2>&1; then
  echo "build-images: unreadable storage in $STORAGE (restored from an incomplete cache?): starting afresh" >&2
  rm -rf "$STORAGE/storage" "$STORAGE/run"; mkdir -p "$STORAGE/storage" "$STORAGE/run"
fi
[[ -f "$BASE_TAR" ]] || make_base_tar
[[ -n "$("${BUILDAH[@]}" images -q "$BASE_IMAGE" 2>/dev/null)" ]] || import_base

# The build's HTTPS goes through whatever the host trusts (a proxy's CA, say): its CA bundle is bound
# into the RUN steps only, never into a layer.
trust=()
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && trust=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
# What an image is built from: its Dockerfile and ignore file, the base, and every file the context may
# hold (a superset of what the ignore file lets in, so a change is never missed). Kept as a label: an
# image whose label matches is up to date and not rebuilt.
inputs_of() {
  { echo "$BASE_IMAGE"
    cat "$ROOT/images/$1/Dockerfile" "$ROOT/images/$1/Dockerfile.dockerignore" "$ROOT/pyproject.toml" "$ROOT/README.md" \
        "$ROOT/packaging/rljob-testing/pyproject.toml"
    (cd "$ROOT" && find operator -type f ! -path '*/__pycache__/*' ! -name '*.py[co]' ! -path '*.egg-info/*' \
       -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-16
}
# No --layers: buildah 1.28 cannot bind-mount a cached stage (RUN --mount=type=bind,from=build fails
# with "couldn't find .../merged/wheels" when stage 1 is a cache hit), so every build runs both stages.
for image in $IMAGES; do
  start=$SECONDS
  inputs="$(inputs_of "$image")"
  built="$("${BUILDAH[@]}" inspect --type image --format '{{index .ImageAnnotations "io.rljob.build-inputs"}}{{index .OCIv1.Config.Labels "io.rljob.build-inputs"}}' "$(tag "$image")" 2>/dev/null || true)"
  if [[ "$built" == "$inputs" ]]; then
    echo "build-images: $(tag "$image") up to date (inputs $inputs)"
    continue
  fi
  "${BUILDAH[@]}" build --quiet --pull=never --isolation chroot "${trust[@]}" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --label "io.rljob.build-inputs=$inputs" \
    -f "$ROOT/images/$image/Dockerfile" --ignorefile "$ROOT/images/$image/Dockerfile.dockerignore" \
    -t "$(tag "$image")" "$ROOT" > /dev/null
  echo "build-images: $(tag "$image") built with buildah in $((SECONDS - start))s (inputs $inputs)"
done
# The previous build of each tag is now dangling: drop it so the storage does not grow run after run.
"${BUILDAH[@]}" rmi --prune > /dev/null 2>&1 || true
for image in $IMAGES; do
  "${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$(tag "$image")"
done
echo "build-images: done in $((SECONDS - total))s (buildah; storage $(du -sh "$STORAGE" 2>/dev/null | cut -f1) in $STORAGE)"
