"""A faithful SGLang server emulator for tests, demos and benchmarks: the HTTP contract of the RL lifecycle
routes by version (see shared/reference/sglang-contract.md), memory accounting per GPU and region, and the
same fatal failures (the process dies where SGLang's scheduler asserts). Run: `python -m rljob.emulator`."""
