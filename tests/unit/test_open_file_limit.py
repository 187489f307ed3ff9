"""The operator raises its soft limit on open files to the hard one at start (controller/main.py): it holds
a channel per agent, and a gang may be 1,024 pods."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import resource
from rljob.controller.main import raise_open_file_limit
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
before, after = raise_open_file_limit()
print(before, after, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
"""


def test_the_soft_open_file_limit_rises_to_the_hard_one() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    before, after, now, hard = (int(v) for v in out.split())
    assert (before, after) == (256, now)
    assert now == hard or (hard == -1 and now > 256)  # -1: RLIM_INFINITY, raised to NOFILE_CEILING
