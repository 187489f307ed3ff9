"""vLLM's weights, read back (V-ROUTE-CHECKER, 0.34): one `/weight_checker` checksum call, sha256 of every
parameter of every worker (V-CHECKER-HASH), read into agent/weights_check.Held. vLLM 0.26 has no route
that reads weights back: the look says why, never that they were verified."""

from __future__ import annotations

import hashlib
import re

from rljob.agent.engines.checksum_look import timed_look
from rljob.agent.engines.vllm.client import VLLMClient
from rljob.agent.weights_check import GpuHashes, Held
from rljob.agent.weights_look import Look

KEY = re.compile(r"^dp(\d+):pp(\d+):pcp(\d+):tp(\d+):(.+)$")  # gw:387-398@0.34.0


def why_not(client: VLLMClient, weights_released: bool) -> str | None:
    quirks = client.quirks
    if quirks is None:
        return "vLLM's version is not known yet"
    if not quirks.checksums_weights:
        return (
            f"vLLM {quirks.version} has no route that reads its weights back (/weight_checker exists from "
            "0.34.0; 0.26 would need a worker extension)"
        )
    if weights_released:
        return "the weights are asleep (a checksum would read unmapped memory)"
    return None


async def look(client: VLLMClient, weights_released: bool, timeout: float) -> Look:
    async def read() -> Held:
        return read_reply(await client.weight_checksums(timeout=timeout))

    return await timed_look(why_not(client, weights_released), "/weight_checker", read, timeout)


def read_reply(checksums: dict[str, str]) -> Held:
    """Per worker (dp, pp, pcp, tp): its parameters' sha256 and a checksum over them (sha256 of the sorted
    `name hash` lines). A prefill-context-parallel rank counts as a TP shard of its own."""
    workers: dict[tuple[int, int, int, int], dict[str, str]] = {}
    for key, digest in checksums.items():
        m = KEY.match(key)
        if m is None:
            raise ValueError(f"a /weight_checker key is not dp:pp:pcp:tp:name: {key[:120]!r}")
        dp, pp, pcp, tp = (int(m.group(i)) for i in range(1, 5))
        workers.setdefault((dp, pp, pcp, tp), {})[m.group(5)] = digest
    if not workers:
        raise ValueError("the /weight_checker reply has no checksum")
    tp_size = max(tp for _, _, _, tp in workers) + 1
    pcp_size = max(pcp for _, _, pcp, _ in workers) + 1
    pp_size = max(pp for _, pp, _, _ in workers) + 1
    gpus = []
    for (dp, pp, pcp, tp), params in sorted(workers.items()):
        per_gpu = hashlib.sha256("".join(f"{n} {params[n]}\n" for n in sorted(params)).encode()).hexdigest()
        gpus.append(GpuHashes(dp, pp, pcp * tp_size + tp, per_gpu, params))
    return Held(tuple(gpus), tp_size * pcp_size, pp_size, engine="vLLM")
