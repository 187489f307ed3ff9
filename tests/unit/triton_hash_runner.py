"""Runs the SDK's Triton hash kernel (trainer/engines/sglang/triton_hash.py) under Triton's interpreter, on
the CPU: used by test_tensor_hash.py (the interpreter must be chosen before triton is imported).

    TRITON_INTERPRET=1 python tests/unit/triton_hash_runner.py < job.json > result.json

job: {"cases": [{"parts": [{"dtype": "bfloat16", "data": base64, "offset": 0}, ...], "zero": 0}, ...]}: each
case one parameter, its parts in order (a part is `data` viewed as `dtype`, starting `offset` bytes into
a uint8 tensor: a view at an odd address), then `zero` zero bytes. result: {"alone": [...], "batch": [...]}:
each case hashed on its own (`hash_parts`), and all of them as one digest's slots of one buffer, read once
(`launch` into slot i, then `finish`)."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "operator"))


def main() -> None:
    import torch

    from rljob.trainer.engines.sglang import triton_hash

    assert triton_hash.AVAILABLE, "triton does not import"

    def part(spec: dict[str, Any]) -> Any:
        data, offset = base64.b64decode(spec["data"]), int(spec.get("offset", 0))
        if not data:
            return torch.zeros(0, dtype=getattr(torch, spec["dtype"]))
        raw = torch.frombuffer(bytearray(bytes(offset) + data), dtype=torch.uint8)[offset:]
        return raw.view(getattr(torch, spec["dtype"]))

    cases = [([part(p) for p in c["parts"]], int(c.get("zero", 0))) for c in json.load(sys.stdin)["cases"]]
    alone = [triton_hash.hash_parts(parts, zero) for parts, zero in cases]
    out = triton_hash.new_slots(len(cases), "cpu")
    for slot, (parts, zero) in enumerate(cases):
        triton_hash.launch(parts, zero, out, slot)
    json.dump({"alone": alone, "batch": triton_hash.finish(out)}, sys.stdout)


if __name__ == "__main__":
    main()
