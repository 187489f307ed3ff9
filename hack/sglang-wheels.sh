#!/usr/bin/env bash
# SGLang's own code for the tests (tests/unit/test_sglang_reads_payloads.py): each recorded SGLang version's
# wheel, downloaded without its dependencies and unpacked once into ~/.cache/rljob/sglang/<version>/ (one
# venv cannot hold several versions: the tests import each one in a subprocess with that folder on
# sys.path); and, into the venv, what the modules those tests import need on CPU (torch comes from the
# `train` extra). SGLang's full install (sgl-kernel, flashinfer, CUDA builds) is not installed.
#
#   bash hack/sglang-wheels.sh [PYTHON]      # PYTHON: the venv's interpreter (default .venv/bin/python)
set -euo pipefail
PYTHON=${1:-.venv/bin/python}
CACHE=${RLJOB_SGLANG_CACHE:-$HOME/.cache/rljob/sglang}
# The versions docs/sglang-conformance.md records whose deserializer imports on CPU.
VERSIONS=(0.5.6 0.5.15.post1 0.5.20 0.5.21 0.5.23)
# Imported at module level by sglang.srt.utils (all five versions; fastapi by 0.5.6), found by importing
# sglang.srt.utils, .utils.patch_torch and .weight_sync.tensor_bucket with each package blocked in turn;
# then what sglang.srt.managers.io_struct (the request dataclasses) imports for 0.5.20 to 0.5.23.
NEEDS=(aiohttp fastapi ipython msgspec orjson pillow psutil pybase64 pydantic pyzmq requests starlette tqdm
  apache-tvm-ffi compressed-tensors dill gguf openai partial-json-parser sentencepiece torchvision transformers
  xgrammar)

"$PYTHON" -m pip install -q "${NEEDS[@]}"
mkdir -p "$CACHE"
for version in "${VERSIONS[@]}"; do
  dest="$CACHE/$version"
  [[ -f "$dest/sglang/srt/utils/__init__.py" || -f "$dest/sglang/srt/utils.py" ]] && continue
  tmp=$(mktemp -d)
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "sglang==$version"
  rm -rf "$dest.partial" && mkdir -p "$dest.partial"
  "$PYTHON" -m zipfile -e "$tmp"/sglang-*.whl "$dest.partial"
  mv "$dest.partial" "$dest"  # a complete tree or none: an interrupted unpack is redone
  rm -rf "$tmp"
  echo "sglang $version -> $dest"
done
