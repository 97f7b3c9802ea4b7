#!/usr/bin/env bash
# Runs benchmark parts on the GPU machine (the `device` tool), results under $OUT. Each part's command lines are
# built by bench/parts.py (one function per part, shared with its CPU smoke run); add a part there, not here.
#   bash bench/device_run.sh smoke                                           (every part at its tiny size on the CPU)
# Usage (from the repo root):
#   bash bench/device_run.sh gputests attntests trainbench e2e sdpa attention extract store profile regen
#   GPU_TEST_JOBS=5 GPU_TEST_ALONE=0 bash bench/device_run.sh gputests       (on an 80 GB H100: the parallel GPU tests;
#   bash bench/device_run.sh gpualone                                        (then, in a call of its own, the 4 that start
#        dflash on the GPU, one at a time: their preflight wants 16 GiB free)
#   bash bench/device_run.sh dflash2 dflash2tests                            (issue 20: DFlash 2 step time, GPU tests)
#   ARCH_SEEDS=0..7 ARCH_JOBS=16 bash bench/device_run.sh archtau            (issue 20's tau study on host CPUs)
#   TAU_CPU=1 TAU_SEEDS=10..21 TAU_JOBS=24 bash bench/device_run.sh tau      (CPU runs side by side)
#   bash bench/device_run.sh ddp extract2                                    (2 GPUs: nvidia-h200-x2)
#   bash bench/device_run.sh hybridtests extract35 load35                    (the real Qwen3.5/3.6 hybrid layout;
#        needs fla-core + einops in .whl/: ../shared/tools/device-wheels.sh fla-core==0.6.0 einops==0.8.2)
#   bash bench/device_run.sh long                                            (issue 19.6: 2K-16K samples, ~4 min)
#   bash bench/device_run.sh extractgil                                      (issue 22: bf16 extraction's loss; fla wheels)
#   bash bench/device_run.sh startup e2emfu ddpopts                          (issue 22, in this order: 2 GPUs)
#   bash bench/device_run.sh startup e2emfu e2eprof                          (issue 31: start-up phases, checkpoint stall, MFU,
#        and the profile of 10 end-to-end steps)
#   NODE_PHASES=prepare bash bench/device_run.sh node8                       (issue 34 on nvidia-h200-x8; then the
#        phases run, extract, train: one call each, bench/node_bench.py)
#   bash bench/device_run.sh startup ckptwrite e2emfu                        (issue 46: imports, the checkpoint write's rate and GIL
#        share on the host disk, warm first batch, checkpoint stall; PM_MIXES=chat ... packmfu: recompiles after step 1)
#   bash bench/device_run.sh gpuleft                                         (what wave 4 left: the GPU train pipeline
#        and the cached fast forward's GPU test; then issue 28's long-mix row: PM_MIXES=long, part packmfu)
#   bash bench/device_run.sh concurrent                                      (2 GPUs, ~6 min: issue 17)
#   FT_SEEDS=8 FT_DELAY=3 bash bench/device_run.sh followtau                 (issue 17's tau pairs on host CPUs, 800 samples;
#        the full 3,236 with a 3 s delay per batch did not finish a pair in 8 min)
# Needs .whl/ (zarr, numcodecs, ... from ../shared/tools/device-wheels.sh) carried along.
set -uo pipefail
[ -d .site/zarr ] || [ ! -d .whl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU (nvidia-smi)"
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    smoke)  # every part at its tiny size on this machine's CPUs (tests/test_bench_parts.py runs them one by one)
      OUT="$OUT/smoke" CUDA_VISIBLE_DEVICES= python3 -m bench.parts run --tiny $(python3 -m bench.parts list) ;;
    *) python3 -m bench.parts run "$part" ;;  # bench/parts.py builds each part's command lines (GPU and smoke)
  esac
done
echo "=== done $(date +%T)"
