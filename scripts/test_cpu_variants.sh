#!/usr/bin/env bash
# Re-run the tests that execute Triton kernels in the CPU interpreter (and the CPU reference paths)
# with the math libraries forced onto other instruction sets, as on another CI machine.
#
#   scripts/test_cpu_variants.sh PYTHON [pytest args...]      (make test calls it)
#
# Why: CI runs on whatever x86 CPU it gets (Intel or AMD, AVX-512 or not). numpy's OpenBLAS, torch's
# MKL and oneDNN pick their kernels, and so their reduction orders, by CPU model; a test whose bits
# depend on that passes on one machine and fails on the next (2026-11-24: 14 invariance tests failed
# on an AMD EPYC without AVX-512 that had passed where they landed). Each variant below pins the
# libraries to one instruction-set level this CPU supports:
#   OPENBLAS_CORETYPE       numpy's OpenBLAS kernel family (Haswell = AVX2, Sandybridge = AVX)
#   MKL_ENABLE_INSTRUCTIONS torch's MKL (AVX2, AVX)
#   ONEDNN_MAX_CPU_ISA      torch's oneDNN (AVX2, AVX)
#   ATEN_CPU_CAPABILITY     torch's own vectorized kernels (avx2, default = no explicit SIMD)
# Variants the CPU cannot run (no AVX2, say) are skipped with a line saying so.
set -euo pipefail

python=${1:?usage: scripts/test_cpu_variants.sh PYTHON [pytest args...]}
shift
tests=(tests/invariant tests/kernels/test_dot.py tests/ops)
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "

run_variant() {  # name openblas mkl onednn aten required-cpu-flag [pytest args]
    local name=$1 openblas=$2 mkl=$3 onednn=$4 aten=$5 need=$6
    shift 6
    if [[ "$flags" != *" $need "* ]]; then
        echo "cpu variant $name: skipped (this CPU has no $need)"
        return 0
    fi
    local env=(OPENBLAS_CORETYPE="$openblas" MKL_ENABLE_INSTRUCTIONS="$mkl" ONEDNN_MAX_CPU_ISA="$onednn"
               ATEN_CPU_CAPABILITY="$aten")
    echo "cpu variant $name: ${env[*]}"
    env "${env[@]}" \
        "$python" -m pytest -q -p no:cacheprovider "$@" "${tests[@]}"
}

# The two variants run side by side (CI has 2 cores; the interpreter's work is single-threaded
# Python): about half the wall time of running them one after the other. Each one's output is
# printed whole when both are done; the script fails if either does.
logs=$(mktemp -d)
run_variant avx2 Haswell AVX2 AVX2 avx2 avx2 "$@" > "$logs/avx2.log" 2>&1 &
pid_avx2=$!
run_variant avx Sandybridge AVX AVX default avx "$@" > "$logs/avx.log" 2>&1 &
pid_avx=$!
status=0
wait "$pid_avx2" || status=1
wait "$pid_avx" || status=1
cat "$logs/avx2.log" "$logs/avx.log"
rm -rf "$logs"
exit "$status"
