#!/usr/bin/env bash
# Builds, from PyPI, the files that carry real SGLang 0.5.15.post1 to a GPU machine without a package
# index whose image already has torch 2.11.0+cu130 on CPython 3.12 (image-packages.txt): the dependency
# closure (closure.txt, resolved by uv from requirements.in with overrides.txt), less the image's own
# packages (image-packages.txt), with the paths in trim.txt left out, packed with xz -9e into OUT.
# hack/real-sglang/unpack.sh unpacks it there. docs/real-sglang.md says what is in it and why.
#
#   bash hack/real-sglang/pack.sh [--relock] [OUT]    # OUT: default .sglang-pack (gitignored)
#
# RLJOB_TRANSFER_MIB (default 64): what one transfer to the GPU machine carries; the pack must fit in it
# beside the repository's tracked files, or pack.sh fails.
#
# --relock resolves closure.txt again from today's PyPI. Downloads, unpacked wheels and the tools venv are
# cached under ~/.cache/rljob/real-sglang (RLJOB_REAL_SGLANG_CACHE); a part is packed again only when
# what goes into it changed, so a second run takes seconds.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE=${RLJOB_REAL_SGLANG_CACHE:-$HOME/.cache/rljob/real-sglang}
RELOCK=0
[[ ${1:-} == --relock ]] && { RELOCK=1; shift; }
OUT=${1:-$ROOT/.sglang-pack}
TRANSFER_MIB=${RLJOB_TRANSFER_MIB:-64}
REPO_BYTES=$(git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 du -cb 2>/dev/null) | awk '$2 == "total" {s += $1} END {print s + 0}')
LIMIT_MIB=$(( TRANSFER_MIB - (REPO_BYTES >> 20) - 1 ))  # the pack beside the repository, 1 MiB spare

source "$HERE/wheels.sh"  # the steps both packs take alike: 1 to 3
pack_tools
pack_wheels

# 4. Four parts, so that the machine there unpacks them side by side; each is packed again only when
#    its list of unpacked folders changed.
part_of() {
  case $1 in
    sglang) echo sglang ;;
    sglang_kernel | torch_memory_saver | flashinfer_python | apache_tvm_ffi) echo kernels ;;
    transformers | tokenizers) echo transformers ;;
    *) echo deps ;;
  esac
}
mkdir -p "$OUT"
PARTS=(sglang kernels transformers deps)
pids=()
for part in "${PARTS[@]}"; do
  dirs=()
  for project in $(printf '%s\n' "${!DIR_OF[@]}" | sort); do
    [[ $(part_of "$project") == "$part" ]] && dirs+=("${DIR_OF[$project]}")
  done
  printf '%s\n' "${dirs[@]}" | xargs -n1 basename > "$WORK/$part.members"
  if [[ -f $OUT/$part.tar.xz && -f $OUT/.$part.members ]] && cmp -s "$WORK/$part.members" "$OUT/.$part.members"; then
    continue
  fi
  (
    args=()
    for dir in "${dirs[@]}"; do args+=(-C "$dir" .); done
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - "${args[@]}" \
      | xz -9e -T1 > "$OUT/$part.tar.xz.partial"
    mv "$OUT/$part.tar.xz.partial" "$OUT/$part.tar.xz"
    cp "$WORK/$part.members" "$OUT/.$part.members"
  ) &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

# 5. The manifest, what the pack asks of the image, and the size.
cp "$WORK/pack.txt" "$OUT/manifest.txt"
"${PLAN[@]}" image-requirements "$WORK/pack.txt" "$CACHE/wheels" "$HERE/image-packages.txt" > "$OUT/image-requirements.txt"
for stale in "$OUT"/*; do
  case $(basename "$stale") in
    sglang.tar.xz | kernels.tar.xz | transformers.tar.xz | deps.tar.xz | manifest.txt | image-requirements.txt) ;;
    *) rm -rf "$stale" ;;
  esac
done
echo "packages ($(wc -l < "$OUT/manifest.txt")):"
tr '\n' ' ' < "$OUT/manifest.txt" | fold -s -w 110
echo
unpacked=$(for part in "${PARTS[@]}"; do while read -r d; do echo "$CACHE/unpacked/$d"; done < "$WORK/$part.members"; done | xargs du -scb | tail -1 | cut -f1)
ls -l "$OUT" | awk 'NR > 1 {printf "  %-24s %6.1f MiB\n", $9, $5 / 1048576}'
total=$(du -cb "$OUT"/* | tail -1 | cut -f1)
awk -v out="$OUT" -v t="$total" -v u="$unpacked" -v l="$LIMIT_MIB" \
  'BEGIN {printf "pack: %s, %.1f MiB in all (limit %d MiB), %.0f MiB unpacked\n", out, t / 1048576, l, u / 1048576}'
(( total < LIMIT_MIB * 1048576 )) || { echo "pack.sh: the pack is over $LIMIT_MIB MiB" >&2; exit 1; }
