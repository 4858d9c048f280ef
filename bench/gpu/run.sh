#!/usr/bin/env bash
# One run on a GPU machine with torch and no network: install prefixd from the kit beside this
# script (bench/gpu/kit.sh builds it), run the CUDA tests, the GPU benchmark (verified loads from
# the region into device memory against a plain pinned host-to-device copy of the same bytes;
# stores from device memory) and the bench/limits.py rows a 2-core VM cannot judge, and print one
# JSON object. Each step has a time limit (60 + 90 + 180 + 120 s), so the whole run ends within
# 8 minutes whatever hangs (about 2.5 on a 2-core VM without a GPU); a step that fails is
# reported in the JSON and the others still run.
#
#   bench/gpu/run.sh                  # installs into the environment of `python3` (or $PYTHON)
#   bench/gpu/run.sh --installed      # prefixd already installed there: no install step
#   bench/gpu/run.sh --quick          # small sizes: the shape of the run, in about a minute
#
# Without CUDA the same run works on the CPU (the CUDA tests are skipped and the benchmark reports
# its CPU figures): that is how it is tried before a GPU is lent. The steps run outside the
# checkout, so the prefixd they test is the installed one, never the checkout's sources. Where $OUT
# is set, the JSON and each step's log are also written there.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-python3}
install=1
quick=0
while [ $# -gt 0 ]; do
    case $1 in
        --installed) install=0; shift ;;
        --quick) quick=1; shift ;;
        *) echo "run.sh: unknown argument $1 (--installed, --quick)" >&2; exit 2 ;;
    esac
done
work=$(mktemp -d "${TMPDIR:-/tmp}/prefixd-gpu-kit.XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$(date +%s.%N)

# step NAME LIMIT_S COMMAND...: run it in $work, its standard output in $work/NAME.out and its
# errors in NAME.log, its exit status, start and end in NAME.status (124: stopped at its limit)
step() {
    local name=$1 limit=$2
    shift 2
    local t0 rc
    t0=$(date +%s.%N)
    (cd "$work" && timeout --kill-after=10 "$limit" "$@") >"$work/$name.out" 2>"$work/$name.log"
    rc=$?
    echo "$rc $t0 $(date +%s.%N)" >"$work/$name.status"
}

if [ "$install" = 1 ]; then
    step install 60 "$python" -m pip install --no-index --no-cache-dir --find-links "$here/wheels" \
        prefixd
fi

# The CUDA tests, from a copy of the suite (no checkout on the path: the installed prefixd).
mkdir -p "$work/suite"
cp -r "$root/tests" "$root/pyproject.toml" "$work/suite/"
# (not the engines' own: they run in the engines' venvs, with vLLM, SGLang or LMCache, which the
# kit lacks; the vLLM spec's device copies run here, tests/integrations/test_vllm_copies.py)
mapfile -t cuda_files < <(cd "$work/suite" && grep -rl --include='*.py' 'mark.cuda' tests \
    | grep -v -E '^tests/(integrations/(vllm|sglang|lmcache)|poison)/' | sort)
step cuda_tests 90 "$python" -m pytest -q -p no:cacheprovider -m cuda --rootdir "$work/suite" \
    --junitxml "$work/cuda_tests.xml" "${cuda_files[@]/#/$work/suite/}"

if [ "$quick" = 1 ]; then
    gpu_sizes=(--quick)
    limit_sizes=(--quick)
else
    gpu_sizes=(--repeat 3)
    limit_sizes=()
fi
step gpu_bench 180 "$python" "$root/bench/gpu_bench.py" --json --dir "$work" "${gpu_sizes[@]}"
# the rows a 2-vCPU VM cannot judge: a socket round trip there costs more than a raw LMDB put,
# freed memory goes back to the host, and every load shares two cores (bench/limits.py)
step limits 120 "$python" "$root/bench/limits.py" --json --dir "$work" "${limit_sizes[@]}" \
    --only put_roots,put_64,durable_put,lookup,load_clients

"$python" "$here/report.py" "$work" "$started" "$install" "$quick"
