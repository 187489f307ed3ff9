"""How the fake kubelet runs an RLJob's pods on this machine: from the pod spec the operator generated.

- the agent container runs the real `rljob-agent` with the args/env/token the operator injected;
- a container whose command launches SGLang (`sglang.launch_server`) runs the SGLang emulator with
  the same launch flags;
- a container that launches vLLM (`vllm serve`, `vllm.entrypoints.openai.api_server`, or the
  vllm/vllm-openai image's own entrypoint) runs the vLLM emulator with the same `vllm serve` flags, as
  the version its image tag names (vX.Y.Z; else the emulator's default; `--vllm-version` in
  RLJOB_SIM_ARGS overrides it);
- a container whose command runs `rljob.testing.trainer` runs the simulated trainer;
- a container whose command runs `rljob.testing.framework_trainer` runs it as its own process, on this
  interpreter.

Inside a pod, 127.0.0.1 is the pod's own loopback. Here all pods share one host, so each pod gets its
own loopback address (127.0.0.2, ...) and `127.0.0.1` in the containers' args and env is rewritten to
it: the same isolation, one level up.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rljob.controller.children import AGENT_CONTAINER
from rljob.emulator.vllm.versions import DEFAULT_VERSION as DEFAULT_VLLM_VERSION
from rljob.testing.kubelet import ContainerContext, Launch, Mapping, default_mapping

SGLANG_ENTRY = "sglang.launch_server"
VLLM_ENTRY = "vllm.entrypoints.openai.api_server"  # what `vllm serve` runs, as a module
VLLM_IMAGE = "vllm/vllm-openai"  # its entrypoint is `vllm serve`
TRAINER_ENTRY = "rljob.testing.trainer"
FRAMEWORK_TRAINER_ENTRY = "rljob.testing.framework_trainer"
SIM_ARGS_ENV = "RLJOB_SIM_ARGS"  # extra emulator-only flags (sizes, version, faults) set per container
AGENT_TEST_ARGS = ("--rollout-sample-seconds", "0.1")


def pod_loopback(text: str, pod_ip: str) -> str:
    return text.replace("127.0.0.1", pod_ip).replace("0.0.0.0", pod_ip)


@dataclass(frozen=True)
class PodContainer:
    """What a container of an RLJob pod is here: `kind` agent, sglang, vllm, trainer or other; `args` the
    arguments for its stand-in (after the entry point; for `other`, the whole command), loopback rewritten."""

    kind: str
    args: list[str]
    env: dict[str, str]


def classify(ctx: ContainerContext, extra_sglang_args: Sequence[str] = ()) -> PodContainer:
    argv = [pod_loopback(a, ctx.pod_ip) for a in ctx.argv()]
    env = {k: pod_loopback(v, ctx.pod_ip) for k, v in ctx.env.items()}
    sim_args = shlex.split(ctx.env.get(SIM_ARGS_ENV, ""))
    # RLJOB_SIM_ARGS_POD_<i>: more flags for pod i only (e.g. a fault on one follower of the gang).
    sim_args += shlex.split(ctx.env.get(f"{SIM_ARGS_ENV}_POD_{ctx.env.get('RLJOB_POD_INDEX', '')}", ""))
    if ctx.name == AGENT_CONTAINER:
        return PodContainer("agent", argv[1:], env)
    if SGLANG_ENTRY in argv:
        return PodContainer(
            "sglang", [*argv[argv.index(SGLANG_ENTRY) + 1 :], *extra_sglang_args, *sim_args], env
        )
    serve = vllm_serve_args(ctx, argv)
    if serve is not None:
        return PodContainer("vllm", ["--vllm-version", vllm_version(ctx.image), *serve, *sim_args], env)
    if TRAINER_ENTRY in argv:
        return PodContainer("trainer", [*argv[argv.index(TRAINER_ENTRY) + 1 :], *sim_args], env)
    if FRAMEWORK_TRAINER_ENTRY in argv:
        return PodContainer("other", [*_python(), "-m", *argv[argv.index(FRAMEWORK_TRAINER_ENTRY) :]], env)
    return PodContainer("other", [pod_loopback(a, ctx.pod_ip) for a in default_mapping(ctx).argv], env)


def vllm_serve_args(ctx: ContainerContext, argv: list[str]) -> list[str] | None:
    """The `vllm serve` arguments of a container that launches vLLM, None for any other."""
    if len(argv) >= 2 and os.path.basename(argv[0]) == "vllm" and argv[1] == "serve":
        return argv[2:]
    if VLLM_ENTRY in argv:
        return argv[argv.index(VLLM_ENTRY) + 1 :]
    if not ctx.container.get("command") and ctx.image.split("@")[0].rsplit(":", 1)[0].endswith(VLLM_IMAGE):
        return argv  # the image's entrypoint: the args are vllm serve's
    return None


def vllm_version(image: str) -> str:
    """The version an image tag names (`vllm/vllm-openai:v0.26.0`), else the emulator's default."""
    found = re.search(r":v?(\d+\.\d+\.\d+)$", image.split("@")[0])
    return found.group(1) if found else DEFAULT_VLLM_VERSION


def _python() -> list[str]:
    return [sys.executable, "-u"]


def _console_script(name: str, module: str) -> list[str]:
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [*_python(), "-m", module]


def rljob_mapping(extra_sglang_args: Sequence[str] = ()) -> Mapping:
    """One OS process per container."""

    def mapping(ctx: ContainerContext) -> Launch:
        c = classify(ctx, extra_sglang_args)
        if c.kind == "agent":
            # Rollouts here last a second or less: sample them more often than the agent's 1 s default.
            argv = [*_console_script("rljob-agent", "rljob.agent.main"), *c.args, *AGENT_TEST_ARGS]
            return Launch(argv, env=c.env)
        if c.kind == "sglang":
            return Launch([*_python(), "-m", "rljob.emulator", *c.args], env=c.env)
        if c.kind == "vllm":
            return Launch([*_python(), "-m", "rljob.emulator.vllm", *c.args], env=c.env)
        if c.kind == "trainer":
            return Launch([*_python(), "-m", TRAINER_ENTRY, *c.args], env=c.env)
        return Launch(c.args, env=c.env)

    return mapping
