"""SGLang behind the agent: its HTTP client and version quirks, the checks of its tensor payloads, and its
framework endpoint. Every behaviour is cited to a row of docs/sglang-conformance.md."""
