#!/usr/bin/env bash
# Unpacks, on the GPU machine, the transfers that hack/real-vllm/pack.sh built (real vLLM 0.26.0 and what
# the GPU image lacks) into TARGET/site, one transfer per call: each call carries one of .vllm-pack/1,
# .vllm-pack/2, ... and runs this; the parts it finds are checked against parts.txt (sha256) and unpacked,
# the parts already unpacked by an earlier call on the same machine are skipped. Once every part of
# parts.txt is there it writes TARGET/manifest.txt and prints on stdout the one line that names the site
# (export RLJOB_VLLM_SITE=...: the vLLM tier puts it on vLLM's own PYTHONPATH, not on the tests'); before
# that it prints nothing on stdout and lists on stderr the parts still to come. Needs bash, tar, xz (else
# the image's python3 unpacks), sha256sum. Exit status 1 only when a part is corrupt or fails to unpack.
#
#   eval "$(bash hack/real-vllm/unpack.sh [PACK] [TARGET])"    # PACK: .vllm-pack, TARGET: /tmp/rv
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PACK=${1:-$ROOT/.vllm-pack}
TARGET=${2:-/tmp/rv}
PYTHON=${PYTHON:-python3}
SITE=$TARGET/site
DONE=$TARGET/parts-done

mapfile -t CARRIED < <(ls "$PACK"/*/parts.txt 2>/dev/null || true)
if ((${#CARRIED[@]})); then
  PARTS_FILE=${CARRIED[0]}
  # A pack other than the one TARGET holds parts of: start again.
  if [[ -f $TARGET/parts.txt ]] && ! cmp -s "$PARTS_FILE" "$TARGET/parts.txt"; then
    echo "unpack.sh: $TARGET holds parts of another pack; starting again" >&2
    rm -rf "$TARGET"
  fi
  mkdir -p "$SITE" "$DONE"
  cp "$PARTS_FILE" "$TARGET/parts.txt"
  for carried in "${CARRIED[@]}"; do
    dir=$(dirname "$carried")
    cp "$dir/manifest.txt" "$dir/image-requirements.txt" "$TARGET/"
    for part in "$dir"/*.tar.xz; do
      name=$(basename "$part")
      want=$(awk -v n="$name" '$1 == n {print $2}' "$TARGET/parts.txt")
      [[ -n $want ]] || { echo "unpack.sh: $name is not in parts.txt" >&2; exit 1; }
      [[ -f $DONE/$name.$want ]] && { echo "unpack.sh: $name already unpacked" >&2; continue; }
      have=$(sha256sum < "$part" | cut -c1-64)
      [[ $have == "$want" ]] || { echo "unpack.sh: $name is corrupt (sha256 $have, want $want)" >&2; exit 1; }
      start=$(date +%s%N)
      if command -v xz > /dev/null; then
        xz -dc "$part" | tar -xf - -C "$SITE"
      else
        "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2], filter="tar")' \
          "$part" "$SITE"
      fi
      touch "$DONE/$name.$want"
      echo "unpack.sh: $name into $SITE in $(( ($(date +%s%N) - start) / 1000000 )) ms" >&2
    done
  done
elif [[ ! -f $TARGET/parts.txt ]]; then
  echo "unpack.sh: no transfer of a vLLM pack in $PACK and none unpacked in $TARGET (hack/real-vllm/pack.sh)" >&2
  exit 0
fi

missing=$(while read -r name sha _; do [[ -f $DONE/$name.$sha ]] || echo "$name"; done < "$TARGET/parts.txt")
if [[ -n $missing ]]; then
  rm -f "$TARGET/complete"
  echo "unpack.sh: still to come (carry the other transfers): $(echo $missing)" >&2
  exit 0
fi
if [[ ! -f $TARGET/complete ]]; then
  echo "unpack.sh: every part unpacked: $(wc -l < "$TARGET/manifest.txt") packages, $(du -sm "$SITE" | cut -f1) MiB in $SITE" >&2
  # The image's packages that the pack relies on, against what the pack's packages require of them.
  if command -v "$PYTHON" > /dev/null; then
    env -u PYTHONPATH "$PYTHON" "$(dirname "$0")/../real-sglang/check_image.py" "$TARGET/image-requirements.txt" >&2 || true
  fi
  touch "$TARGET/complete"
fi
echo "export RLJOB_VLLM_SITE=$SITE"
