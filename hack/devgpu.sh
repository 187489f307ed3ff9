#!/usr/bin/env bash
# The GPU tier on a lent device machine (Python 3.12 + torch 2.11.0 in its image, no package index; at most
# 64 MiB travels a call):
#   here:  bash hack/real-sglang/pack.sh            -> .sglang-pack/ (real SGLang 0.5.15.post1, what the image lacks)
#   there: bash hack/devgpu.sh [PYTEST ARGS...]     -> unpacks it into /tmp/rs, runs pytest on tests/gpu (or
#                                                     the given tests) with the results in $OUT
# Prints the card, the unpack, the tests' output; $OUT gets results.tgz (figures, logs) and pytest.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/devgpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
pythonpath=$(bash hack/real-sglang/unpack.sh .sglang-pack /tmp/rs) || exit 1
eval "$pythonpath"
if compgen -G ".whl/*.whl" > /dev/null; then  # carried wheels that override the pack's (e.g. a pinned fastapi)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/devgpu-over .whl/*.whl
  export PYTHONPATH="/tmp/devgpu-over:$PYTHONPATH"
fi
export PYTHONPATH="$PWD/operator:$PYTHONPATH"
export PYTHONUNBUFFERED=1 RLJOB_GPU_RESULTS_DIR=/tmp/devgpu-results
# Triton's compiled kernels (SGLang's first CUDA-graph capture compiles them: about a minute) from an
# earlier run on this kind of card, carried as .triton-cache.tgz; this run's goes back in $OUT.
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton-cache.tgz ] && tar -xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR"
rm -rf /tmp/devgpu-results /tmp/devgpu-pt && mkdir -p /tmp/devgpu-results
python3 -c 'import sglang, fastapi, transformers, tokenizers, pydantic
print("sglang", sglang.__version__, "fastapi", fastapi.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__, "pydantic", pydantic.__version__)'
args=("$@")
((${#args[@]})) || args=(tests/gpu)
started=$SECONDS
# RLJOB_GPU_TIMEOUT: the tests stop here, so the figures and logs so far still go back in $OUT.
timeout "${RLJOB_GPU_TIMEOUT:-540}" python3 -m pytest -q -s -rA -p no:cacheprovider --basetemp=/tmp/devgpu-pt \
  "${args[@]}" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
echo "== pytest exit $rc after $((SECONDS - started)) s"
# Figures and every process log the tests left (SGLang's, the agents', the trainers').
find /tmp/devgpu-pt -name '*.log' -size -20M -exec cp --parents {} /tmp/devgpu-results/ \; 2>/dev/null
tar -czf "$OUT/results.tgz" -C /tmp/devgpu-results .
tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . && du -sh "$OUT/triton-cache.tgz"
ls -la /tmp/devgpu-results | head -40
exit "$rc"
