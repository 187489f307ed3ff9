#!/usr/bin/env bash
# What tests/gpu/test_operator_loop.py needs on a GPU machine with no package index, besides real SGLang's
# pack (hack/real-sglang/pack.sh): the control-plane binaries and helm, xz-compressed, and the wheels the
# operator and `kubectl rljob` import that neither the machine's image nor the SGLang pack has
# (hack/devloop-wheels.txt). What one call can carry there is limited, the repository's own files included,
# so they are packed in parts of at most RLJOB_TRANSFER_MIB (64 by default) with that tree, one call each:
#
#   here:  bash hack/devloop.sh pack     -> .devloop/a, .devloop/b, ... (each with its `versions`); prints
#                                           each part's size and the calls that carry them
#   there: bash hack/devloop.sh setup    -> a carried part's binaries where ensure_binaries looks
#                                           (~/.cache/rljob/bin) and its wheels in /tmp/rljob-site; prints
#                                           which binaries are there. Run it in each call.
#
# Then put /tmp/rljob-site on PYTHONPATH beside the SGLang pack: tests/gpu/README.md has the calls.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${RLJOB_BIN_CACHE:-$HOME/.cache/rljob/bin}
OUT=.devloop
SITE=${RLJOB_LOOP_SITE:-/tmp/rljob-site}
TRANSFER_MIB=${RLJOB_TRANSFER_MIB:-64}
MARGIN_MIB=2  # what may be added to the tree between packing and the calls
NAMES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm)

pinned() {  # a version operator/rljob/testing/cluster.py pins: NAME = "vX.Y.Z"
  sed -n "s/^$1 = \"\(.*\)\"$/\1/p" operator/rljob/testing/cluster.py
}

version_of() {  # the pinned version of a binary
  case $1 in
    etcd) pinned ETCD_VERSION ;;
    helm) pinned HELM_VERSION ;;
    *) pinned K8S_VERSION ;;
  esac
}

mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }

tree_bytes() {  # what travels with every call: tracked files and untracked ones git does not ignore
  git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1
}

wheels_check() {  # every requirement of the wheels is a wheel, in the SGLang pack or in the image
  python3 - "$1" hack/real-sglang/closure.txt hack/real-sglang/image-packages.txt <<'EOF'
import re, sys, zipfile
from pathlib import Path
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
have = {norm(w.name.split("-")[0]) for w in wheels}
for listing in sys.argv[2:]:
    have |= {norm(re.split(r"[=<>~ ;\[]", line.strip())[0]) for line in open(listing)
             if line.strip() and not line.lstrip().startswith("#")}
missing = set()
for w in wheels:
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith(".dist-info/METADATA"))
    for line in zipfile.ZipFile(w).read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            name = norm(re.split(r"[=<>~!( ;\[]", line.split(":", 1)[1].strip())[0])
            if name not in have:
                missing.add(f"{name} (for {w.name})")
if missing:
    sys.exit("devloop.sh: not in the wheels, the SGLang pack nor the image: " + ", ".join(sorted(missing)))
print(f"devloop.sh: {len(wheels)} wheels, every requirement met by them, the SGLang pack or the image")
EOF
}

pack() {
  local cache=$OUT/.cache name ver file size budget part=a used=0 tree
  mkdir -p "$cache/wheels"
  grep -v '^#' hack/devloop-wheels.txt | grep . > "$cache/wheels.txt"
  if ! cmp -s "$cache/wheels.txt" "$cache/wheels.done" 2>/dev/null; then
    rm -f "$cache"/wheels/*.whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$cache/wheels" -r "$cache/wheels.txt"
    cp "$cache/wheels.txt" "$cache/wheels.done"
  fi
  wheels_check "$cache/wheels"
  for name in "${NAMES[@]}"; do
    ver=$(version_of "$name")
    [ -x "$BIN/$name-$ver/$name" ] || { echo "devloop.sh: $BIN/$name-$ver/$name missing (hack/build-binaries.sh)" >&2; exit 1; }
    [ -s "$cache/$name-$ver.xz" ] || xz -6 -T0 -c "$BIN/$name-$ver/$name" > "$cache/$name-$ver.xz"
  done
  tree=$(tree_bytes)
  budget=$(( (TRANSFER_MIB - MARGIN_MIB) * 1048576 - tree ))
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name .cache -exec rm -rf {} +
  mkdir -p "$OUT/a"
  # The wheels first, then the binaries in a fixed order; a part is closed when the next would not fit.
  for file in "$cache"/wheels/*.whl; do cp "$file" "$OUT/a/"; used=$((used + $(stat -c %s "$file"))); done
  for name in "${NAMES[@]}"; do
    ver=$(version_of "$name")
    size=$(stat -c %s "$cache/$name-$ver.xz")
    (( size <= budget )) || { echo "devloop.sh: $name alone is over a call's $TRANSFER_MIB MiB" >&2; exit 1; }
    if (( used + size > budget )); then
      part=$(echo "$part" | tr 'a-y' 'b-z'); used=0; mkdir -p "$OUT/$part"
    fi
    cp "$cache/$name-$ver.xz" "$OUT/$part/$name.xz"
    used=$((used + size))
  done
  for dir in "$OUT"/[a-z]; do
    for name in "${NAMES[@]}"; do echo "$name $(version_of "$name")"; done > "$dir/versions"
  done
  echo "the tree travels with every call: $(mib "$tree") MiB; a call carries at most $TRANSFER_MIB MiB"
  for dir in "$OUT"/[a-z]; do
    size=$(du -cb "$dir" | tail -1 | cut -f1)
    echo "  call: carry $dir ($(mib "$size") MiB, with the tree $(mib $((size + tree))) MiB):" \
      "$(cd "$dir" && ls | grep -v '^versions$' | sed 's/\.xz$//; s/-[0-9].*\.whl$//' | tr '\n' ' ')"
  done
}

unxz_to() {  # xz, or the image's python3 where xz is missing
  if command -v xz > /dev/null; then
    xz -dc "$1" > "$2"
  else
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"
  fi
}

setup() {
  local dir file name ver
  for dir in "$OUT"/[a-z]; do
    [ -d "$dir" ] || continue
    if compgen -G "$dir/*.whl" > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$dir"/*.whl
      echo "devloop.sh: $(ls "$dir"/*.whl | wc -l) wheels in $SITE"
    fi
    for file in "$dir"/*.xz; do
      [ -e "$file" ] || continue
      name=$(basename "$file" .xz)
      ver=$(awk -v n="$name" '$1==n{print $2}' "$dir/versions")
      [ -x "$BIN/$name-$ver/$name" ] && continue
      mkdir -p "$BIN/$name-$ver"
      unxz_to "$file" "$BIN/$name-$ver/$name.partial"
      chmod +x "$BIN/$name-$ver/$name.partial"
      mv "$BIN/$name-$ver/$name.partial" "$BIN/$name-$ver/$name"
    done
  done
  local there=() missing=()
  for name in "${NAMES[@]}"; do
    ver=$(version_of "$name")
    if [ -x "$BIN/$name-$ver/$name" ]; then there+=("$name"); else missing+=("$name"); fi
  done
  echo "devloop.sh: in $BIN: ${there[*]:-none}${missing:+; still to come: ${missing[*]}}"
  [ -d "$SITE/kopf" ] || echo "devloop.sh: no wheels in $SITE yet"
}

case "${1:-}" in
  pack) pack ;;
  setup) setup ;;
  *) echo "usage: $0 pack|setup" >&2; exit 2 ;;
esac
