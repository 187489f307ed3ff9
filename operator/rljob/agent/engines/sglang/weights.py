"""SGLang's weights, read back: one `/weights_checker` checksum call (C-CHECKER-CHECKSUM), made only while the
weights are mapped (a hash of released weights reads unmapped memory: C-CHECKER-RELEASED), read into
agent/weights_check.Held, timed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rljob.agent.engines.checksum_look import timed_look
from rljob.agent.engines.sglang.client import SGLangClient
from rljob.agent.weights_check import GpuHashes, Held
from rljob.agent.weights_look import Look


def why_not(client: SGLangClient, weights_released: bool) -> str | None:
    """Why no checksum can be taken now, or None."""
    quirks = client.quirks
    if quirks is None:
        return "SGLang's version is not known yet"
    if not quirks.checker_checksum:
        return f"SGLang {quirks.version} has no /weights_checker checksum (it has one from 0.5.15.post1)"
    if weights_released:
        return "the weights are released (a checksum would read unmapped memory)"
    return None


async def look(client: SGLangClient, weights_released: bool, timeout: float) -> Look:
    """One checksum of every parameter SGLang holds; EngineUnreachable propagates (SGLang is gone)."""

    async def read() -> Held:
        return read_reply(await client.weights_checksum(timeout=timeout))

    return await timed_look(why_not(client, weights_released), "/weights_checker", read, timeout)


def _target(info: Any) -> Mapping[str, Any]:
    """A GPU's place: one `parallelism_info` object up to 0.5.20, a list of one per role (the target model
    and each draft) from 0.5.21 (managers/io_struct.py:2141-2145@0.5.21)."""
    if isinstance(info, list):
        return next((i for i in info if i.get("role") == "target"), info[0])
    if not isinstance(info, Mapping):
        raise TypeError("parallelism_info is not an object")
    return info


def read_reply(body: Any) -> Held:
    """The checker's reply (ValueError when it is not one): `ranks`, one per GPU, each with `checksums`,
    `per_gpu_checksum` and `parallelism_info` (C-CHECKER-CHECKSUM)."""
    if not isinstance(body, dict) or not isinstance(body.get("ranks"), list) or not body["ranks"]:
        raise ValueError(f"no ranks in the /weights_checker reply: {str(body)[:200]}")
    gpus = []
    tp_size = pp_size = 1
    for rank in body["ranks"]:
        try:
            info = _target(rank["parallelism_info"])
            checksums = rank["checksums"]
            if not isinstance(checksums, dict):
                raise TypeError("checksums is not an object")
            gpus.append(
                GpuHashes(
                    int(info.get("dp_rank") or 0),
                    int(info.get("pp_rank") or 0),
                    int(info.get("tp_rank") or 0),
                    str(rank["per_gpu_checksum"]),
                    {str(k): str(v) for k, v in checksums.items()},
                )
            )
            tp_size, pp_size = int(info.get("tp_size") or 1), int(info.get("pp_size") or 1)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(
                f"a /weights_checker rank is not {{checksums, per_gpu_checksum, parallelism_info}}: {e}"
            ) from e
    return Held(tuple(gpus), tp_size, pp_size, engine="SGLang")
