#!/usr/bin/env bash
# The one command to run on the GPU machine: every benchmark suite, with the environment (GPU,
# versions, commit) recorded in every row. Results go to $OUT/benchmarks/results when $OUT is set
# (the device tool's fetch folder: copy that tree over the repository's), else benchmarks/results;
# the full console output is also kept in <results>/gpu_bench.log.
#
#   bash scripts/gpu_bench.sh                      # full logits suite (~3-4 min on an H100)
#   QUICK=1 bash scripts/gpu_bench.sh              # fewer repetitions (~2-3 min)
#   BENCH_ARGS="--workload dapo_kl_fwd_bwd --impl rlkernel,liger" bash scripts/gpu_bench.sh
#
# Liger-Kernel and TRL are baselines only: if a .whl/ folder is present (carry it to the GPU machine; it
# is git-ignored), its wheels are installed into /tmp/site without dependencies or network access (the
# bench imports only trl.kernels, which needs no TRL dependency beyond torch, triton, transformers). The
# package itself is imported from src/, so no installation is needed. Without git on the GPU machine,
# pass the commit in: RLKERNEL_GIT_COMMIT=<sha> bash scripts/gpu_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# Fewer fragmentation OOMs when plain-torch baselines (tens of GB of fp32 temporaries) and the fused
# kernels alternate in one process; it changes no kernel. Recorded in the JSON meta.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"

if [[ -n "${OUT:-}" ]]; then OUT_DIR="$OUT/benchmarks/results"; else OUT_DIR="benchmarks/results"; fi
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_bench.log") 2>&1
ARGS=()
if [[ "${QUICK:-0}" != "0" ]]; then ARGS+=(--quick); fi
# shellcheck disable=SC2206  # BENCH_ARGS is meant to be word-split
ARGS+=(${BENCH_ARGS:-})

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv || true
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"

start=$(date +%s)
status=0
for suite in ${SUITES:-logits}; do
  python3 -m rlkernel.bench "$suite" --out "$OUT_DIR" ${ARGS[@]+"${ARGS[@]}"} || status=$?
done
echo "gpu_bench finished in $(( $(date +%s) - start )) s (exit $status); results in $OUT_DIR"
exit "$status"
