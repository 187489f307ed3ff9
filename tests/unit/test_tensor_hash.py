"""rljob.trainer.engines.sglang.tensor_hash against SGLang's own kernels: the per-parameter hash of
`/weights_checker` (C-CHECKER-CHECKSUM), `gpu_tensor_hash`'s Triton kernels run by Triton's interpreter on the
CPU (tests/unit/sglang_hash_reader.py), for every recorded version whose wheel has them; and the numpy and
torch implementations against each other, chunked and not. On a GPU, tests/gpu/test_real_sglang_verify.py runs
the compiled kernel."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rljob.trainer.engines.sglang import tensor_hash as th

CACHE = Path(os.environ.get("RLJOB_SGLANG_CACHE", Path.home() / ".cache/rljob/sglang"))
READER = Path(__file__).with_name("sglang_hash_reader.py")
KERNELS = {  # where each recorded version with the checksum action keeps gpu_tensor_hash
    "0.5.15.post1": "sglang/srt/layers/multimodal.py",
    "0.5.20": "sglang/kernels/ops/memory/gpu_tensor_hash.py",
    "0.5.21": "sglang/kernels/ops/memory/gpu_tensor_hash.py",
    "0.5.23": "sglang/kernels/ops/memory/gpu_tensor_hash.py",
}
TILE_BYTES = th.TILE_WORDS * 4
# Lengths around what the kernel treats apart: empty, not a whole word, one tile, past a tile, several tiles.
LENGTHS = (0, 1, 3, 4, 5, 7, TILE_BYTES - 4, TILE_BYTES, TILE_BYTES + 2, 3 * TILE_BYTES + 5, 70_001)


def _inputs() -> list[bytes]:
    rng = np.random.default_rng(7)
    out = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in LENGTHS]
    out.append(bytes(TILE_BYTES + 8))  # zeros: every word's contribution comes from its position alone
    out.append(b"\xff" * (2 * TILE_BYTES))  # all ones: the wrap of every product and sum
    return out


@pytest.fixture(scope="module")
def torch_mod():  # type: ignore[no-untyped-def]
    return pytest.importorskip("torch")


@pytest.mark.parametrize("version", sorted(KERNELS))
def test_the_hash_is_sglangs_kernel_bit_for_bit(version: str) -> None:
    kernel = CACHE / version / KERNELS[version]
    if not kernel.is_file():
        pytest.skip(f"SGLang {version} is not unpacked in {CACHE} (hack/sglang-wheels.sh)")
    pytest.importorskip("triton")
    inputs = _inputs()
    rng = np.random.default_rng(11)
    partials = [[int(x) for x in rng.integers(0, 1 << 63, 1500, dtype=np.int64) * 2 + 1], [2**64 - 1, 5]]
    job = {"inputs": [base64.b64encode(b).decode() for b in inputs], "partials": partials}
    done = subprocess.run(
        [sys.executable, str(READER), str(kernel)],
        input=json.dumps(job), capture_output=True, text=True, timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    # the tree reduction is a sum mod 2**64 (1500 partials: two levels of it)
    assert result["sums"] == [sum(p) % 2**64 for p in partials]
    assert [th.hash_bytes(b) for b in inputs] == result["hashes"]


def test_numpy_and_torch_agree(torch_mod) -> None:  # type: ignore[no-untyped-def]
    torch = torch_mod
    for data in _inputs():
        t = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.zeros(0, dtype=torch.uint8)
        )
        assert th.hash_tensor(t) == th.hash_bytes(data), len(data)


def test_a_tensor_hashes_its_bytes_whatever_its_dtype_and_shape(torch_mod) -> None:  # type: ignore[no-untyped-def]
    torch = torch_mod
    t = torch.arange(3 * 5 * 7, dtype=torch.float32).reshape(3, 5, 7).to(torch.bfloat16)
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    assert th.hash_tensor(t) == th.hash_bytes(raw)
    s = t.transpose(0, 2)  # not contiguous: SGLang hashes its contiguous bytes
    assert th.hash_tensor(s) == th.hash_tensor(s.contiguous())


def test_chunks_do_not_change_the_hash(monkeypatch: pytest.MonkeyPatch, torch_mod) -> None:  # type: ignore[no-untyped-def]
    torch = torch_mod
    data = np.random.default_rng(3).integers(0, 256, 5 * TILE_BYTES + 6, dtype=np.uint8).tobytes()
    whole = th.hash_bytes(data)
    monkeypatch.setattr(th, "CHUNK_WORDS", 2 * th.TILE_WORDS)
    assert th.hash_bytes(data) == whole
    assert th.hash_tensor(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == whole


def test_a_fused_parameter_hashes_as_its_parts_back_to_back(torch_mod) -> None:  # type: ignore[no-untyped-def]
    """SGLang's tensor_hash of a list hashes the concatenation of the flattened tensors (mm_utils.py:1218-
    1237@0.5.15.post1): qkv_proj's bytes are q's, k's and v's."""
    torch = torch_mod
    q, k, v = (torch.full((4, 6), float(i), dtype=torch.bfloat16) for i in range(3))
    fused = torch.cat([q, k, v]).view(torch.uint8).numpy().tobytes()
    assert th.hash_tensors([q, k, v]) == th.hash_bytes(fused)
    assert th.hash_bytes(*(x.view(torch.uint8).numpy() for x in (q, k, v))) == th.hash_bytes(fused)
    assert th.hash_tensors([q, k, v]) != th.hash_tensors([k, q, v])  # the order is in the hash


def test_one_changed_word_changes_the_hash() -> None:
    data = bytearray(np.random.default_rng(5).integers(0, 256, 3 * TILE_BYTES, dtype=np.uint8).tobytes())
    before = th.hash_bytes(bytes(data))
    for at in (0, TILE_BYTES - 1, TILE_BYTES, len(data) - 1):
        changed = bytearray(data)
        changed[at] ^= 1
        assert th.hash_bytes(bytes(changed)) != before, at
    swapped = data[TILE_BYTES:] + data[:TILE_BYTES]  # the same words in other places
    assert th.hash_bytes(bytes(swapped)) != before
    assert th.hex16(th.hash_bytes(b"")) == "0" * 16
