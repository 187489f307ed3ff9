"""vLLM's launch facts, from `/server_info?config_format=json` (V-ROUTE-SERVER-INFO) and `/version`: what
its launch flags, its environment and its version allow the handoff, and the launches under which the
handoff is unsafe (each a launch refusal: the job fails before any memory is touched)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob.agent.engines.vllm.quirks import VLLMQuirks
from rljob.api.agent import LaunchRefusal, LaunchRefusalReason
from rljob.api.spec import EngineKind, RefitSource

TRUE_ENV = ("1", "true", "True", True, 1)


@dataclass(frozen=True)
class VLLMFacts:
    """Launch facts; they cannot change while the server runs (agent/engines/base.py EngineFacts)."""

    version: str
    dev_mode: bool  # VLLM_SERVER_DEV_MODE=1: the RL routes exist (V-LAUNCH-DEVMODE)
    sleep_mode: bool = False  # --enable-sleep-mode (V-LAUNCH-SLEEPMODE)
    transfer_backend: str | None = None  # --weight-transfer-config's backend (V-LAUNCH-WEIGHT-TRANSFER)
    insecure_serialization: bool = False  # VLLM_ALLOW_INSECURE_SERIALIZATION=1 (V-REFIT-IPC-INSECURE)
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    model: str | None = None  # model_config.model at launch
    served_model_name: str | None = None
    quantization: str | None = None
    exposed_at: str | None = None  # an address beyond loopback where vLLM's port answered (V-LAUNCH-HOST)
    refit_source: RefitSource | None = None  # the RLJob's, as the agent was told it
    keep_weights: bool = False  # the agent sleeps at level 1 (weights kept on the host)

    @property
    def kind(self) -> EngineKind:
        return EngineKind.VLLM

    @property
    def quirks(self) -> VLLMQuirks:
        return VLLMQuirks.detect(self.version)

    @property
    def reports_version(self) -> bool:
        """V-ROUTE-WV: 0.26 carries no weight version."""
        return self.quirks.carries_weight_version

    @property
    def weights_survive_release(self) -> bool:
        """V-MEM-LEVELS: a level-1 sleep copies the weights to the host and the wake copies them back; level
        2 discards them."""
        return self.keep_weights

    @property
    def tag_bytes(self) -> tuple[tuple[str, int], ...]:
        """vLLM reports no size per memory part: the headroom gate takes NVML's measure of the release."""
        return ()

    @property
    def keep_weights_hint(self) -> str:
        return (
            "run the agent with --keep-released-weights (vLLM then sleeps at level 1: the weights' bytes of "
            "pinned host memory per GPU for the whole sleep, V-MEM-LEVEL1-HOST)"
        )

    @property
    def world_size(self) -> int:
        """Every worker of the server: each opens its own GPU's IPC handle (V-REFIT-IPC)."""
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def launch_refusal(self) -> LaunchRefusal | None:
        return next(iter(self.launch_refusals()), None)

    def launch_refusals(self) -> list[LaunchRefusal]:
        out = []
        if not self.dev_mode:
            out.append(
                LaunchRefusal(
                    reason=LaunchRefusalReason.LIFECYCLE_ROUTES_DISABLED,
                    message="vLLM runs without VLLM_SERVER_DEV_MODE=1: its pause, sleep, wake and weight "
                    "routes "
                    "do not exist (V-LAUNCH-DEVMODE); set VLLM_SERVER_DEV_MODE=1 in vLLM's environment",
                )
            )
            return out
        if not self.sleep_mode:
            out.append(
                LaunchRefusal(
                    reason=LaunchRefusalReason.RELEASE_FREES_NOTHING,
                    message="vLLM runs without --enable-sleep-mode: a sleep answers 200 and frees nothing "
                    "(V-KILL-NO-SLEEP-MODE); launch vLLM with --enable-sleep-mode",
                )
            )
        if self.refit_source == RefitSource.TENSOR:
            why = self.tensor_refit_impossible()
            if why is not None:
                out.append(
                    LaunchRefusal(reason=LaunchRefusalReason.TENSOR_TRANSFER_UNCONFIGURED, message=why)
                )
        if self.insecure_serialization and self.exposed_at is not None:
            out.append(
                LaunchRefusal(
                    reason=LaunchRefusalReason.INSECURE_ENGINE_EXPOSED,
                    message=f"vLLM unpickles weight pushes (VLLM_ALLOW_INSECURE_SERIALIZATION=1) and its "
                    f"port answers on {self.exposed_at}: its RL routes take no key (V-ROUTE-AUTH), so anyone "
                    "who reaches the port runs code in it; launch vLLM with --host 127.0.0.1",
                )
            )
        return out

    def tensor_refit_impossible(self) -> str | None:
        """Why this launch cannot take a tensor refit (V-LAUNCH-WEIGHT-TRANSFER, V-REFIT-IPC-INSECURE), or
        None."""
        if self.transfer_backend != "ipc":
            found = self.transfer_backend or "none"
            return (
                f"a tensor refit needs vLLM's IPC weight transfer, and vLLM runs with backend {found} "
                "(V-LAUNCH-WEIGHT-TRANSFER); launch vLLM with --weight-transfer-config "
                '\'{"backend": "ipc"}\', or set spec.refit.source: disk'
            )
        if not self.insecure_serialization:
            return (
                "vLLM refuses to unpickle the pushes' IPC handles without "
                "VLLM_ALLOW_INSECURE_SERIALIZATION=1 "
                "in its environment, and a refused push leaves its layers unbuilt (V-REFIT-IPC-INSECURE, "
                "V-KILL-REFIT-FAILED); set it (vLLM on 127.0.0.1 only), or set spec.refit.source: disk"
            )
        return None

    @classmethod
    def from_server_info(
        cls,
        version: str,
        info: dict[str, Any] | None,
        *,
        refit_source: RefitSource | None = None,
        keep_weights: bool = False,
        exposed_at: str | None = None,
    ) -> VLLMFacts:
        """`info`: `/server_info`'s JSON, or None where the route is absent (dev mode off)."""
        if info is None:
            return cls(version=version, dev_mode=False, refit_source=refit_source, keep_weights=keep_weights)
        config = info["vllm_config"]
        model = _section(config, "model_config")
        parallel = _section(config, "parallel_config")
        transfer = config.get("weight_transfer_config")
        env = _section(info, "vllm_env")
        served = model.get("served_model_name")
        if isinstance(served, list):
            served = served[0] if served else None
        return cls(
            version=version,
            dev_mode=True,  # /server_info itself is a dev route (V-LAUNCH-DEVMODE)
            sleep_mode=bool(model.get("enable_sleep_mode", False)),
            transfer_backend=str(transfer.get("backend") or "nccl") if isinstance(transfer, dict) else None,
            insecure_serialization=env.get("VLLM_ALLOW_INSECURE_SERIALIZATION") in TRUE_ENV,
            tp_size=int(parallel.get("tensor_parallel_size") or 1),
            pp_size=int(parallel.get("pipeline_parallel_size") or 1),
            dp_size=int(parallel.get("data_parallel_size") or 1),
            model=str(model["model"]) if model.get("model") else None,
            served_model_name=str(served) if served else None,
            quantization=str(model["quantization"]) if model.get("quantization") else None,
            exposed_at=exposed_at,
            refit_source=refit_source,
            keep_weights=keep_weights,
        )


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key)
    return value if isinstance(value, dict) else {}
