"""The image's packages that a pack relies on, against what the pack's packages require of them
(image-requirements.txt: name, specifier, who requires it). A mismatch matters only where that module is
imported: the report names who requires it. Run by hack/real-sglang/unpack.sh and hack/real-vllm/unpack.sh
with the image's Python."""

import sys
from importlib.metadata import PackageNotFoundError, version

try:
    from packaging.specifiers import SpecifierSet
except ImportError:
    sys.exit("unpack.sh: no 'packaging' in the image; image versions not checked")
bad = 0
for line in open(sys.argv[1]):
    name, spec, by = line.rstrip("\n").split("\t")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have is None or (spec != "*" and not SpecifierSet(spec).contains(have, prereleases=True)):
        bad += 1
        print(f"unpack.sh: image {name} {have or 'missing'}, wanted {spec} by {by}")
print(f"unpack.sh: image packages checked, {bad} outside what the pack's packages ask")
