"""The engines the agent drives, one folder each (agent/engines/<name>/: its client, quirks, guards and
framework endpoint), behind the verbs of agent/engines/base.py."""
