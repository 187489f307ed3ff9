"""vLLM's side of the trainer SDK: its packed IPC updates and its weights checksum, reproduced."""
