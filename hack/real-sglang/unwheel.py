"""Unpack one wheel as pip would lay it into site-packages, less the paths that trim.txt drops.

    python3 hack/real-sglang/unwheel.py WHEEL DEST TRIM_FILE

`<name>.data/purelib` and `<name>.data/platlib` land at the top like pip puts them; the rest of `.data`
(scripts, headers, data) is left out: nothing on the import path reads it. Writes DEST.partial and renames
it to DEST, so DEST is either complete or absent.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import stat
import sys
import zipfile
from pathlib import Path


def trim_patterns(trim_file: Path, wheel: Path) -> list[str]:
    """The globs of trim.txt whose project (first column) is this wheel's."""
    project = wheel.name.split("-")[0].lower()
    patterns = []
    for line in trim_file.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and fields[0].replace("-", "_").lower() == project:
            patterns.append(fields[1])
    return patterns


def target_path(name: str) -> str | None:
    first, _, rest = name.partition("/")
    if first.endswith(".data"):
        kind, _, inner = rest.partition("/")
        return inner if kind in ("purelib", "platlib") and inner else None
    return name


def main() -> int:
    wheel, dest, trim_file = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    patterns = trim_patterns(trim_file, wheel)
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    dropped = 0
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            target = target_path(info.filename)
            if target is None:
                continue
            if any(fnmatch.fnmatch(target, pattern) for pattern in patterns):
                dropped += info.file_size
                continue
            out = partial / target
            out.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            if (info.external_attr >> 16) & stat.S_IXUSR:
                out.chmod(0o755)
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(partial, dest)
    if dropped:
        print(f"  {wheel.name}: trimmed {dropped / 2**20:.1f} MiB ({', '.join(patterns)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
