#!/usr/bin/env bash
# Build the kit bench/gpu/run.sh installs from, on a machine with network: prefixd's wheel and the
# wheels of everything it needs at run time, for the GPU machine's Python and platform, at the
# versions this checkout's environment runs (its `pip freeze` as constraints).
#
#   bench/gpu/kit.sh                       # for CPython 3.12 on manylinux x86_64
#   bench/gpu/kit.sh --python-version 3.11 # for this machine's Python (to try run.sh here)
#
# The wheels land in bench/gpu/wheels/ (git ignores it); the whole kit is about 30 MB.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-"$root/.venv/bin/python"}
version=3.12
while [ $# -gt 0 ]; do
    case $1 in
        --python-version) version=$2; shift 2 ;;
        *) echo "kit.sh: unknown argument $1 (--python-version X.Y)" >&2; exit 2 ;;
    esac
done
wheels=$here/wheels
rm -rf "$wheels" && mkdir -p "$wheels"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$python" -m pip freeze --exclude-editable | grep -v -e '^prefixd' -e ' @ ' >"$constraints"
"$python" -m pip wheel -q --no-deps -w "$wheels" "$root"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$python" -m pip download -q --only-binary=:all: --implementation cp --python-version "$version" \
    "${platforms[@]}" -c "$constraints" -d "$wheels" "$wheels"/prefixd-*.whl
ls "$wheels"
du -sh "$wheels"
