#!/usr/bin/env bash
# The GPU-path checks, for a host with CUDA (CI has none): run from the repository root.
#
#   bash benchmarks/device_check.sh            # logs and a measured profile in ./device_check_out
#
# 1. tests/test_parallel_cuda.py: the engine, generation engine and runtime on the GPU against
#    CPU references (skipped without CUDA);
# 2. the single-process CPU parity tests (transformers vs our engine, generation engine), which
#    run on the GPU unchanged when one is visible;
# 3. `realflow calibrate` on the GPU: the measured profile to hold against the shipped one built
#    from published figures (python -m benchmarks.compare_profiles <measured.json>).
# 4. benchmarks/bench_planner.py --gpu with that profile: the planner's predicted step against
#    the measured one for SFT and GRPO on one GPU (BENCH_S=0 skips it).
# 5. benchmarks/bench_engine.py on Qwen3-0.6B's shape: the generation engine's decode step against
#    the HBM roofline, and its tokens/s against transformers generate (ENGINE_S=0 skips it).
# Every step has its own time limit (seconds: CUDA_TESTS_S, PARITY_TESTS_S, CALIBRATE_S, BENCH_S, ENGINE_S).
set -u -o pipefail
OUT=${OUT:-device_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
PYTEST=(-q -p no:cacheprovider -o addopts= -W ignore::DeprecationWarning)

$PY - <<'EOF' 2>&1 | tee "$OUT/env.log"
import torch, megatron.core, zmq, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "count", torch.cuda.device_count(),
          "nccl", torch.cuda.nccl.version())
print("megatron-core", megatron.core.__version__, "transformers", transformers.__version__, "pyzmq", zmq.__version__)
EOF
start=$(date +%s)
timeout "${CUDA_TESTS_S:-330}" $PY -m pytest "${PYTEST[@]}" tests/test_parallel_cuda.py 2>&1 | tee "$OUT/cuda_tests.log"
echo "cuda tests: rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.log"
start=$(date +%s)
timeout "${PARITY_TESTS_S:-150}" $PY -m pytest "${PYTEST[@]}" tests/test_parallel_hf.py tests/test_generation_engine.py \
    2>&1 | tee "$OUT/parity_tests.log"
echo "parity tests on the GPU: rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.log"
start=$(date +%s)
timeout "${CALIBRATE_S:-120}" $PY -m realflow.apps.main calibrate ${CALIBRATE_ARGS:---quick --world $($PY -c "import torch; print(max(torch.cuda.device_count(), 1))")} --out "$OUT/profile.json" \
    2>&1 | tee "$OUT/calibrate.log"
echo "calibrate: rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.log"
if [ "${BENCH_S:-300}" != 0 ] && [ -f "$OUT/profile.json" ]; then
    start=$(date +%s)
    timeout "${BENCH_S:-300}" $PY benchmarks/bench_planner.py --gpu --profile "$OUT/profile.json" \
        --steps "${BENCH_STEPS:-12}" --passes 1 --root "${TMPDIR:-/tmp}/bench_planner_gpu" 2>&1 | tee "$OUT/bench_planner_gpu.log"
    echo "bench_planner --gpu: rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.log"
fi
if [ "${ENGINE_S:-150}" != 0 ]; then
    start=$(date +%s)
    timeout "${ENGINE_S:-150}" $PY benchmarks/bench_engine.py --parts roofline,throughput --shape qwen3-0.6b \
        2>&1 | tee "$OUT/engine.log"
    echo "bench_engine (roofline, throughput): rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.log"
fi
