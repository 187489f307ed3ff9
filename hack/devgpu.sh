#!/usr/bin/env bash
# The GPU tier on a GPU machine with no package index (its image: Python 3.12 and torch 2.11.0), where the
# repository's working tree arrives with the files a run carries:
#   here:  bash hack/real-sglang/pack.sh            -> .sglang-pack/ (real SGLang 0.5.15.post1, what the image
#                                                     lacks; it fits one transfer: RLJOB_TRANSFER_MIB)
#   there: bash hack/devgpu.sh [TESTS...]           -> unpacks it into /tmp/rs (once: a later run on the same
#                                                     machine finds it there, the pack need not travel again),
#                                                     runs pytest on TESTS in the order given, a directory
#                                                     standing for its test files less those already named
# With no TESTS: the 8B figures (test_real_sglang_8b.py), then the rest of tests/gpu in file order.
# RLJOB_GPU_TIMEOUT (default 540 s): the tests' deadline; a test that would start in its last minute is
# skipped, and pytest is stopped 15 s after it, so that the figures and logs so far come back.
# Prints the card, the unpack, the tests' output; $OUT (default /tmp/devgpu-out) gets results.tgz (figures,
# every process's log), pytest.log and triton-cache.tgz (carry it back as .triton-cache.tgz: SGLang's CUDA-
# graph capture then skips compiling Triton's kernels, about a minute a model).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/devgpu-out}
RS=/tmp/rs
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
if [ -f .sglang-pack/manifest.txt ]; then
  pythonpath=$(bash hack/real-sglang/unpack.sh .sglang-pack "$RS") || exit 1
  eval "$pythonpath"
elif [ -f "$RS/manifest.txt" ]; then
  echo "devgpu.sh: no .sglang-pack here; using the one unpacked in $RS"
  export PYTHONPATH="$RS/site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "devgpu.sh: no .sglang-pack here and none unpacked in $RS: the real-SGLang tests will be skipped"
fi
if compgen -G ".whl/*.whl" > /dev/null; then  # carried wheels that override the pack's (e.g. a pinned fastapi)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/devgpu-over .whl/*.whl
  export PYTHONPATH="/tmp/devgpu-over:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/operator:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1 RLJOB_GPU_RESULTS_DIR=/tmp/devgpu-results
export RLJOB_GPU_TIMEOUT=${RLJOB_GPU_TIMEOUT:-540}
# Triton's compiled kernels from an earlier run on this kind of card, carried as .triton-cache.tgz; this
# run's go back in $OUT.
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton-cache.tgz ] && tar -xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR"
rm -rf /tmp/devgpu-results /tmp/devgpu-pt && mkdir -p /tmp/devgpu-results
python3 -c 'import sglang, fastapi, transformers, tokenizers, pydantic
print("sglang", sglang.__version__, "fastapi", fastapi.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__, "pydantic", pydantic.__version__)' || true

# The tests in the order asked: pytest orders a directory's files itself, and a file named before its
# directory would run in the directory's order, so directories become their test files here.
asked=("$@")
((${#asked[@]})) || asked=(tests/gpu/test_real_sglang_8b.py tests/gpu)
tests=()
declare -A named=()
for arg in "${asked[@]}"; do
  if [ -d "$arg" ]; then
    for f in "${arg%/}"/test_*.py; do
      [ -n "${named[$f]:-}" ] && continue
      named[$f]=1
      tests+=("$f")
    done
  else
    named[$arg]=1
    tests+=("$arg")
  fi
done
echo "devgpu.sh: ${tests[*]} (deadline ${RLJOB_GPU_TIMEOUT} s)"
started=$SECONDS
timeout --kill-after 10 "$((RLJOB_GPU_TIMEOUT + 15))" python3 -m pytest -q -s -rA -p no:cacheprovider \
  --basetemp=/tmp/devgpu-pt "${tests[@]}" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
echo "== pytest exit $rc after $((SECONDS - started)) s"
# Figures and every process log the tests left (SGLang's, the agents', the trainers').
find /tmp/devgpu-pt -name '*.log' -size -20M -exec cp --parents {} /tmp/devgpu-results/ \; 2>/dev/null
tar -czf "$OUT/results.tgz" -C /tmp/devgpu-results .
tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . && du -sh "$OUT/triton-cache.tgz"
ls -la /tmp/devgpu-results | head -40
exit "$rc"
