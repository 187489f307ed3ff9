"""A vLLM server emulator for tests, demos and benchmarks: the RL lifecycle's HTTP contract of vLLM 0.26.0
and 0.34.0 as docs/vllm-conformance.md reads it from the wheels (the pause modes, sleep levels and tags,
the wake order, the native weight transfer, disk reloads through /collective_rpc, the prefix-cache reset,
the DP fan-out, /metrics), memory per GPU and region, and the same deaths, errors and silent corruptions.
It shares the engine-neutral core of rljob.emulator with the SGLang emulator (the emulated GPUs' flags and
memory regions, the process's startup, the token model, the prefix cache, weights, faults, the
`/_emulator/*` routes, the call log).
Run: `python -m rljob.emulator.vllm --vllm-version 0.26.0 [vllm serve flags] MODEL`."""
