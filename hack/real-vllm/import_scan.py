"""Static import scan of vLLM 0.26.0's `vllm serve` path with `--attention-backend TRITON_ATTN`: which
third-party modules it imports at module level. hack/real-sglang/import_scan.py's walk (module level,
also inside if/try/with/for/class bodies; not function bodies, not `if TYPE_CHECKING:`, every `if`
branch), with vLLM's roots; each import leaving vllm resolves to the pack (SITE), the GPU image
(image-packages.txt), the standard library, or MISSING (guarded: inside a `try`).

    python3 hack/real-vllm/import_scan.py SITE hack/real-sglang/image-packages.txt [ROOT_MODULE...]
Exit status 1 when an unguarded import is MISSING and not listed in not-on-cuda.txt (with the reason).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "real-sglang"))
import import_scan as scanner

# `vllm serve` (cli.main -> cli.serve -> the OpenAI server), its engine core process and worker (one GPU:
# the uniprocess executor), the dev routes the agent calls (pause, sleep, weight transfer, cache, rpc),
# the sleep allocator (cumem), the IPC weight transfer, the Llama model, the Triton attention backend and
# the modules vLLM imports inside functions while it starts (read in the wheel: engine_core, gpu_worker,
# gpu_model_runner, default_loader, v1/attention/backends/registry.py).
DEFAULT_ROOTS = [
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.serve.dev.sleep.api_router",
    "vllm.entrypoints.serve.dev.rlhf.api_router",
    "vllm.entrypoints.serve.dev.cache.api_router",
    "vllm.entrypoints.serve.dev.rpc.api_router",
    "vllm.entrypoints.serve.dev.server_info.api_router",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.registry",
    "vllm.v1.sample.sampler",
    "vllm.device_allocator.cumem",
    "vllm.distributed.weight_transfer.ipc_engine",
    "vllm.distributed.weight_transfer.factory",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.platforms.cuda",
    "vllm.tokenizers.hf",
]
scanner.FOLLOWED = {"vllm"}
scanner.DEFAULT_ROOTS = DEFAULT_ROOTS


def main() -> int:
    here = Path(__file__).resolve().parent
    scanner.__file__ = str(here / "import_scan.py")  # not-on-cuda.txt: this folder's
    return scanner.main()


if __name__ == "__main__":
    sys.exit(main())
