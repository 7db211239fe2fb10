#!/usr/bin/env bash
# One H100 shot (<= 5 minutes): rollout-vs-training consistency of the batch-invariant model patch, and
# the `invariant` benchmark suite.
#
#   PYTHONPATH=src bash scripts/gpu_consistency.sh            # on the GPU; results under $OUT (or /tmp)
#   bash scripts/gpu_consistency.sh --smoke                   # CPU, tiny sizes: checks the script only
#
# Sections (each under its own time limit; a failure prints FAIL and the script goes on):
#   1. rlkernel consistency --config anchor          (4 Qwen3 layers, hidden 1024, vocab 151936, bf16;
#                                                     32 seqs x 128 tokens, decode bs 1,32 vs prefill 8,32)
#   2. rlkernel bench invariant --quick              (GEMM / RMSNorm / attention / patched model; the full
#                                                     suite: gpu_run.sh step bench_invariant, ~2 min)
#   3. rlkernel consistency --config qwen3-8b-slice  (2 layers of Qwen3-8B's shapes; 16 seqs x 64 tokens)
# Outputs (RES = $RESULTS_DIR when scripts/gpu_run.sh sets it, else $OUT/results):
#   $RES/consistency_<config>.json and .txt, $RES/invariant.{csv,json,png}, one summary table at the end.
# SKIP_BENCH=1 leaves out section 2 (when the bench runs as its own step, e.g. gpu_run.sh bench_invariant).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/rlkernel_gpu_consistency}"
RES="${RESULTS_DIR:-$OUT/results}"
mkdir -p "$RES"
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1

section() {  # section NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@"
    local rc=$?
    if [ $rc -eq 0 ]; then
        echo "PASS $name ($((SECONDS - t0)) s)"
    else
        echo "FAIL $name: exit code $rc after $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo ' (time limit)')"
    fi
}

consistency() {  # consistency CONFIG LIMIT EXTRA_ARGS...
    local config=$1 limit=$2
    shift 2
    section "consistency $config" "$limit" bash -c \
        "set -o pipefail; $PY -m rlkernel.cli consistency --config $config --json $RES/consistency_$config.json $* \
         | tee $RES/consistency_$config.txt"
}

if [ $SMOKE = 1 ]; then
    consistency tiny 120 --device cpu --num-seqs 4 --gen-len 4 --prompt-len 4 \
        --decode-batch-sizes 1,4 --prefill-batch-sizes 2,4 --reps 1 --require-bitwise
    [ "${SKIP_BENCH:-0}" = 1 ] || \
        section "bench invariant (smoke)" 120 $PY -m rlkernel.bench invariant --smoke --rounds 1 --out "$RES"
    CONFIGS="tiny"
else
    "$PY" -c "import torch; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__)" || true
    consistency anchor "${ANCHOR_LIMIT:-300}" --device cuda --require-bitwise
    [ "${SKIP_BENCH:-0}" = 1 ] || section "bench invariant --quick" 110 $PY -m rlkernel.bench invariant --quick --out "$RES"
    consistency qwen3-8b-slice "${SLICE_LIMIT:-120}" --device cuda --num-seqs 16 --gen-len 64 \
        --decode-batch-sizes 1,16 --prefill-batch-sizes 4,16 --require-bitwise
    CONFIGS="anchor qwen3-8b-slice"
fi

echo
echo "=== summary"
RES="$RES" CONFIGS="$CONFIGS" "$PY" - <<'EOF'
import csv, json, os
from pathlib import Path

out = Path(os.environ["RES"])
print(f"{'config':<16} {'model':<10} {'worst pair (rollout vs training)':<34} {'max|dlogp|':>10} {'bitwise':>8}")
for config in os.environ["CONFIGS"].split():
    path = out / f"consistency_{config}.json"
    if not path.exists():
        print(f"{config:<16} FAIL: no result ({path.name} missing)")
        continue
    rep = json.loads(path.read_text())
    for variant in ("unpatched", "patched"):
        pairs = rep["results"][variant]["pairs"]
        if not pairs:
            print(f"{config:<16} {variant:<10} FAILED: {rep['results'][variant].get('error', '?')[:200]}")
            continue
        worst = min(pairs, key=lambda p: (p["bitwise_equal_pct"], -p["max_abs_diff"]))
        best = max(p["bitwise_equal_pct"] for p in pairs)
        label = f"{worst['rollout']} vs {worst['training']}"
        print(f"{config:<16} {variant:<10} {label:<34} {worst['max_abs_diff']:>10.3g} "
              f"{worst['bitwise_equal_pct']:>7.1f}%  (best pair {best:.1f}%)")
    t = rep["timing"]
    fmt = lambda v: "n/a" if v is None else f"x{v:.2f}"  # noqa: E731
    print(f"{config:<16} speed: prefill {fmt(t.get('prefill_patched_over_unpatched'))}, decode step "
          f"{fmt(t.get('decode_patched_over_unpatched'))} (patched / unpatched; target <= 1.25)")
    print(f"{'PASS' if rep['patched_bitwise'] else 'FAIL'} {config}: patched 100% bitwise in every pair")
bench = out / "invariant.csv"
if bench.exists():
    rows = list(csv.DictReader(bench.open()))
    print()
    print(f"{'workload':<14} {'shape':<34} {'tokens':>6} {'rlkernel ms':>12} {'torch ms':>10} {'ratio':>7}")
    by = {}
    for r in rows:
        by.setdefault((r["workload"], r["shape"], r["tokens"]), {})[r["impl"]] = r
    for (w, shape, tok), impls in by.items():
        rk, th = impls.get("rlkernel", {}), impls.get("torch", {})
        a, b = rk.get("median_ms") or "", th.get("median_ms") or ""
        ratio = f"{float(a) / float(b):.2f}" if a and b else rk.get("status", "")[:20]
        print(f"{w:<14} {shape:<34} {tok:>6} {a[:10]:>12} {b[:8]:>10} {ratio:>7}")
else:
    print(f"no {bench} (bench skipped or failed)")
EOF
