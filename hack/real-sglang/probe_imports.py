"""Imports SGLang's launch path from the unpacked pack on a machine without a GPU, with torch told that an
H100 is there, so SGLang takes its CUDA branches (sgl_kernel loads its sm90 library against a stub
libcuda). Then parses the launch flags with SGLang's own parser and prints the CUDA-graph plan they give,
with and without --disable-prefill-cuda-graph. Run by check-imports.sh under CPython 3.12.

    probe_imports.py SITE IMAGE_PACKAGES ROOT_MODULE...
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import types
from pathlib import Path

import torch

H100 = types.SimpleNamespace(
    major=9,
    minor=0,
    name="NVIDIA H100 80GB HBM3",
    total_memory=80 * 2**30,
    multi_processor_count=132,
    L2_cache_size=50 * 2**20,
    gcnArchName="",
    uuid="0",
    warp_size=32,
    max_threads_per_multi_processor=2048,
    regs_per_multiprocessor=65536,
    shared_memory_per_block_optin=232448,
    shared_memory_per_multiprocessor=233472,
)
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.get_device_name = lambda device=None: H100.name
torch.cuda.get_device_properties = lambda device=None: H100

# docs/real-sglang.md's launch flags.
LAUNCH_FLAGS = [
    "--model-path",
    "/nonexistent/model",
    "--host",
    "127.0.0.1",
    "--port",
    "30000",
    "--enable-memory-saver",
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--mem-fraction-static",
    "0.5",
    "--cuda-graph-max-bs-decode",
    "8",
    "--dtype",
    "bfloat16",
]


def cuda_graph_plan(extra: list[str]) -> str:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    namespace = parser.parse_args(LAUNCH_FLAGS + extra)
    post_init = ServerArgs.__post_init__
    ServerArgs.__post_init__ = lambda self: None  # the rest of it sizes memory on a real GPU
    try:
        args = ServerArgs.from_cli_args(namespace)
    finally:
        ServerArgs.__post_init__ = post_init
    args._parse_cuda_graph_config()
    config = args.cuda_graph_config
    return f"decode={config.decode.backend} max_bs={config.decode.max_bs}, prefill={config.prefill.backend}"


def main() -> int:
    site, image_packages, roots = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    for name in roots:
        importlib.import_module(name)
        print(f"imported {name}", flush=True)
    for dist in ("transformers", "tokenizers", "sglang", "sglang-kernel", "torch"):
        print(f"{dist} {importlib.metadata.version(dist)}")
    transformers = sys.modules["transformers"]
    assert Path(transformers.__file__).is_relative_to(site), transformers.__file__
    assert transformers.__version__ == "5.12.1", transformers.__version__

    # Which distributions the imports touched: from the pack, or from the image (image-packages.txt).
    owners = importlib.metadata.packages_distributions()
    image = {
        line.split("#")[0].strip().lower()
        for line in image_packages.read_text().splitlines()
        if line.split("#")[0].strip()
    }
    from_pack, from_image, elsewhere = set(), set(), set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or module.__name__ in sys.stdlib_module_names or "." in module.__name__:
            continue
        dists = {d.lower().replace("_", "-") for d in owners.get(module.__name__, [])}
        if Path(path).is_relative_to(site):
            from_pack |= dists or {module.__name__}
        elif dists & image:
            from_image |= dists & image
        elif "site-packages" in path:
            elsewhere |= dists or {module.__name__}
    print(f"from the pack ({len(from_pack)}): {' '.join(sorted(from_pack))}")
    print(f"from the image ({len(from_image)}): {' '.join(sorted(from_image))}")
    if elsewhere:
        print(f"NOT in the pack nor the image list: {' '.join(sorted(elsewhere))}")
        return 1

    print("launch flags:", cuda_graph_plan([]))
    print("launch flags + --disable-prefill-cuda-graph:", cuda_graph_plan(["--disable-prefill-cuda-graph"]))
    print(
        "launch flags + --cuda-graph-backend-prefill disabled:",
        cuda_graph_plan(["--cuda-graph-backend-prefill", "disabled"]),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
