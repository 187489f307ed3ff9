"""The SDK's tensor_hash against SGLang's own kernels: the per-parameter hash of `/weights_checker`
(C-CHECKER-CHECKSUM), `gpu_tensor_hash`'s Triton kernels run by Triton's interpreter on the CPU
(tests/unit/sglang_hash_reader.py), for every recorded version whose wheel has them; the SDK's own Triton
kernel (trainer/engines/sglang/triton_hash.py, run the same way by tests/unit/triton_hash_runner.py) against
SGLang's kernel and the numpy path, on parameters of one part and of several (a fused parameter's parts,
read in place); and the numpy and torch implementations against each other, chunked and not. On a GPU,
tests/gpu/test_real_sglang_verify.py runs the compiled kernels."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rljob.trainer.engines.sglang import tensor_hash as th

CACHE = Path(os.environ.get("RLJOB_SGLANG_CACHE", Path.home() / ".cache/rljob/sglang"))
READER = Path(__file__).with_name("sglang_hash_reader.py")
SDK_RUNNER = Path(__file__).with_name("triton_hash_runner.py")
KERNELS = {  # where each recorded version with the checksum action keeps gpu_tensor_hash
    "0.5.15.post1": "sglang/srt/layers/multimodal.py",
    "0.5.20": "sglang/kernels/ops/memory/gpu_tensor_hash.py",
    "0.5.21": "sglang/kernels/ops/memory/gpu_tensor_hash.py",
    "0.5.23": "sglang/kernels/ops/memory/gpu_tensor_hash.py",
}
TILE_BYTES = th.TILE_WORDS * 4
REFERENCE = "0.5.15.post1"  # the SGLang the GPU tier runs: the SDK's kernel is held against its kernel
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


def _interpreted(script: Path, *args: str, job: dict[str, Any]) -> dict[str, Any]:
    """`script` run by Triton's interpreter (chosen before triton is imported: a process of its own)."""
    done = subprocess.run(
        [sys.executable, str(script), *args],
        input=json.dumps(job), capture_output=True, text=True, timeout=900,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _sglang_kernel(version: str) -> Path:
    kernel = CACHE / version / KERNELS[version]
    if not kernel.is_file():
        pytest.skip(f"SGLang {version} is not unpacked in {CACHE} (hack/sglang-wheels.sh)")
    pytest.importorskip("triton")
    return kernel


@pytest.mark.parametrize("version", sorted(KERNELS))
def test_the_hash_is_sglangs_kernel_bit_for_bit(version: str) -> None:
    kernel = _sglang_kernel(version)
    inputs = _inputs()
    rng = np.random.default_rng(11)
    partials = [[int(x) for x in rng.integers(0, 1 << 63, 1500, dtype=np.int64) * 2 + 1], [2**64 - 1, 5]]
    job = {"inputs": [base64.b64encode(b).decode() for b in inputs], "partials": partials}
    result = _interpreted(READER, str(kernel), job=job)
    # the tree reduction is a sum mod 2**64 (1500 partials: two levels of it)
    assert result["sums"] == [sum(p) % 2**64 for p in partials]
    assert [th.hash_bytes(b) for b in inputs] == result["hashes"]


Part = tuple[str, bytes, int]  # dtype, bytes, offset into a uint8 tensor (a view at that address)
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "uint8": 1}


def _sdk_cases() -> dict[str, tuple[list[Part], int]]:
    """Parameters as the SDK's kernel reads them: parts back to back, then zero bytes (vocabulary rows)."""
    rng = np.random.default_rng(13)

    def part(dtype: str, count: int, offset: int = 0) -> Part:
        return dtype, rng.integers(0, 256, count * ITEMSIZE[dtype], dtype=np.uint8).tobytes(), offset

    words = th.TILE_WORDS
    cases: dict[str, tuple[list[Part], int]] = {
        f"uint8 x {len(b)}": ([("uint8", b, 0)], 0) for b in _inputs() if len(b) != TILE_BYTES + 8
    }
    cases["zeros, past a tile"] = ([("uint8", bytes(TILE_BYTES + 8), 0)], 0)
    cases |= {
        "no parts": ([], 0),
        "no parts, zero bytes only": ([], 6),
        "empty parts around 10 bytes": ([part("bfloat16", 0), part("uint8", 10), part("float32", 0)], 0),
        # every dtype the tier holds; sizes that are not whole words, or more than a tile
        "bfloat16, 2 tiles and a half word": ([part("bfloat16", 2 * words + 1)], 0),
        "float16 x 7 (14 bytes)": ([part("float16", 7)], 0),
        "float32, a tile and 5 words": ([part("float32", words + 5)], 0),
        "int8 x 70001": ([part("int8", 70_001)], 0),
        "uint8 x 13": ([part("uint8", 13)], 0),
        # fused parameters, whole words: qkv (boundaries inside tiles), gate_up then vocabulary padding
        "qkv, bfloat16, whole words": (
            [part("bfloat16", 2 * words + 6), part("bfloat16", 2052), part("bfloat16", 2052)],
            0,
        ),
        "two parts, then a tile and a word of zeros": (
            [part("bfloat16", words + 2), part("bfloat16", 3 * words)],
            TILE_BYTES + 4,
        ),
        "a part ending on the tile's end": ([part("uint8", TILE_BYTES), part("uint8", TILE_BYTES + 4)], 0),
        "4 parts, whole words, the 3rd and 4th each over a whole tile": (
            [part("float32", 3), part("float32", 5), part("float32", 2 * words), part("float32", 2 * words)],
            0,
        ),
        # fused parameters whose boundaries split words
        "float16 x 7, bfloat16 x tile+1, uint8 x 3, zeros": (
            [part("float16", 7), part("bfloat16", words + 1), part("uint8", 3)],
            1001,
        ),
        "4 odd parts": (
            [part("int8", 5), part("uint8", TILE_BYTES - 1), part("float16", 3), part("bfloat16", 9)],
            2,
        ),
        # views at addresses that are not whole words
        "uint8 at an odd address": ([part("uint8", 40_000, offset=1)], 0),
        "uint8 at offset 2, then float32": ([part("uint8", 8, offset=2), part("float32", 10)], 0),
        # more parts than a launch reads: concatenated first
        "6 parts": ([part("uint8", n) for n in (4, 1, 8, 3, TILE_BYTES, 2)], 0),
    }
    return cases


def test_the_sdk_kernel_is_sglangs_kernel_bit_for_bit() -> None:
    """Each case's hash by the SDK's kernel, alone and as one slot of a digest's buffer, equals the numpy
    path's and SGLang's kernel's of the concatenated bytes."""
    kernel = _sglang_kernel(REFERENCE)
    cases = _sdk_cases()
    whole = {name: b"".join(p[1] for p in parts) + bytes(zero) for name, (parts, zero) in cases.items()}
    sglang = _interpreted(
        READER, str(kernel), job={"inputs": [base64.b64encode(b).decode() for b in whole.values()]}
    )["hashes"]
    job = {
        "cases": [
            {"parts": [{"dtype": d, "data": base64.b64encode(b).decode(), "offset": o} for d, b, o in parts],
             "zero": zero}
            for parts, zero in cases.values()
        ]
    }  # fmt: skip
    sdk = _interpreted(SDK_RUNNER, job=job)
    numpy_path = [th.hash_bytes(b) for b in whole.values()]
    for i, name in enumerate(cases):
        assert (sdk["alone"][i], sdk["batch"][i], numpy_path[i]) == (sglang[i],) * 3, name


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


def test_the_torch_path_reads_a_view_at_an_odd_address(torch_mod) -> None:  # type: ignore[no-untyped-def]
    torch = torch_mod
    data = np.random.default_rng(19).integers(0, 256, TILE_BYTES + 9, dtype=np.uint8)
    for offset in (1, 2, 5):
        view = torch.from_numpy(data)[offset:][: TILE_BYTES + 4]  # whole words, at an odd address
        assert th.hash_tensors_torch([view]) == th.hash_bytes(view.numpy().tobytes()), offset


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


def test_a_digests_hashes_off_cuda_are_taken_at_once(torch_mod) -> None:  # type: ignore[no-untyped-def]
    """start_hashes of groups not on CUDA (numpy, bytes, CPU tensors): each group's parts back to back, then
    its zero bytes, hashed before it returns."""
    torch = torch_mod
    rng = np.random.default_rng(17)
    a, b = rng.integers(0, 256, 10, dtype=np.uint8), rng.integers(0, 256, TILE_BYTES + 6, dtype=np.uint8)
    t = torch.from_numpy(rng.integers(0, 2**15, 7, dtype=np.int16)).view(torch.bfloat16)
    groups: list[tuple[list[Any], int]] = [([a, b.tobytes()], 0), ([t, t], 70), ([], 5), ([], 0), ([b], 3)]
    pending = th.start_hashes(groups)
    pending.release()
    raw_t = t.view(torch.uint8).numpy().tobytes()
    assert pending.result() == [
        th.hash_bytes(a.tobytes() + b.tobytes()),
        th.hash_bytes(raw_t + raw_t + bytes(70)),
        th.hash_bytes(bytes(5)),
        0,
        th.hash_bytes(b.tobytes() + bytes(3)),
    ]


def test_the_sdk_imports_no_torch_triton_or_numpy() -> None:
    """A trainer without them imports the SDK: the hash's libraries load when it hashes."""
    probe = (
        "import sys, rljob.trainer, rljob.trainer.handoff, rljob.trainer.engines.sglang.digest,"
        " rljob.trainer.engines.sglang.tensor_hash;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[]"]
