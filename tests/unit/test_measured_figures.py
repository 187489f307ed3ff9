"""The README's "Measured" table says what its pages say: each row's figure appears word for word (whitespace
aside) on the page its link names (docs/benchmarks.md or tests/gpu/RESULTS.md), and the link's anchor is a
heading of that page. A figure changed in the README or on its page, and not in the other, fails here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = ("docs/benchmarks.md", "tests/gpu/RESULTS.md")
HEADING = "## Measured"
LINK = re.compile(r"\[[^\]]+\]\(([^)#\s]+)(?:#([^)\s]+))?\)")


@dataclass(frozen=True)
class Row:
    what: str
    figure: str
    page: str  # the linked page, relative to the repository
    anchor: str | None


def measured_rows(readme: str) -> list[Row]:
    """The rows of the table in the README's "Measured" section (header and rule aside)."""
    lines = readme.splitlines()
    start = lines.index(HEADING) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    rows = []
    for line in lines[start:end]:
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        link = LINK.search(cells[-1]) if len(cells) == 3 else None
        if link is None:
            continue  # the header and the rule
        rows.append(Row(cells[0], cells[1], link.group(1), link.group(2)))
    return rows


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def anchors(page: str) -> set[str]:
    """GitHub's anchors of a Markdown page's headings: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for heading in re.findall(r"(?m)^#+ (.+)$", page):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
        found.add(slug.replace(" ", "-"))
    return found


def unmatched(readme: str, pages: dict[str, str]) -> list[str]:
    """Each row whose figure is not on its page word for word, or whose anchor is not a heading there."""
    missing = []
    for row in measured_rows(readme):
        page = pages.get(row.page)
        if page is None:
            missing.append(f"{row.what}: links {row.page}, not a results page ({', '.join(PAGES)})")
        elif _flat(row.figure) not in _flat(page):
            missing.append(f"{row.what}: figure not in {row.page} word for word: {row.figure!r}")
        elif row.anchor is not None and row.anchor not in anchors(page):
            missing.append(f"{row.what}: #{row.anchor} is not a heading of {row.page}")
    return missing


def _texts() -> tuple[str, dict[str, str]]:
    return README.read_text(), {p: (ROOT / p).read_text() for p in PAGES}


def test_every_measured_figure_is_on_its_page_word_for_word() -> None:
    readme, pages = _texts()
    rows = measured_rows(readme)
    assert len(rows) >= 5, f"the README's Measured table has {len(rows)} rows"
    assert all(re.search(r"\d", r.figure) for r in rows), "a Measured row without a figure"
    assert {r.page for r in rows} == set(PAGES)
    assert unmatched(readme, pages) == []


def _bump(text: str) -> str:
    """`text` with its first digit changed."""
    return re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), text, count=1)


def test_a_changed_figure_fails_the_rule() -> None:
    """The rule catches one digit changed in the README's row, and the same figure changed on its page
    instead (wherever the page says it)."""
    readme, pages = _texts()
    for row in measured_rows(readme):
        changed = _bump(row.figure)
        found = unmatched(readme.replace(f"| {row.figure} |", f"| {changed} |", 1), pages)
        assert len(found) == 1 and repr(changed) in found[0], (row, found)
        said = re.compile(r"\s+".join(map(re.escape, row.figure.split())))  # as the page wraps it
        page = said.sub(lambda m: _bump(m.group()), pages[row.page])
        assert page != pages[row.page]
        assert len(unmatched(readme, {**pages, row.page: page})) == 1, row


def test_rows_links_and_anchors_are_read_as_written() -> None:
    readme = "\n".join(
        [
            "# x",
            HEADING,
            "",
            "Prose 1.",
            "",
            "| what | figure | conditions |",
            "|---|---|---|",
            "| A | 1.5 ms at 64 pods | [b](docs/benchmarks.md#the-runs-at-64-pods) |",
            "| B | 3 MiB | [g](tests/gpu/RESULTS.md) |",
            "## Next",
            "| C | 9 | [b](docs/benchmarks.md) |",
        ]
    )
    assert measured_rows(readme) == [
        Row("A", "1.5 ms at 64 pods", "docs/benchmarks.md", "the-runs-at-64-pods"),
        Row("B", "3 MiB", "tests/gpu/RESULTS.md", None),
    ]
    pages = {
        "docs/benchmarks.md": "## The runs (at 64 pods)\n1.5 ms at 64\npods",
        "tests/gpu/RESULTS.md": "3 MiB",
    }
    assert unmatched(readme, pages) == []
    assert unmatched(readme, {**pages, "docs/benchmarks.md": "## Other\n1.5 ms at 64 pods"}) == [
        "A: #the-runs-at-64-pods is not a heading of docs/benchmarks.md"
    ]
    assert unmatched(readme, {**pages, "tests/gpu/RESULTS.md": "3 GiB"}) == [
        "B: figure not in tests/gpu/RESULTS.md word for word: '3 MiB'"
    ]
