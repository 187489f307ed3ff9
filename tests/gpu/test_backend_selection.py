"""How the emulator picks its memory backend, and the weights sink: no GPU needed (not marked `gpu`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rljob.emulator import memory, weights
from rljob.emulator.config import parse_config
from rljob.emulator.memory import AccountingBackend, make_backend


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    yield
    weights.set_weights_sink(None)


def test_default_is_accounting() -> None:
    cfg = parse_config([])
    assert cfg.memory_backend == "accounting"
    b = AccountingBackend(gpus=1, total=10, baseline=1, sizes={"weights": 2})
    assert type(b) is AccountingBackend and b.used_bytes(0) == 3
    assert type(make_backend(cfg)) is AccountingBackend


def test_cuda_flag_selects_the_gpu_backend_without_importing_torch_at_parse() -> None:
    cfg = parse_config(["--memory-backend=cuda", "--enable-memory-saver", "--memory-saver-hook-mode=torch"])
    assert cfg.memory_backend == "cuda"
    assert memory.cuda_options(cfg) == dict(memory_saver=True, graph_in_saver=False, hook_mode="torch")
    with pytest.raises(SystemExit):
        parse_config(["--memory-backend", "tpu"])


def test_cuda_backend_without_torch_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # an image without torch: `import torch` fails
    cfg = parse_config(["--memory-backend", "cuda", "--memory-saver-hook-mode", "torch"])
    with pytest.raises(ModuleNotFoundError, match="torch"):
        make_backend(cfg)


def test_weights_sink_hashes_what_it_returns(tmp_path: Path) -> None:
    from agent_procs import sha256_file, write_weights

    path = write_weights(tmp_path, "3")
    assert weights.read_safetensors(str(path))[0] == sha256_file(path)
    seen: list[int] = []

    def sink(blobs: list[bytes]) -> list[Any]:
        seen.extend(len(b) for b in blobs)
        return [b[:-1] + b"\0" for b in blobs]  # a device that corrupts the last byte

    weights.set_weights_sink(sink)
    checksum, tensors = weights.read_safetensors(str(path))
    assert seen == [path.stat().st_size] and tensors == 4
    assert checksum != sha256_file(path)
