"""The README's "Measured" section says what docs/benchmarks.md and tests/gpu/RESULTS.md say, word for word:
every bullet of it (its `Source:` line aside) appears in one of them, whitespace aside. A figure changed in
either place, and not in the other, fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = (ROOT / "docs/benchmarks.md", ROOT / "tests/gpu/RESULTS.md")
HEADING = "## Measured"


def measured_bullets(readme: str) -> list[list[str]]:
    """The bullets of the README's "Measured" section, each as its lines without the `Source:` line."""
    lines = readme.splitlines()
    start = lines.index(HEADING) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    bullets: list[list[str]] = []
    for line in lines[start:end]:
        if line.startswith("- "):
            bullets.append([line[2:].strip()])
        elif bullets and line.startswith("  ") and line.strip():
            if not line.strip().startswith("Source:"):
                bullets[-1].append(line.strip())
        elif line.strip():
            bullets.append([])  # prose between bullets ends the bullet before it
    return [b for b in bullets if b]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def unmatched(readme: str, pages: list[str]) -> list[str]:
    """The first README line of each bullet that no page holds word for word, with the line at which its
    bullet stops matching the page that holds most of it."""
    flat_pages = [_flat(page) for page in pages]
    missing = []
    for bullet in measured_bullets(readme):
        if any(_flat(" ".join(bullet)) in page for page in flat_pages):
            continue
        best = max(
            range(len(bullet) + 1),
            key=lambda n: n if any(_flat(" ".join(bullet[:n])) in p for p in flat_pages) else -1,
        )
        wrong = bullet[min(best, len(bullet) - 1)]
        missing.append(f"{bullet[0][:60]}...: first line not in docs/benchmarks.md or RESULTS.md: {wrong!r}")
    return missing


def _texts() -> tuple[str, list[str]]:
    return README.read_text(), [p.read_text() for p in PAGES]


def test_every_measured_bullet_is_on_a_results_page_word_for_word() -> None:
    readme, pages = _texts()
    bullets = measured_bullets(readme)
    assert len(bullets) >= 5, f"the README's Measured section has {len(bullets)} bullets"
    assert all(re.search(r"\d", " ".join(b)) for b in bullets), "a Measured bullet without a figure"
    assert unmatched(readme, pages) == []


def test_a_changed_figure_fails_the_rule() -> None:
    """The rule catches one digit changed in the README, and one changed on the results page instead."""
    readme, pages = _texts()
    for b, bullet in enumerate(measured_bullets(readme)):
        row = next(i for i, line in enumerate(bullet) if re.search(r"\d", line))
        line = bullet[row]
        changed = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), line, count=1)
        found = unmatched(readme.replace(line, changed, 1), pages)
        assert len(found) == 1 and repr(changed) in found[0], (b, found)
        page = next(i for i, p in enumerate(pages) if _flat(" ".join(bullet)) in _flat(p))
        figure = re.search(r"\d", _flat(line))
        assert figure is not None
        edited = list(pages)
        flat, whole = _flat(pages[page]), _flat(" ".join(bullet))
        at = flat.index(whole) + whole.index(_flat(line)) + figure.start()
        edited[page] = flat[:at] + str((int(flat[at]) + 1) % 10) + flat[at + 1 :]
        assert len(unmatched(readme, edited)) == 1, b


def test_source_lines_and_prose_are_not_figures_of_a_bullet() -> None:
    readme = "\n".join(
        [
            "# x",
            HEADING,
            "",
            "Intro prose 1.",
            "",
            "- **A** 1.5 ms at 64 pods",
            "  and 2 more.",
            "  Source: [docs/benchmarks.md](docs/benchmarks.md).",
            "- **B** 3 MiB.",
            "## Next",
            "- not measured 9",
        ]
    )
    assert measured_bullets(readme) == [["**A** 1.5 ms at 64 pods", "and 2 more."], ["**B** 3 MiB."]]
    assert unmatched(readme, ["- **A** 1.5 ms at 64\npods and 2 more.\n- **B** 3 MiB."]) == []
    assert unmatched(readme, ["- **A** 1.5 ms at 64 pods and 2 more."]) == [
        "**B** 3 MiB....: first line not in docs/benchmarks.md or RESULTS.md: '**B** 3 MiB.'"
    ]
