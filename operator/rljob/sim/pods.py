"""How the fake kubelet runs an RLJob's pods on this machine: from the pod spec the operator generated.

- the agent container runs the real `rljob-agent` with the args/env/token the operator injected;
- a container whose command launches SGLang (`sglang.launch_server`) runs the SGLang emulator with
  the same launch flags;
- a container whose command runs `rljob.sim.trainer` runs the simulated trainer.

Inside a pod, 127.0.0.1 is the pod's own loopback. Here all pods share one host, so each pod gets its
own loopback address (127.0.0.2, ...) and `127.0.0.1` in the containers' args and env is rewritten to
it: the same isolation, one level up.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from rljob.controller.children import AGENT_CONTAINER
from rljob.sim.kubelet import ContainerContext, Launch, Mapping, default_mapping

SGLANG_ENTRY = "sglang.launch_server"
TRAINER_ENTRY = "rljob.sim.trainer"
SIM_ARGS_ENV = "RLJOB_SIM_ARGS"  # extra emulator-only flags (sizes, version, faults) set per container


def _pod_loopback(text: str, pod_ip: str) -> str:
    return text.replace("127.0.0.1", pod_ip).replace("0.0.0.0", pod_ip)


def _python() -> list[str]:
    return [sys.executable, "-u"]


def _console_script(name: str, module: str) -> list[str]:
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [*_python(), "-m", module]


def rljob_mapping(extra_sglang_args: Sequence[str] = ()) -> Mapping:
    def mapping(ctx: ContainerContext) -> Launch:
        argv = [_pod_loopback(a, ctx.pod_ip) for a in ctx.argv()]
        env = {k: _pod_loopback(v, ctx.pod_ip) for k, v in ctx.env.items()}
        sim_args = shlex.split(ctx.env.get(SIM_ARGS_ENV, ""))
        if ctx.name == AGENT_CONTAINER:
            return Launch([*_console_script("rljob-agent", "rljob.agent.main"), *argv[1:]], env=env)
        if SGLANG_ENTRY in argv:
            launch_args = argv[argv.index(SGLANG_ENTRY) + 1 :]
            return Launch(
                [*_python(), "-m", "rljob.sim.sglang", *launch_args, *extra_sglang_args, *sim_args], env=env
            )
        if TRAINER_ENTRY in argv:
            args = argv[argv.index(TRAINER_ENTRY) + 1 :]
            return Launch([*_python(), "-m", TRAINER_ENTRY, *args, *sim_args], env=env)
        launch = default_mapping(ctx)
        return Launch([_pod_loopback(a, ctx.pod_ip) for a in launch.argv], env=env)

    return mapping
