#!/usr/bin/env bash
# Builds, from PyPI, the files that carry real vLLM 0.26.0 to a GPU machine without a package index whose
# image already has torch 2.11.0+cu130 on CPython 3.12 (hack/real-sglang/image-packages.txt): the dependency
# closure (closure.txt, resolved by uv from requirements.in with overrides.txt), less the image's own
# packages, with the paths in trim.txt left out (what `--attention-backend TRITON_ATTN` never loads), packed
# with xz -9e into parts, and the parts grouped into transfers: OUT/1, OUT/2, ... each of which fits one
# call's transfer beside the repository's tracked files. hack/real-vllm/unpack.sh unpacks them there, one
# transfer per call. docs/real-vllm.md says what is in it and why.
#
#   bash hack/real-vllm/pack.sh [--relock] [OUT]    # OUT: default .vllm-pack (gitignored)
#
# RLJOB_TRANSFER_MIB (default 64): what one transfer to the GPU machine carries; a part that does not fit
# one transfer beside the repository's files fails the run, naming it.
#
# --relock resolves closure.txt again from today's PyPI. Downloads, unpacked wheels and packed parts are
# cached under ~/.cache/rljob/real-vllm (RLJOB_REAL_VLLM_CACHE); a second run takes seconds.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE=${RLJOB_REAL_VLLM_CACHE:-$HOME/.cache/rljob/real-vllm}
RELOCK=0
[[ ${1:-} == --relock ]] && { RELOCK=1; shift; }
OUT=${1:-$ROOT/.vllm-pack}
TRANSFER_MIB=${RLJOB_TRANSFER_MIB:-64}
REPO_BYTES=$(git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 du -cb 2>/dev/null) | awk '$2 == "total" {s += $1} END {print s + 0}')
LIMIT=$(( (TRANSFER_MIB << 20) - REPO_BYTES - (2 << 20) ))  # a transfer's part beside the repository, 2 MiB spare

source "$ROOT/hack/real-sglang/wheels.sh"  # the steps both packs take alike: 1 to 3
pack_tools
pack_wheels
mkdir -p "$CACHE/parts"

# 4. The parts: vLLM's kernel library alone (the largest thing that must travel whole), the rest of vLLM,
#    Ray, and the other packages. A part is packed again only when what goes into it changed.
KERNEL=vllm/_C_stable_libtorch.abi3.so
part_of() {
  case $1 in
    vllm) echo vllm ;;
    ray) echo ray ;;
    *) echo deps ;;
  esac
}
PARTS=(vllm-kernel vllm ray deps)
pids=()
for part in "${PARTS[@]}"; do
  dirs=()
  if [[ $part == vllm-kernel ]]; then
    dirs=("${DIR_OF[vllm]}")
  else
    for project in $(printf '%s\n' "${!DIR_OF[@]}" | sort); do
      [[ $(part_of "$project") == "$part" ]] && dirs+=("${DIR_OF[$project]}")
    done
  fi
  printf '%s\n' "${dirs[@]}" | xargs -n1 basename > "$WORK/$part.members"
  key=$( (echo "$part"; cat "$WORK/$part.members") | sha256sum | cut -c1-12)
  packed=$CACHE/parts/$part-$key.tar.xz
  echo "$packed" > "$WORK/$part.file"
  [[ -f $packed ]] && continue
  (
    args=()
    if [[ $part == vllm-kernel ]]; then
      args=(-C "${dirs[0]}" "$KERNEL")
    elif [[ $part == vllm ]]; then
      args=(--exclude "./$KERNEL" -C "${dirs[0]}" .)
    else
      for dir in "${dirs[@]}"; do args+=(-C "$dir" .); done
    fi
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - "${args[@]}" \
      | xz -9e -T1 > "$packed.partial"
    mv "$packed.partial" "$packed"
  ) &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

# 5. The transfers: each part into the first transfer it fits beside the repository (largest first);
#    each transfer holds the manifest, what the pack asks of the image, and parts.txt (every part of
#    the pack with its sha256, so that unpack.sh knows when it has them all).
rm -rf "$OUT"
mkdir -p "$OUT"
"${PLAN[@]}" image-requirements "$WORK/pack.txt" "$CACHE/wheels" "$TOOLS_DIR/image-packages.txt" > "$WORK/image-requirements.txt"
: > "$WORK/parts.txt"
for part in "${PARTS[@]}"; do
  file=$(cat "$WORK/$part.file")
  echo "$part.tar.xz $(sha256sum < "$file" | cut -c1-64) $(stat -c %s "$file")" >> "$WORK/parts.txt"
done
extra=$(( $(stat -c %s "$WORK/pack.txt") + $(stat -c %s "$WORK/image-requirements.txt") + $(stat -c %s "$WORK/parts.txt") ))
declare -a FILL=()
while read -r name _ size; do
  part=${name%.tar.xz}
  if (( size + extra > LIMIT )); then
    printf 'pack.sh: part %s is %.1f MiB: over the %.1f MiB one transfer of %d MiB carries beside the repository (%.1f MiB)\n' \
      "$name" "$(echo "$size / 1048576" | bc -l)" "$(echo "($LIMIT - $extra) / 1048576" | bc -l)" \
      "$TRANSFER_MIB" "$(echo "$REPO_BYTES / 1048576" | bc -l)" >&2
    exit 1
  fi
  placed=
  for i in "${!FILL[@]}"; do
    if (( FILL[i] + size + extra <= LIMIT )); then placed=$i; break; fi
  done
  if [[ -z $placed ]]; then placed=${#FILL[@]}; FILL+=(0); fi
  FILL[placed]=$(( FILL[placed] + size ))
  dir=$OUT/$((placed + 1))
  mkdir -p "$dir"
  ln "$(cat "$WORK/$part.file")" "$dir/$name" 2>/dev/null || cp "$(cat "$WORK/$part.file")" "$dir/$name"
done < <(sort -k3,3nr "$WORK/parts.txt")
for dir in "$OUT"/*/; do
  cp "$WORK/pack.txt" "$dir/manifest.txt"
  cp "$WORK/image-requirements.txt" "$WORK/parts.txt" "$dir/"
done

echo "packages ($(wc -l < "$WORK/pack.txt")):"
tr '\n' ' ' < "$WORK/pack.txt" | fold -s -w 110
echo
unpacked=$(for part in vllm ray deps; do while read -r d; do echo "$CACHE/unpacked/$d"; done < "$WORK/$part.members"; done | xargs du -scb | tail -1 | cut -f1)
for dir in "$OUT"/*/; do
  awk -v d="$(basename "$dir")" -v t="$(du -cb "$dir"/* | tail -1 | cut -f1)" -v l="$LIMIT" \
    'BEGIN {printf "transfer %s: %.1f MiB (limit %.1f MiB beside the repository)\n", d, t / 1048576, l / 1048576}'
  ls -l "$dir" | awk 'NR > 1 {printf "  %-24s %6.1f MiB\n", $9, $5 / 1048576}'
done
awk -v out="$OUT" -v t="$(du -cb "$OUT"/*/*.tar.xz | tail -1 | cut -f1)" -v u="$unpacked" -v n="$(ls -d "$OUT"/*/ | wc -l)" \
  'BEGIN {printf "pack: %s, %.1f MiB in %d transfers, %.0f MiB unpacked\n", out, t / 1048576, n, u / 1048576}'
