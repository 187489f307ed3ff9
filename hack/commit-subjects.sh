#!/usr/bin/env bash
# Commit subjects say what changed in at most 72 characters; details go in the body.
# Checks every commit after SINCE (the last commit before the rule was enforced), or HEAD alone when a
# shallow clone does not hold SINCE.
set -euo pipefail
SINCE=${SINCE:-6e4e5ce}
MAX=${MAX:-72}
if git cat-file -e "$SINCE^{commit}" 2>/dev/null; then
  range="$SINCE..HEAD"
else
  range="-1"
fi
long=$(git log --format='%h %s' $range | awk -v max="$MAX" 'length($0) - index($0, " ") > max')
if [ -n "$long" ]; then
  echo "commit subjects over $MAX characters (put the details in the body):" >&2
  echo "$long" >&2
  exit 1
fi
