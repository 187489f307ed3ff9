"""Real payloads for the replays' tensor placeholders, where real SGLang opens the CUDA IPC handles
(tests/gpu: the differential runner, framework_trainer --real-payloads): the same names, shapes and dtypes
as rljob.testing.client_replay's stand-ins, as real CUDA tensors held by this process, serialized the way
each client serializes them (SGLang's own MultiprocessingSerializer,
FlattenedTensorBucket and LocalSerializedTensor). The names are not the model's: SGLang's Llama loader
skips them with a warning (models/llama.py load_weights@0.5.15.post1), so the server's weights stay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_HELD: list[Any] = []  # the tensors stay alive while the server may still open their handles


def _named() -> list[tuple[str, Any]]:
    import torch

    weight = torch.arange(16, dtype=torch.float32, device="cuda").reshape(4, 4).to(torch.bfloat16)
    bias = torch.arange(4, dtype=torch.float32, device="cuda")
    _HELD.extend([weight, bias])
    return [("model.layers.0.mlp.weight", weight), ("model.layers.0.mlp.bias", bias)]


def named_tensors_b64() -> str:
    from sglang.srt.utils import MultiprocessingSerializer

    return str(MultiprocessingSerializer.serialize(_named(), output_str=True))


def flattened_bucket_b64() -> str:
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=_named())
    data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    _HELD.append(data["flattened_tensor"])
    return str(MultiprocessingSerializer.serialize(data, output_str=True))


def local_serialized_named_tensors_b64() -> str:
    from sglang.srt.model_executor.model_runner import LocalSerializedTensor
    from sglang.srt.utils import MultiprocessingSerializer

    items = [(n, LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(t)])) for n, t in _named()]
    return str(MultiprocessingSerializer.serialize(items, output_str=True))


BUILDERS: dict[str, Callable[[], str]] = {
    "named_tensors_b64": named_tensors_b64,
    "flattened_bucket_b64": flattened_bucket_b64,
    "local_serialized_named_tensors_b64": local_serialized_named_tensors_b64,
}
