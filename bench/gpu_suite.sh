#!/usr/bin/env bash
# bench/gpu_suite.sh OUTDIR -- every check that needs a GPU, in one run (stage budgets: 555 s in all).
# Installs nothing; needs a Python with a CUDA build of torch, triton, numba and pytest (set PYTHON=... to
# choose it; default: .venv/bin/python if it sees a GPU, else python3).
#
#   1. the optimizer tests with CUDA parameters (the "cuda" case of every test that takes a device, and
#      tests/test_gpu_link.py: the accumulate worker blocks on events, zeroing gradients in place after step,
#      device_accumulation with the state on disk fetching its sums exactly;
#      the oracle sweep, AdamW identities, checkpoints, NaN skip, faults; compiled Triton kernels,
#      the CUDA link's streams, events and pinned landing area; a rule in plain torch compiled to Triton on the
#      fast path, tests/test_compiled_rules.py)                                    -> OUTDIR/optim_tests.txt
#   1b. the CUDA path's checklist (python -m tests.gpu_checklist: gradient memory after zero_grad and at the
#      forward's peak against the synchronous path, a slow D2H, GradScaler overflowing at step 0, pinned D2H
#      destinations, FSDP2's hook stream, device sums on disk under a slow compute stream, close() during an
#      update, ZeRO-1 at 2 ranks with a profile of one update boundary)    -> OUTDIR/gpu_checklist_cuda.json,
#                                                                            OUTDIR/gpu_checklist.txt,
#                                                                            OUTDIR/zero_boundary_trace.json
#   2. the GPU end-to-end benchmark (python -m bench.e2e --preset gpu)           -> OUTDIR/e2e_gpu.{json,png},
#                                                                                    OUTDIR/e2e_gpu.txt
#   3. the kernel tests compiled on the GPU (TRITON_INTERPRET=0: the "cuda" device of every test;
#      autotuning off so each test shape is not benchmarked over every config)    -> OUTDIR/tests.txt
#   4. the kernel benchmark with autotuning on                                    -> OUTDIR/kernels_gpu.{json,csv,png},
#                                                                                    OUTDIR/bench.txt
#   5. gradients crossing during backward on real PCIe (python -m bench.overlap_gpu: a 1.07 B-parameter
#      bf16 model, AdamW / sync offload / ZenFlow with and without hand-over from hooks, the host's fold time)
#                                                                                 -> OUTDIR/overlap_gpu.{json,txt}
#   6. the check of a handed-over gradient (python -m bench.fingerprint --device cuda: the Triton fingerprint
#      against a plain read and the D2H copy it protects)                         -> OUTDIR/fingerprint_cuda.{json,png,txt}
# OUTDIR/summary.txt gets one line per stage with its exit status and seconds; OUTDIR/env.txt the
# GPU, driver and versions. A stage that fails or runs out of its time budget does not stop the next;
# the benchmarks write their JSON as they go, so a cut-short run still leaves data.
set -uo pipefail

OUT=${1:?usage: bench/gpu_suite.sh OUTDIR}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
        2>/dev/null; then
        echo .venv/bin/python
    else
        echo python3
    fi
}
PY=$(pick_python)

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0                 # compiled kernels; tests/conftest.py only sets it when unset
export PYTHONDONTWRITEBYTECODE=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$OUT/.triton-cache}"

: > "$OUT/summary.txt"
stage() {  # stage NAME SECONDS CMD... : run with a time budget, record status and duration
    local name=$1 budget=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$budget" "$@"
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - t0)) budget=$budget$([[ $rc == 124 ]] && echo ' TIMED OUT')" \
        | tee -a "$OUT/summary.txt"
    return 0
}

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1
    "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0))" 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"

if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "no CUDA device visible to $PY: nothing to do" | tee -a "$OUT/summary.txt"
    exit 1
fi

have_pytest=1
"$PY" -c "import pytest" 2>/dev/null || have_pytest=0

# 1. the optimizer tests with CUDA parameters
if [[ $have_pytest == 1 ]]; then
    export ZENFLOW_TRITON_AUTOTUNE=0
    stage optim_tests 130 \
        "$PY" -m pytest tests/test_optim.py tests/test_gpu_link.py tests/test_compiled_rules.py -k "cuda or gpu_link" -q -p no:cacheprovider --durations=10 -rs \
        > "$OUT/optim_tests.txt" 2>&1
    tail -n 25 "$OUT/optim_tests.txt"
else
    echo "optim_tests rc=skipped (pytest is not installed for $PY)" | tee -a "$OUT/summary.txt"
fi

# 1b. the CUDA path's checklist (first after the tests: the review's open questions)
export ZENFLOW_TRITON_AUTOTUNE=0
stage gpu_checklist 110 "$PY" -W ignore::UserWarning -m tests.gpu_checklist --out "$OUT" > "$OUT/gpu_checklist.txt" 2>&1
cat "$OUT/gpu_checklist.txt"

# 2. the GPU end-to-end benchmark
stage e2e_gpu 80 "$PY" -m bench.e2e --preset gpu --out "$OUT" --quiet > "$OUT/e2e_gpu.txt" 2>&1
cat "$OUT/e2e_gpu.txt"

# 3. kernel tests on the GPU (compilation dominates: a cold Triton cache compiles every variant once)
if [[ $have_pytest == 1 ]]; then
    stage tests 80 \
        "$PY" -m pytest tests/test_triton_column_scores.py tests/test_triton_topk.py tests/test_triton_adamw.py tests/test_triton_rules.py \
        tests/test_ops_validation.py tests/test_ops_dispatch.py tests/test_gpu_devices.py \
        "tests/test_cpu_selective_adamw.py::test_planned_triton_launch_is_bit_identical" -q -p no:cacheprovider \
        --durations=15 -rs \
        > "$OUT/tests.txt" 2>&1
    tail -n 25 "$OUT/tests.txt"
else
    echo "tests rc=skipped (pytest is not installed for $PY)" | tee -a "$OUT/summary.txt"
fi

# 4. kernel benchmark (autotuning on)
export ZENFLOW_TRITON_AUTOTUNE=1
stage bench 30 "$PY" -m bench.kernels --out "$OUT" > "$OUT/bench.txt" 2>&1
tail -n 40 "$OUT/bench.txt"

# 5. the transfer hidden behind backward, on real PCIe
stage overlap_gpu 90 "$PY" -m bench.overlap_gpu --out "$OUT" > "$OUT/overlap_gpu.txt" 2>&1
cat "$OUT/overlap_gpu.txt"

# 6. the fingerprint's cost beside the copy it protects
stage fingerprint 35 "$PY" -m bench.fingerprint --device cuda --out "$OUT" > "$OUT/fingerprint.txt" 2>&1
cat "$OUT/fingerprint.txt"

rm -rf "$TRITON_CACHE_DIR"
echo "results in $OUT:"
ls -l "$OUT"
cat "$OUT/summary.txt"
