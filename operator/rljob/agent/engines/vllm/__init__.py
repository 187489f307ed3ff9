"""vLLM behind the agent: its HTTP client and version quirks, its launch facts, the checks of its weight
pushes, and its framework endpoint. Every behaviour is cited to a row of docs/vllm-conformance.md."""
