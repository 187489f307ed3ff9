from __future__ import annotations

from rljob.emulator.vllm.server import main

if __name__ == "__main__":
    main()
