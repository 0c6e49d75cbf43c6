#!/usr/bin/env bash
# Every GPU measurement of attnlab in one run, one JSON file and one log archive: benchmarks/gpu_suite.py does the
# work (steps, budget, deadlines, the JSON rewritten as it goes); this wrapper picks the Python that holds PyTorch
# (python3 first: on the GPU machine a plain `python` may not be it) and runs it in the repository root, in place
# of this shell, so that a SIGTERM reaches it. Nothing to install:
#
#   bash benchmarks/gpu_suite.sh [OUT.json]                  # default $OUT/gpu_suite.json, else ./gpu_suite.json
#   GPU_SUITE_STEPS=variants,ns_compiled bash benchmarks/gpu_suite.sh      # a second call: those steps only
#   bash benchmarks/gpu_suite.sh --dry-run                   # every step tiny on the CPU (or GPU_SUITE_DRY=1)
#   bash benchmarks/gpu_suite.sh --list                      # the steps and their estimates
#
# Steps, estimates, targets and the device commands: docs/perf.md, "GPU suite".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python || true)}
if [[ -z $PY ]]; then echo "gpu_suite: no python3 or python on PATH; set PYTHON" >&2; exit 2; fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_suite.py "$@"
