#!/usr/bin/env bash
# One device-tool call: the GPU test suite, or the benchmark.
#   STAGE=check bash scripts/gpu_session.sh    the GPU test suite (scripts/gpu_suite.sh)
#   STAGE=bench bash scripts/gpu_session.sh    the logits benchmark suite (scripts/gpu_bench.sh)
# Logs land in $OUT (the device tool's fetch folder) when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
LOG_DIR="${OUT:-/tmp}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
case "${STAGE:-check}" in
  check)
    OUT="$LOG_DIR" bash scripts/gpu_suite.sh
    ;;
  bench)
    bash scripts/gpu_bench.sh
    ;;
esac
