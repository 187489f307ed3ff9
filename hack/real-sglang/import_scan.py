"""Static import scan of SGLang's launch path: which third-party modules it imports at module level.

Reads source only (ast), so it runs on any Python. From the root modules it follows every import that runs
when a module is imported (module level, also inside if/try/with/for/class bodies; not function bodies,
not `if TYPE_CHECKING:`) through sglang and the packages in FOLLOWED. Each import that leaves them is
resolved to: under SITE (the pack), a package of the GPU image (image-packages.txt), the standard library,
or MISSING; a MISSING import inside a `try` is reported as guarded. The scan takes every `if` branch, so it
reports more than runs; probe_imports.py imports the same roots for real.

    python3 hack/real-sglang/import_scan.py SITE hack/real-sglang/image-packages.txt [ROOT_MODULE...]
Exit status 1 when an unguarded import is MISSING and not listed in not-on-cuda.txt (with the reason).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

# The launch path with the flags in docs/real-sglang.md: the server, its processes, the model, the
# triton attention backend, pytorch sampling, the memory saver and the modules SGLang imports lazily
# (inside functions) while it starts.
DEFAULT_ROOTS = [
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
    "sglang.srt.model_executor.runner.eager_runner",
    "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend",
    "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend",
    "sglang.srt.model_loader.loader",
    "sglang.srt.models.llama",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.attention_registry",
    "sglang.srt.layers.sampler",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.layers.attention.vision",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.utils.torch_memory_saver_adapter",
    "sglang.srt.managers.scheduler_components.weight_updater",
    "sglang.srt.utils.hf_transformers_utils",
    "sglang.srt.weight_sync.tensor_bucket",
    "sglang.srt.utils.patch_torch",
    "torch_memory_saver",
]


# Followed into: SGLang and the packages whose requirements the pack drops (flashinfer-python's
# cuda-tile, nvidia-cudnn-frontend, nvidia-cutlass-dsl); the rest keep their own requirements.
FOLLOWED = {"sglang", "sgl_kernel", "flashinfer", "torch_memory_saver"}


@dataclass(frozen=True)
class Use:
    module: str  # the imported module's full name
    where: str  # path:line of the import
    guarded: bool  # inside a try


def module_file(site: Path, name: str) -> Path | None:
    base = site.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_run_at_import(tree: ast.Module) -> list[tuple[ast.stmt, bool]]:
    """Import statements executed when the module is imported, each with whether a try guards it."""
    found: list[tuple[ast.stmt, bool]] = []

    def walk(body: list[ast.stmt], guarded: bool) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append((node, guarded))
            elif isinstance(node, ast.If):
                if not is_type_checking(node.test):
                    walk(node.body, guarded)
                walk(node.orelse, guarded)
            elif isinstance(node, ast.Try):
                walk(node.body, True)
                for handler in node.handlers:
                    walk(handler.body, guarded)
                walk(node.orelse, guarded)
                walk(node.finalbody, guarded)
            elif isinstance(node, ast.With | ast.For | ast.While | ast.ClassDef):
                walk(node.body, guarded)

    walk(tree.body, False)
    return found


def scan(site: Path, roots: list[str]) -> tuple[set[str], list[Use]]:
    """Modules visited in FOLLOWED, and the imports that leave it."""
    seen: set[str] = set()
    outside: list[Use] = []
    queue = list(roots)
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        queue.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parents run first
        path = module_file(site, name)
        if path is None:
            continue
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_bytes(), str(path))
        for node, guarded in imports_run_at_import(tree):
            where = f"{path.relative_to(site)}:{node.lineno}"
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    package = parts if is_package else parts[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join(package + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                top = target.split(".")[0]
                if top in FOLLOWED and module_file(site, target) is not None:
                    queue.append(target)
                elif top not in FOLLOWED:
                    outside.append(Use(target, where, guarded))
    return seen, outside


# Import names of image distributions whose import name is not the distribution's name with "_" for "-".
IMPORT_NAMES = {
    "absl-py": ["absl"],
    "attrs": ["attr", "attrs"],
    "cuda-bindings": ["cuda"],
    "cuda-core": ["cuda"],
    "cuda-pathfinder": ["cuda"],
    "cupy-cuda13x": ["cupy"],
    "grpcio": ["grpc"],
    "markdown-it-py": ["markdown_it"],
    "nvidia-ml-py": ["pynvml"],
    "opencv-python-headless": ["cv2"],
    "orbax-checkpoint": ["orbax"],
    "pillow": ["PIL"],
    "protobuf": ["google"],
    "py-cpuinfo": ["cpuinfo"],
    "python-dateutil": ["dateutil"],
    "pyyaml": ["yaml"],
    "scikit-image": ["skimage"],
    "scikit-learn": ["sklearn"],
    "setuptools": ["setuptools", "pkg_resources"],
    "pytest-benchmark": ["pytest_benchmark"],
}


def image_import_names(image_packages: Path) -> set[str]:
    names: set[str] = set()
    for line in image_packages.read_text().splitlines():
        dist = line.split("#", 1)[0].strip()
        if dist:
            names.update(IMPORT_NAMES.get(dist, [dist.replace("-", "_")]))
    names.add("nvidia")  # the nvidia-* CUDA libraries' namespace package
    return names


def top_level_present(site: Path, top: str) -> bool:
    return (site / top).is_dir() or any(site.glob(f"{top}.*"))


def main() -> int:
    site = Path(sys.argv[1])
    image_imports = image_import_names(Path(sys.argv[2]))
    roots = sys.argv[3:] or DEFAULT_ROOTS
    known_absent_file = Path(__file__).with_name("not-on-cuda.txt")
    known_absent = {
        line.split()[0]
        for line in known_absent_file.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    seen, outside = scan(site, roots)
    by_top: dict[str, list[Use]] = {}
    for use in outside:
        by_top.setdefault(use.module.split(".")[0], []).append(use)
    stdlib = set(sys.stdlib_module_names)
    failed = False
    print(f"{len(seen)} modules visited from {len(roots)} roots")
    for top in sorted(by_top):
        uses = by_top[top]
        if top in stdlib or top == "__future__":
            continue
        if top_level_present(site, top):
            status = "pack"
        elif top in image_imports:
            status = "image"
        elif all(use.guarded for use in uses):
            status = "MISSING (guarded)"
        elif top in known_absent:
            status = "MISSING (not on CUDA: not-on-cuda.txt)"
        else:
            status = "MISSING"
            failed = True
        first = uses[0]
        print(f"{top:28} {status:40} {first.where}{' try' if first.guarded else ''} (+{len(uses) - 1})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
