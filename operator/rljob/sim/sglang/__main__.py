from __future__ import annotations

from rljob.sim.sglang.server import main

if __name__ == "__main__":
    main()
