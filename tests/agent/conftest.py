"""Fixtures for the agent tier: real emulator and agent processes on loopback, stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_procs import VERSIONS, Agent, AgentDriver, Emulator, Pod, Proc
from vllm_procs import VllmEmulator


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "emulator_may_die: the test expects SGLang (the emulator) to die")


@pytest.fixture
def procs(request: pytest.FixtureRequest) -> Iterator[list[Proc]]:
    """Every process a test starts; all are stopped at teardown. Unless the test is marked
    `emulator_may_die`, an emulator that died is a failure: a correct run never kills SGLang."""
    started: list[Proc] = []
    yield started
    may_die = request.node.get_closest_marker("emulator_may_die") is not None
    dead = [p for p in started if isinstance(p, Emulator | VllmEmulator) and not p.alive()]
    for p in started:
        p.stop()
    if dead and not may_die:
        pytest.fail(f"{dead[0].name} died during the test:\n" + dead[0].log_text()[-3000:])


@pytest.fixture
def start_emulator(procs: list[Proc], tmp_path: Path) -> Callable[..., Emulator]:
    def start(version: str = "0.5.23", *flags: str, **kw: Any) -> Emulator:
        emu = Emulator(tmp_path, version, *flags, **kw)
        procs.append(emu)
        return emu

    return start


@pytest.fixture
def start_agent(procs: list[Proc], tmp_path: Path) -> Callable[..., Agent]:
    def start(emulator: Emulator, *extra: str, serving: bool = True, **kw: Any) -> Agent:
        """serving=True: wait for Ready, then open rollout as the operator does (resume at epoch 1)."""
        agent = Agent(tmp_path, emulator.url, *extra, **kw)
        procs.append(agent)
        if serving:
            agent.wait_stage("Ready")
            AgentDriver(agent).ok("resume")
        return agent

    return start


@pytest.fixture(params=VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pod(version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]) -> Pod:
    """An emulator of each SGLang version with its agent, Serving. Both start at once: the agent waits."""
    emu = start_emulator(version)
    return Pod(emu, start_agent(emu))


@pytest.fixture
def start_vllm(procs: list[Proc], tmp_path: Path) -> Callable[..., VllmEmulator]:
    """The vLLM emulator, stopped at teardown; one that died fails the test unless it is marked
    `emulator_may_die`, as for SGLang's."""

    def start(version: str, *flags: str, **kw: Any) -> VllmEmulator:
        emu = VllmEmulator(tmp_path, version, *flags, **kw)
        procs.append(emu)
        return emu

    return start
