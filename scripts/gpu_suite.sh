#!/usr/bin/env bash
# The GPU test suite in one device call: every test marked `gpu` (the real-size checks of tests/gpu
# and the CUDA-only tests elsewhere), then, with 2 or more GPUs, the `multi_gpu` tests (NCCL under
# torchrun). Exits non-zero if any step fails, runs out of time, or collects no test.
#
#   bash scripts/gpu_suite.sh                          # on the GPU machine (H100: a few minutes)
#   ALL=1 bash scripts/gpu_suite.sh                    # the whole tests/ tree instead of -m gpu
#   PYTEST_ARGS="-k linear -x" bash scripts/gpu_suite.sh   # word-split: no quoted spaces
#   STEPS=multi_gpu bash scripts/gpu_suite.sh          # only the multi-GPU step
#
# Outputs in $OUT/gpu_suite (else /tmp/gpu_suite): env.log, <step>.log, <step>.xml (JUnit) and
# summary.txt, which is also printed at the end. The steps time out after GPU_TIMEOUT s (default 480)
# and MULTI_GPU_TIMEOUT s (540: three torchrun runs on 2 GPUs, six with 4); with pytest-timeout installed
# each test also has TEST_TIMEOUT s (300).
# Without a GPU: RLKERNEL_GPU_SMOKE=1 bash scripts/gpu_suite.sh runs the same tests tiny on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
DIR="${OUT:-/tmp}/gpu_suite"
mkdir -p "$DIR"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda devices', torch.cuda.device_count())"
  echo "commit ${RLKERNEL_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
} 2>&1 | tee "$DIR/env.log"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [[ "$GPUS" -lt 1 && "${RLKERNEL_GPU_SMOKE:-0}" == "0" ]]; then
  echo "gpu_suite: no CUDA device here; RLKERNEL_GPU_SMOKE=1 runs the suite tiny on the CPU" >&2
  exit 2
fi
PER_TEST=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PER_TEST=(--timeout "${TEST_TIMEOUT:-300}"); fi

declare -A RC SECS
RAN=()
run_step() {  # run_step NAME LIMIT PYTEST-ARGS...
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): pytest $*"
  local start=$SECONDS
  RAN+=("$name")
  # shellcheck disable=SC2086  # PYTEST_ARGS is meant to be word-split
  timeout -k 20 "$limit" "$PY" -m pytest "$@" -p no:cacheprovider -q -rfEsxX --durations=15 \
    --junitxml="$DIR/$name.xml" ${PER_TEST[@]+"${PER_TEST[@]}"} ${PYTEST_ARGS:-} > "$DIR/$name.log" 2>&1
  RC[$name]=$?
  SECS[$name]=$((SECONDS - start))
  tail -n "${TAIL_LINES:-30}" "$DIR/$name.log"
}

for step in ${STEPS:-gpu multi_gpu}; do
  case "$step" in
    gpu)
      if [[ "${ALL:-0}" != "0" ]]; then
        run_step gpu "${GPU_TIMEOUT:-480}" tests -m "not multi_gpu"
      else
        run_step gpu "${GPU_TIMEOUT:-480}" tests -m gpu
      fi
      ;;
    multi_gpu)
      if [[ "$GPUS" -ge 2 || "${RLKERNEL_GPU_SMOKE:-0}" != "0" ]]; then
        run_step multi_gpu "${MULTI_GPU_TIMEOUT:-540}" tests/multi_gpu -m multi_gpu
      else
        echo "=== multi_gpu: skipped ($GPUS CUDA device(s); needs 2)"
      fi
      ;;
    *) echo "unknown step '$step' (steps: gpu multi_gpu)"; RAN+=("$step"); RC[$step]=2; SECS[$step]=0 ;;
  esac
done

# One line per step from its JUnit file (pytest exit 5 = nothing collected: a failure here too).
{
  echo "=== GPU suite summary ($(head -n 1 "$DIR/env.log"))"
  status=0
  for step in ${RAN[@]+"${RAN[@]}"}; do
    counts=$("$PY" - "$DIR/$step.xml" <<'EOF' 2>/dev/null || echo "no JUnit report"
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(", ".join(f"{v} {k}" for k, v in total.items()))
for s in suites:
    for case in s.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            print(f"    FAILED {case.get('classname')}::{case.get('name')}")
EOF
)
    rc=${RC[$step]}
    case $rc in
      0) verdict=PASS ;;
      124|137) verdict="FAIL (time limit)" ;;
      5) verdict="FAIL (no tests collected)" ;;
      *) verdict="FAIL (exit $rc)" ;;
    esac
    [[ $rc -eq 0 ]] || status=1
    printf '%-10s %-26s %5ss  %s\n' "$step" "$verdict" "${SECS[$step]}" "$counts"
  done
  if [[ $status -eq 0 ]]; then echo "GPU SUITE PASSED"; else echo "GPU SUITE FAILED"; fi
  exit $status
} 2>&1 | tee "$DIR/summary.txt"
exit "${PIPESTATUS[0]}"
