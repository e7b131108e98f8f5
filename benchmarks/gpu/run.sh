#!/usr/bin/env bash
# The one prepared GPU check (docs/scale.md, "The GPU check"): an opd-train run per row on one GPU,
# summed up in ONE markdown table (benchmarks/gpu/check.py says the rows).
#
#   bash benchmarks/gpu/fetch_wheels.sh                        # here, once: hydra-core, omegaconf, antlr4 (py3.12 wheels)
#   bash benchmarks/gpu/run.sh --out $OUT/gpu_check.md         # on the GPU machine (carry benchmarks/gpu/wheels)
#   bash benchmarks/gpu/run.sh --cpu --out /tmp/gpu_check.md   # dry run: the same sequence, tiny, on CPU (CI)
#
# On the GPU it installs the carried wheels (pip install --no-index --find-links), then opd-exp
# (pip install --no-deps -e .; where the image's setuptools cannot build it, the checkout through
# PYTHONPATH), and runs the check in about 5 minutes (it starts no row past 360 s). --cpu
# installs nothing: the environment already holds everything. The table goes to --out (default
# $OUT/gpu_check.md), each run's command and stderr beside it (gpu_check.log).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
MODE=gpu
OUTFILE=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) MODE=cpu ;;
        --out) OUTFILE="${2:?--out needs a path}"; shift ;;
        --out=*) OUTFILE="${1#--out=}" ;;
        -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "run.sh: error: unknown argument '$1'; allowed: --cpu, --out PATH" >&2; exit 2 ;;
    esac
    shift
done
OUTFILE="${OUTFILE:-${OUT:-.}/gpu_check.md}"
started=$(date +%s)
args=(--out "$OUTFILE")
if [ "$MODE" = cpu ]; then
    args+=(--cpu)
    "$PY" benchmarks/gpu/check.py --travel || echo "run.sh: what travels to the GPU machine is over 64 MiB (above)"
else
    wheels=(benchmarks/gpu/wheels/*.whl)
    if [ ! -e "${wheels[0]}" ]; then
        echo "run.sh: error: no wheels in benchmarks/gpu/wheels; allowed: bash benchmarks/gpu/fetch_wheels.sh first, and carry benchmarks/gpu/wheels" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --find-links benchmarks/gpu/wheels hydra-core omegaconf antlr4-python3-runtime
    if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/tmp/opd-pip-e.log 2>&1; then
        echo "run.sh: pip install --no-deps -e . failed ($(tail -1 /tmp/opd-pip-e.log)); the checkout goes on PYTHONPATH instead"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "import hydra, omegaconf, opd_exp.cli.train" || { echo "run.sh: error: opd-exp does not import (above)" >&2; exit 2; }
    echo "run.sh: installed in $(($(date +%s) - started)) s"
fi
set +e
"$PY" benchmarks/gpu/check.py "${args[@]}"
code=$?
echo "run.sh: done in $(($(date +%s) - started)) s (exit $code)"
exit $code
