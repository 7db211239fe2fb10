#!/usr/bin/env bash
# Run several GPU steps in one device-tool call, each with its own time limit and log, and bundle
# every log and result file into one archive (the device tool returns at most 8 files).
#
#   STEPS="gpu_suite bench_logits" bash scripts/gpu_run.sh
#
# Steps (each is one command below; PYTHONPATH=src, the baselines' wheels from .whl/ when carried:
# liger-kernel, trl; installed --no-deps into /tmp/site):
#   pytest          the whole test suite on the GPU (tests that skip without CUDA run here)
#   gpu_suite       scripts/gpu_suite.sh: the tests marked gpu (real-size checks, tests/gpu), then
#                   the multi_gpu ones with >= 2 GPUs; logs + JUnit XML in results/gpu_suite/
#                   (its own limits are 480 s + 540 s: raise STEP_TIMEOUT to match)
#   consistency     scripts/gpu_consistency.sh         (rollout vs training log-probs, patched model)
#   bench_logits    rlkernel bench logits (~3-4 min on an H100: give it STEP_TIMEOUT=420)
#   bench_linear    rlkernel bench linear (~6-8 min on an H100: give it STEP_TIMEOUT=560)
#   bench_invariant rlkernel bench invariant (the long-context rows included: several minutes on an H100, the
#                   128k training steps ~1 min each; give it STEP_TIMEOUT=560, or BENCH_ARGS="--quick"
#                   for the short rows only)
#   bench_multigpu  rlkernel bench multigpu: one torchrun per GPU count (2, 4, ... up to those present;
#                   BENCH_ARGS="--gpus 2,4"), each killed after 240 s (give it STEP_TIMEOUT=420)
#   trl_trainer     scripts/trl_trainer_compare.py: RLKernelGRPOTrainer vs trl.GRPOTrainer, a few GRPO
#                   steps of a random-init 407 M Qwen3 (bf16, Triton backend), 3 settings; JSON in
#                   results/. Needs the wheels of trl, datasets, dill, multiprocess in .whl/ (~5 min
#                   on an H100: give it STEP_TIMEOUT=540). TRL_COMPARE_ARGS reaches it, e.g.
#                   "--precisions amp" (float32 weights under bf16 autocast) or "--settings defaults".
#   trl_on_policy   scripts/trl_true_on_policy.py: stock trl.GRPOTrainer vs RLKernelGRPOTrainer(true_on_policy=True),
#                   20 GRPO steps each of a random-init 500 M Qwen3 (bf16, vocabulary 151,936); table in the log,
#                   JSON + PNG in results/trl_true_on_policy/. Same wheels as trl_trainer (~3-4 min on an H100:
#                   give it STEP_TIMEOUT=420). TRL_ON_POLICY_ARGS reaches it, e.g. "--steps 30".
# BENCH_ARGS reaches the bench steps, e.g. the opt-in variants: BENCH_ARGS="--impl rlkernel,rlkernel_composed".
# Outputs: $OUT/gpu_run.tgz (logs/<step>.log and results/*), and a summary table at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
WORK="${OUT:-/tmp/gpu_run}/bundle"
mkdir -p "$WORK/logs" "$WORK/results"
export RESULTS_DIR="$WORK/results"
STEP_TIMEOUT="${STEP_TIMEOUT:-300}"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import transformers; print('transformers', transformers.__version__)" 2>/dev/null || true
  python3 -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" 2>/dev/null || true
  # The bench imports only trl.kernels (torch, triton, transformers, packaging): none of TRL's trainer deps.
  python3 -c "import trl.kernels as k, importlib.metadata as m; print('trl', m.version('trl'), 'trl.kernels:', ', '.join(k.__all__))" 2>&1 | tail -n 1 || true
  python3 -c "import datasets, pyarrow; print('datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)" 2>&1 | tail -n 1 || true
  echo "commit ${RLKERNEL_GIT_COMMIT:-unknown}"
} | tee "$WORK/logs/env.log"

step_cmd() {
  case "$1" in
    pytest) echo "python3 -m pytest ${PYTEST_PATHS:-tests} -q -p no:cacheprovider ${PYTEST_ARGS:-}" ;;
    gpu_suite) echo "env -u STEPS OUT=$RESULTS_DIR bash scripts/gpu_suite.sh" ;;  # its own STEPS
    consistency) echo "bash scripts/gpu_consistency.sh" ;;
    bench_*) echo "python3 -m rlkernel.bench ${1#bench_} --out $RESULTS_DIR ${BENCH_ARGS:-}" ;;
    # Offline: every model, tokenizer and dataset is made in-process (no hub look-ups to time out).
    trl_trainer) echo "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python3 scripts/trl_trainer_compare.py --out $RESULTS_DIR/trl_trainer_compare.json ${TRL_COMPARE_ARGS:-}" ;;
    trl_on_policy) echo "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python3 scripts/trl_true_on_policy.py --out $RESULTS_DIR/trl_true_on_policy ${TRL_ON_POLICY_ARGS:-}" ;;
    *) echo "false unknown-step-$1" ;;
  esac
}

declare -A RC SECS
for step in ${STEPS:?set STEPS}; do
  echo "=== $step ($(date -u +%H:%M:%S))"
  start=$(date +%s)
  # shellcheck disable=SC2046
  timeout "$STEP_TIMEOUT" bash -c "$(step_cmd "$step")" > "$WORK/logs/$step.log" 2>&1
  RC[$step]=$?
  SECS[$step]=$(( $(date +%s) - start ))
  tail -n "${TAIL_LINES:-40}" "$WORK/logs/$step.log"
done
tar -czf "${OUT:-/tmp/gpu_run}/gpu_run.tgz" -C "$WORK" logs results
echo "=== summary"
for step in ${STEPS}; do printf '%-16s rc=%-4s %4ss\n' "$step" "${RC[$step]}" "${SECS[$step]}"; done
