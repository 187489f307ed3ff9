#!/usr/bin/env bash
# Unpacks the pack that hack/real-sglang/pack.sh built (real SGLang 0.5.15.post1 and what the GPU image
# lacks) into TARGET/site on the GPU machine, and prints on stdout the one line that puts it first on
# Python's path (so its transformers 5.12.1 and tokenizers 0.22.2 win over the image's); the rest goes to
# stderr. Needs bash, tar and xz (else the image's python3 unpacks). A second run with the same pack does
# nothing. Then it checks the image's own packages against what the pack's packages require.
#
#   eval "$(bash hack/real-sglang/unpack.sh [PACK] [TARGET])"    # PACK: .sglang-pack, TARGET: /tmp/rs
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PACK=${1:-$ROOT/.sglang-pack}
TARGET=${2:-/tmp/rs}
PYTHON=${PYTHON:-python3}  # the image's interpreter, for the check (and the unpack where xz is missing)
SITE=$TARGET/site

[[ -f $PACK/manifest.txt ]] || { echo "unpack.sh: no pack in $PACK (run hack/real-sglang/pack.sh)" >&2; exit 1; }
if cmp -s "$PACK/manifest.txt" "$TARGET/manifest.txt"; then
  echo "unpack.sh: $SITE already holds this pack" >&2
else
  start=$(date +%s%N)
  rm -rf "$TARGET"
  mkdir -p "$SITE"
  pids=()
  for part in "$PACK"/*.tar.xz; do
    if command -v xz > /dev/null; then
      (xz -dc "$part" | tar -xf - -C "$SITE") &
    else
      "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2], filter="tar")' \
        "$part" "$SITE" &
    fi
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: a part that fails to unpack fails the run
  cp "$PACK/image-requirements.txt" "$TARGET/"
  cp "$PACK/manifest.txt" "$TARGET/"  # last: its presence says the unpack is complete
  elapsed=$(( ($(date +%s%N) - start) / 1000000 ))
  echo "unpack.sh: $(wc -l < "$TARGET/manifest.txt") packages, $(du -sm "$SITE" | cut -f1) MiB into $SITE in ${elapsed} ms" >&2
fi

# The image's packages that the pack relies on, against what the pack's packages require of them.
if command -v "$PYTHON" > /dev/null; then
  env -u PYTHONPATH "$PYTHON" "$(dirname "$0")/check_image.py" "$TARGET/image-requirements.txt" >&2 || true
fi
echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
