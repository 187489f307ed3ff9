# Sourced by hack/real-sglang/pack.sh and hack/real-vllm/pack.sh: the steps both packs take alike.
# Needs HERE (the pack's folder: requirements.in, overrides.txt, closure.txt, trim.txt), CACHE, RELOCK.

TOOLS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # plan.py, unwheel.py, image-packages.txt
UV_VERSION=0.13.9

# The tools venv (uv, packaging): sets PY and PLAN.
pack_tools() {
  local tools=$CACHE/tools
  if [[ ! -x $tools/bin/uv ]] || ! "$tools/bin/python" -I -c 'import packaging' 2>/dev/null; then
    python3 -m venv "$tools"
    "$tools/bin/pip" install -q "uv==$UV_VERSION" packaging
  fi
  PY=$tools/bin/python
  PLAN=("$PY" "$TOOLS_DIR/plan.py")
  # 1. The closure for CPython 3.12 on x86_64 manylinux_2_34, binary wheels only.
  if [[ $RELOCK == 1 || ! -f $HERE/closure.txt ]]; then
    (cd "$HERE" && "$tools/bin/uv" pip compile -q requirements.in --override overrides.txt \
      --python-version 3.12 --python-platform x86_64-manylinux_2_34 --only-binary :all: -o closure.txt)
  fi
}

# 2. What the image lacks (or has at another version than requirements.in pins), and its wheels; 3. each
# wheel unpacked once as pip lays it out, less trim.txt's paths (the folder's name carries a hash of its
# trim lines, so a changed rule unpacks it again). Sets WORK, WHEELS and DIR_OF (project -> folder).
pack_wheels() {
  WORK=$CACHE/work
  mkdir -p "$WORK" "$CACHE/wheels" "$CACHE/unpacked"
  "${PLAN[@]}" select "$HERE/closure.txt" "$TOOLS_DIR/image-packages.txt" "$HERE/requirements.in" > "$WORK/pack.txt"
  "${PLAN[@]}" missing "$WORK/pack.txt" "$CACHE/wheels" > "$WORK/missing.txt"
  if [[ -s $WORK/missing.txt ]]; then
    local platforms=() minor
    for minor in 34 28 27 26 24 17 5; do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
    python3 -m pip download -q --no-deps --only-binary :all: -d "$CACHE/wheels" -r "$WORK/missing.txt" \
      --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
      "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  fi
  mapfile -t WHEELS < <("${PLAN[@]}" wheels "$WORK/pack.txt" "$CACHE/wheels")
  "${PLAN[@]}" check-tags "${WHEELS[@]}"
  declare -gA DIR_OF=()
  local wheel project rules dir
  for wheel in "${WHEELS[@]}"; do
    project=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
    rules=$(awk -v p="$project" '!/^#/ && tolower($1) == p {print $1, $2}' "$HERE/trim.txt" | sha256sum | cut -c1-8)
    dir=$CACHE/unpacked/$(basename "$wheel" .whl)-$rules
    [[ -d $dir ]] || "$PY" "$TOOLS_DIR/unwheel.py" "$wheel" "$dir" "$HERE/trim.txt"
    DIR_OF[$project]=$dir
  done
}
