#!/usr/bin/env bash
# Checks the pack on this machine (no GPU needed): unpacks it with unpack.sh, then under CPython 3.12 with
# torch 2.11.0 and the image's packages (transformers 5.17.0 and tokenizers 0.23.2 among them, as on the
# GPU image, so the pack must win over them) imports SGLang's launch path with its CUDA branches taken,
# and prints the CUDA-graph plan of the launch flags; then scans the same path's module-level imports
# statically (import_scan.py). What only a GPU shows (kernels, capture, serving) is not checked.
#
#   bash hack/real-sglang/check-imports.sh [PACK]     # after pack.sh; PYTHON312=... names the interpreter
#
# The CPython 3.12 venv (torch 2.11.0 with its CUDA libraries, about 4.6 GB) is cached under
# ~/.cache/rljob/real-sglang/py312.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE=${RLJOB_REAL_SGLANG_CACHE:-$HOME/.cache/rljob/real-sglang}
PACK=${1:-$ROOT/.sglang-pack}
PYTHON312=${PYTHON312:-$(command -v python3.12 || ls "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1 || true)}
[[ -x $PYTHON312 ]] || { echo "check-imports.sh: no CPython 3.12 (set PYTHON312)" >&2; exit 1; }

# The image, as far as SGLang's path needs it: torch 2.11.0 and what image-requirements.txt names, at the
# versions of image-packages.txt's `pip list`, else at closure.txt's.
VENV=$CACHE/py312
IMAGE_VERSIONS=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 triton==3.6.0 numpy==2.5.2
  huggingface-hub==1.33.0 safetensors==0.8.0 sentencepiece==0.2.2 tiktoken==0.14.0 transformers==5.17.0
  tokenizers==0.23.2)
[[ -x $VENV/bin/python ]] || "$PYTHON312" -m venv "$VENV"
want=$CACHE/work/image-sim.txt
mkdir -p "$CACHE/work"
{
  printf '%s\n' "${IMAGE_VERSIONS[@]}"
  known=" $(printf '%s ' "${IMAGE_VERSIONS[@]}" | sed 's/==[^ ]*//g') "
  cut -f1 "$PACK/image-requirements.txt" | while read -r name; do
    [[ $known == *" $name "* ]] && continue
    grep -iE "^$name==" "$HERE/closure.txt" || true
  done
  echo packaging  # unpack.sh's check
} | sort -u > "$want.new"
if ! cmp -s "$want.new" "$want"; then
  "$VENV/bin/pip" install -q -r "$want.new"  # torch with its dependencies (CUDA libraries)
  "$VENV/bin/pip" install -q --no-deps --force-reinstall transformers==5.17.0 tokenizers==0.23.2
  mv "$want.new" "$want"
fi

# A libcuda.so.1 that only defines the driver symbols the pack's libraries link against (each returns an
# error): enough for sgl_kernel's sm90 library to load on a machine without the driver.
STUB=$CACHE/libcuda-stub
if [[ ! -f $STUB/libcuda.so.1 ]]; then
  mkdir -p "$STUB"
  symbols=$(find "$CACHE/unpacked" -name '*.so' -exec nm -D --undefined-only {} + 2>/dev/null \
    | awk '$2 ~ /^cu[A-Z]/ {print $2}' | sort -u)
  for symbol in $symbols cuInit; do echo "int $symbol(void) { return 999; }"; done > "$STUB/stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUB/libcuda.so.1" "$STUB/stub.c"
fi

TARGET=$(mktemp -d)
trap 'rm -rf "$TARGET"' EXIT
eval "$(PYTHON=$VENV/bin/python bash "$HERE/unpack.sh" "$PACK" "$TARGET")"
mapfile -t ROOTS < <(python3 -c "import sys; sys.path.insert(0, '$HERE'); import import_scan; print('\n'.join(import_scan.DEFAULT_ROOTS))")
echo "== importing ${#ROOTS[@]} modules of the launch path (CUDA branches taken)"
(cd "$TARGET" && LD_LIBRARY_PATH=$STUB PYTHONWARNINGS=ignore "$VENV/bin/python" "$HERE/probe_imports.py" \
  "$TARGET/site" "$HERE/image-packages.txt" "${ROOTS[@]}" 2>&1 | grep -vE 'warn|^\s*$')
echo "== static scan of the same modules' module-level imports"
python3 "$HERE/import_scan.py" "$TARGET/site" "$HERE/image-packages.txt"
