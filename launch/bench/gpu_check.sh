#!/usr/bin/env bash
# One-shot GPU check of dtensor on a machine with one NVIDIA GPU.
#
#   bash launch/bench/gpu_check.sh [--out DIR] [--venv DIR] [--wheelhouse DIR] [--budget S]
#   bash launch/bench/gpu_check.sh --fetch-wheels DIR     (on a machine with a package index)
#
# Run from anywhere; it works in the repository root. Steps, each under its own timeout and
# all of them under one overall budget (default 540 s), continuing past a failing step:
#   1. nvidia-smi and the python in use;
#   2. a virtual environment (--venv, default $TMPDIR/dtensor-gpu-venv, made with
#      the base python's packages visible, so a preinstalled cupy is used) and `pip install -e
#      ".[gpu,test]"`; offline, --wheelhouse DIR serves the wheels (`--no-index`). When the
#      gpu extra cannot be installed (no index, or the machine's CUDA needs another cupy
#      build), dtensor is installed without dependencies, the rest from the wheelhouse,
#      and the cupy already on the machine is used; the log says so;
#   3. `python -m launch --info` (MPI library, CUDA-awareness, cupy, GPUs);
#   4. tests/mpi/distributed/test_gpu.py with DTENSOR_TEST_DEVICE=cuda at 1 rank, then 2 ranks
#      sharing the GPU;
#   5. the small-op benchmark (`python -m launch.bench.small_ops --device cuda`) and the
#      redistribute benchmark (`python -m launch.bench.redistribute --device cuda --sizes
#      8 8192`) at 2 ranks, JSON into the output folder.
# Output folder: --out, else $OUT, else ./gpu_results; five files: steps.log (every
# step's output), the two JSON documents, and summary.txt / summary.json (step, exit code,
# seconds, ok|failed|timeout|skipped). The exit code is 0 only when every step passed.
#
# --fetch-wheels DIR downloads (for python 3.12 on x86-64 Linux, the GPU image's python)
# the wheels an offline GPU machine lacks: mpich, mpi4py, pytest-mpi and their deps.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2

OUTDIR="${OUT:-$ROOT/gpu_results}"
VENV="${TMPDIR:-/tmp}/dtensor-gpu-venv"
WHEELHOUSE=""
BUDGET="${GPU_CHECK_BUDGET:-540}"
BASE_PYTHON="${PYTHON:-python3}"
FETCH=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUTDIR="$2"; shift 2 ;;
        --venv) VENV="$2"; shift 2 ;;
        --wheelhouse) WHEELHOUSE="$(cd "$2" && pwd)"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --fetch-wheels) FETCH="$2"; shift 2 ;;
        -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
    esac
done

if [ -n "$FETCH" ]; then
    mkdir -p "$FETCH"
    exec timeout 300 "$BASE_PYTHON" -m pip download --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d "$FETCH" mpich mpi4py pytest-mpi
fi

mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
SUMMARY="$OUTDIR/summary.txt"
LOG="$OUTDIR/steps.log"  # every step's output, one after another
STEPLOG="$(mktemp)"
: > "$SUMMARY"
: > "$LOG"
ROWS=()
FAILED=0
START=$(date +%s)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

# step NAME TIMEOUT_S COMMAND...: run with min(TIMEOUT_S, budget left), log into steps.log
step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    local status rc=0 t0 secs
    if [ "$left" -lt 15 ]; then
        status=skipped rc=-1 secs=0
        echo "==== $name: skipped (budget spent)" | tee -a "$LOG"
    else
        [ "$limit" -gt "$left" ] && limit=$left
        echo "==== $name (timeout ${limit}s): $*" | tee -a "$LOG"
        t0=$(date +%s)
        timeout --kill-after=10 "$limit" "$@" > "$STEPLOG" 2>&1
        rc=$?
        cat "$STEPLOG" >> "$LOG"
        secs=$(($(date +%s) - t0))
        if [ $rc -eq 0 ]; then status=ok
        elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=timeout
        else status=failed
        fi
        tail -n 5 "$STEPLOG" | sed 's/^/   | /'
    fi
    [ "$status" = ok ] || FAILED=1
    printf '%-22s %-8s rc=%-4s %4ss\n' "$name" "$status" "$rc" "$secs" | tee -a "$SUMMARY"
    ROWS+=("{\"step\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $secs}")
    return 0
}

# 1. the machine
step nvidia_smi 30 nvidia-smi
step base_python 30 "$BASE_PYTHON" -c \
    "import sys, numpy; print(sys.version); print('numpy', numpy.__version__)"

# 2. environment: venv and install
install() {
    set -x
    [ -x "$VENV/bin/python" ] || "$BASE_PYTHON" -m venv --system-site-packages "$VENV" || return 1
    local py="$VENV/bin/python"
    # The base python may itself be a venv (the GPU image's is), whose packages a nested
    # venv does not see: list its site folders in a .pth file, after the venv's own.
    "$BASE_PYTHON" -c "import sysconfig; p = sysconfig.get_paths()
print(p['purelib']); print(p['platlib'])" \
        > "$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_base_site.pth" \
        || return 1
    local pipopts=(--retries 0 --timeout 15 --no-build-isolation)
    [ -n "$WHEELHOUSE" ] && pipopts+=(--no-index --find-links "$WHEELHOUSE")
    if "$py" -m pip install "${pipopts[@]}" -e ".[gpu,test]"; then
        echo "installed .[gpu,test]"
    else
        echo "NOTE: .[gpu,test] is not installable here; dtensor without deps, the test deps"
        echo "      from the index or the wheelhouse, cupy from the machine"
        "$py" -m pip install "${pipopts[@]}" --no-deps -e . || return 1
        "$py" -m pip install "${pipopts[@]}" mpi4py pytest-mpi || return 1
    fi
    # mpi4py loads the MPI library of the mpich wheel from the running prefix: a base
    # python's mpich is not found from the venv, so the venv gets its own
    "$py" -c "from mpi4py import MPI" ||
        "$py" -m pip install "${pipopts[@]}" --ignore-installed --no-deps mpich || return 1
    "$py" -c "import cupy, mpi4py, pytest_mpi, dtensor, fastpath
print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())
print('mpi4py', mpi4py.__version__, 'fastpath', fastpath.AVAILABLE)"
}
export BASE_PYTHON VENV WHEELHOUSE
export -f install
step install 300 bash -c install
PY="$VENV/bin/python"
[ -x "$PY" ] || PY="$BASE_PYTHON"
MPIEXEC="$("$PY" -c 'from launch._mpiexec import find_mpiexec; print(find_mpiexec())' \
    2>/dev/null || command -v mpiexec || echo mpiexec)"
echo "python: $PY  mpiexec: $MPIEXEC" | tee -a "$SUMMARY"

# 3. what the installation runs on (MPI, CUDA-awareness, GPU, comm path)
step launch_info 60 "$PY" -m launch --info

# 4. GPU tests: 1 rank, then 2 ranks sharing the GPU
for n in 1 2; do
    step "tests_gpu_${n}rank" 150 env DTENSOR_TEST_DEVICE=cuda \
        "$MPIEXEC" -n "$n" "$PY" -m pytest tests/mpi/distributed/test_gpu.py --with-mpi -q \
        -p no:cacheprovider -p no:benchmark
done

# 5. benchmarks on the GPU, 2 ranks, JSON out
step bench_small_ops 120 "$MPIEXEC" -n 2 "$PY" -m launch.bench.small_ops --device cuda \
    --out "$OUTDIR/small_ops_cuda.json"
step bench_redistribute 240 "$MPIEXEC" -n 2 "$PY" -m launch.bench.redistribute --device cuda \
    --sizes 8 8192 --repeat 11 --out "$OUTDIR/redistribute_cuda.json"

TOTAL=$(($(date +%s) - START))
{
    echo "{\"total_seconds\": $TOTAL, \"all_ok\": $([ $FAILED -eq 0 ] && echo true || echo false),"
    echo " \"steps\": ["
    for i in "${!ROWS[@]}"; do
        sep=","
        [ "$i" -eq $((${#ROWS[@]} - 1)) ] && sep=""
        echo "  ${ROWS[$i]}$sep"
    done
    echo " ]}"
} > "$OUTDIR/summary.json"
echo "total ${TOTAL}s; results in $OUTDIR" | tee -a "$SUMMARY"
rm -f "$STEPLOG"
exit $FAILED
