"""No document names a path of one machine (a checkout, a home directory, a helper's notes): a reader's
machine has none of them. Commands may still write scratch files under /tmp."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MACHINE_PATH = re.compile(r"(?<![\w.~<$-])/(?:work|root|home|Users)/[\w.-]+")


def documents() -> list[Path]:
    skip = {".venv", ".git", ".cluster", "node_modules"}
    return sorted(p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts))


def test_no_document_names_a_path_of_one_machine() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{n}: {m.group(0)}"
        for p in documents()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        for m in MACHINE_PATH.finditer(line)
    ]
    assert len(documents()) > 10
    assert found == []


def test_the_pattern_finds_what_it_names() -> None:
    assert MACHINE_PATH.search("in the notes (`/work/notes/client-sequences.md`)")
    assert MACHINE_PATH.search("log /root/.cache/rljob/bin")
    assert not MACHINE_PATH.search("~/.cache/rljob/bin, http://host/work/x, .cluster/work/a, /tmp/s.json")
