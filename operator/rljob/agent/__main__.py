from __future__ import annotations

from rljob.agent.main import main

main()
