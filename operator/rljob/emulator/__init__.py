"""A faithful SGLang server emulator for tests, demos and benchmarks: the RL lifecycle's HTTP contract by
version as docs/sglang-conformance.md reads it from the wheels (0.5.6, 0.5.15.post1, 0.5.20, 0.5.21,
0.5.23), memory accounting per GPU and region, data-parallel ranks, and the same failures (the process
dies where SGLang dies; 0.5.6 hangs where its scheduler dies unnoticed). Run: `python -m rljob.emulator`."""
