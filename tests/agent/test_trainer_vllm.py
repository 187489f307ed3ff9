"""The simulated trainer's rollout against the vLLM emulator (engine vllm in the e2e tier): it generates
through vLLM's /v1/completions, scores its samples from their logprobs, and catches what it exists to catch:
outputs of another weight version where vLLM stamps them (0.34's weight_versions), and garbage after a
level-2 sleep woken without a refit (V-KILL-L2-NO-REFIT) at both versions."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
from vllm_procs import VLLM_VERSIONS

from rljob.api.spec import EngineKind
from rljob.testing.trainer import Rollout, StaleServing

StartVllm = Any  # the start_vllm fixture: (version, *flags, **kw) -> VllmEmulator
ARGS = argparse.Namespace(
    samples_per_prompt=3, max_new_tokens=6, prompts=4, prefix_tokens=8, concurrency=2, request_timeout=30
)


def rollout(emu: Any) -> Rollout:
    emu.wait_ready()
    return Rollout(emu.url, None, ARGS, EngineKind.VLLM)


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_the_rollout_scores_every_sample_from_vllm_logprobs(version: str, start_vllm: StartVllm) -> None:
    emu = start_vllm(version)
    served = "0"
    if version == "0.34.0":  # the agent labels the weights where vLLM carries a version (V-ROUTE-WV)
        emu.ok("POST", "/update_weight_version", {"new_version": served})
    stats = rollout(emu).run(1, served)
    assert stats["responses"] == stats["completed"] == stats["scored"] == 12
    assert stats["loss"] is not None and math.isfinite(stats["loss"]) and stats["logprob_mean"] < 0
    assert stats["prompt_tokens"] > 0  # usage's prompt tokens, once per prompt


def test_outputs_of_another_version_are_stale_where_vllm_stamps_them(start_vllm: StartVllm) -> None:
    emu = start_vllm("0.34.0")
    emu.ok("POST", "/update_weight_version", {"new_version": "1"})
    with pytest.raises(StaleServing, match="weight_version '1', but the agent reports '2'"):
        rollout(emu).run(1, "2")


def test_vllm_026_outputs_carry_no_version_and_are_judged_by_content(start_vllm: StartVllm) -> None:
    emu = start_vllm("0.26.0")
    assert rollout(emu).run(1, "7")["scored"] == 12  # nothing says which version served them


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_garbage_after_a_wake_without_refit_is_stale(version: str, start_vllm: StartVllm) -> None:
    emu = start_vllm(version)
    if version == "0.34.0":
        emu.ok("POST", "/update_weight_version", {"new_version": "0"})
    emu.ok("POST", "/sleep?level=2")
    emu.ok("POST", "/wake_up")
    with pytest.raises(StaleServing, match="garbage"):
        rollout(emu).run(1, "0")
