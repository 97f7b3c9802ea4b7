#!/usr/bin/env bash
# Runs benchmark parts on the GPU machine (the `device` tool), results under $OUT. Usage (from the repo root):
#   bash bench/device_run.sh gputests attntests trainbench e2e sdpa attention extract store profile
# Needs .whl/ (zarr, numcodecs, ... from ../shared/tools/device-wheels.sh) carried along.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    gputests) python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -15 ;;
    trainbench)  # cold compile cache, then the same step from a second process with the cache warm, then SDPA
      rm -rf /tmp/cc
      python3 bench/train_bench.py --modes flex --steps 8 --cache-dir /tmp/cc --out "$OUT/train_cold.json" 2>&1 | tail -4
      python3 bench/train_bench.py --modes flex --steps 8 --cache-dir /tmp/cc --out "$OUT/train_warm.json" 2>&1 | tail -4 ;;
    gpufix) python3 -m pytest -q -m gpu tests/test_gpu_attention.py -p no:cacheprovider --tb=short -k "bounded_recompiles or under_autocast" 2>&1 | tail -25 ;;
    attntests) python3 -m pytest -q -m gpu tests/test_gpu_attention.py -p no:cacheprovider --tb=short 2>&1 | tail -25 ;;
    e2e) python3 bench/train_e2e.py --root /tmp/e2e --samples 8 --steps 5 --out "$OUT/train_e2e.json" 2>&1 | tail -6 ;;
    sdpa) python3 bench/train_bench.py --modes sdpa --steps 5 --out "$OUT/train_sdpa.json" 2>&1 | tail -3 ;;
    whole) python3 bench/train_bench.py --modes flex --compile whole --steps 5 --cache-dir /tmp/ccw --out "$OUT/train_whole.json" 2>&1 | tail -3 ;;
    attention) python3 bench/train_bench.py --attention-only --cache-dir /tmp/cc --out "$OUT/attention.json" 2>&1 | tail -8 ;;
    profile) python3 bench/train_bench.py --modes flex --steps 3 --cache-dir /tmp/cc --profile 2>&1 | tail -45 ;;
    extract) python3 bench/extract_bench.py --tokens ${EXTRACT_TOKENS:-120000} --clevel 1 --encodings bf16,fp8,int5,int4 \
               --store-dir /tmp/xb --out "$OUT/extract.json" 2>&1 | tail -12 ;;
    tau)  # issue 7's paired tau study on the GPU: tiny drafters side by side; rows reach $OUT as they finish
      ( while sleep 15; do cp /tmp/tau/results.jsonl "$OUT/tau_results.jsonl" 2>/dev/null; done ) & copier=$!
      TORCHINDUCTOR_COMPILE_THREADS=1 timeout ${TAU_LIMIT:-520} python3 bench/encoding_tau.py --out /tmp/tau --encodings ${TAU_ENCODINGS:-bf16,int5} \
        --seeds ${TAU_SEEDS:-0..19} --jobs ${TAU_JOBS:-10} --threads 1 2>&1 | tail -20
      kill $copier; cp /tmp/tau/results.jsonl "$OUT/tau_results.jsonl"; cp -r /tmp/tau/logs "$OUT/tau_logs" ;;
    tinyprof)  # where a tiny drafter's GPU step goes (3.9 steps/s on the H200 vs 7.7 on the 2-core CPU)
      python3 -m pipeline.cli extract --store /tmp/tp/bf16.zarr --set store.encoding=bf16 > "$OUT/tiny-extract.log" 2>&1
      python3 -m cProfile -o "$OUT/tiny_train.prof" -m pipeline.cli train --store /tmp/tp/bf16.zarr --no-export \
        --set train.batch_size=8 --set train.max_steps=${TINY_STEPS:-200} --set train.num_workers=0 --set train.run_dir=/tmp/tp/run \
        --set train.val_every=100000 2>&1 | grep -E "first batch|step (50|100|150|200)/|Error|error" | head
      python3 -c "import pstats; s=pstats.Stats('$OUT/tiny_train.prof'); s.sort_stats('tottime').print_stats(30); s.sort_stats('cumulative').print_stats(60)" > "$OUT/tiny_train_prof.txt"
      head -60 "$OUT/tiny_train_prof.txt" ;;
    store) python3 bench/store_bench.py --root /tmp/sb --out "$OUT/store.json" 2>&1 | tail -22 ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "=== done $(date +%T)"
