#!/usr/bin/env bash
# Runs benchmark parts on the GPU machine (the `device` tool), results under $OUT. Usage (from the repo root):
#   bash bench/device_run.sh gputests attntests trainbench e2e sdpa attention extract store profile regen
#   bash bench/device_run.sh dflash2 dflash2tests                            (issue 20: DFlash 2 step time, GPU tests)
#   ARCH_SEEDS=0..7 ARCH_JOBS=16 bash bench/device_run.sh archtau            (issue 20's tau study on host CPUs)
#   TAU_CPU=1 TAU_SEEDS=10..21 TAU_JOBS=24 bash bench/device_run.sh tau      (CPU runs side by side)
#   bash bench/device_run.sh ddp extract2                                    (2 GPUs: nvidia-h200-x2)
#   bash bench/device_run.sh hybridtests extract35 load35                    (the real Qwen3.5/3.6 hybrid layout;
#        needs fla-core + einops in .whl/: ../shared/tools/device-wheels.sh fla-core==0.6.0 einops==0.8.2)
#   bash bench/device_run.sh long                                            (issue 19.6: 2K-16K samples, ~4 min)
#   bash bench/device_run.sh extractgil                                      (issue 22: bf16 extraction's loss; fla wheels)
#   bash bench/device_run.sh startup e2emfu ddpopts                          (issue 22, in this order: 2 GPUs)
#   bash bench/device_run.sh concurrent                                      (2 GPUs, ~6 min: issue 17)
#   FT_SEEDS=8 FT_DELAY=3 bash bench/device_run.sh followtau                 (issue 17's tau pairs on host CPUs, 800 samples;
#        the full 3,236 with a 3 s delay per batch did not finish a pair in 8 min)
#   PM_MIXES=chat bash bench/device_run.sh packmfu; PM_MIXES=long bash bench/device_run.sh packmfu    (issue 28 item 4)
#   PT_SEEDS=0..7 PT_JOBS=16 bash bench/device_run.sh packtau               (issue 28 item 3: packing's tau pairs, CPUs)
#   bash bench/device_run.sh packtests                                       (issue 28: packed flex vs SDPA, GPU tests)
# Needs .whl/ (zarr, numcodecs, ... from ../shared/tools/device-wheels.sh) carried along.
set -uo pipefail
[ -d .site/zarr ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    gputests) python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > "$OUT/gputests.log" 2>&1; tail -15 "$OUT/gputests.log" ;;
    trainbench)  # cold compile cache, then the same step from a second process with the cache warm, then SDPA
      rm -rf /tmp/cc
      python3 bench/train_bench.py --modes flex --steps 8 --cache-dir /tmp/cc --out "$OUT/train_cold.json" 2>&1 | tail -4
      python3 bench/train_bench.py --modes flex --steps 8 --cache-dir /tmp/cc --out "$OUT/train_warm.json" 2>&1 | tail -4 ;;
    gpufix) python3 -m pytest -q -m gpu tests/test_gpu_attention.py -p no:cacheprovider --tb=short -k "bounded_recompiles or under_autocast" 2>&1 | tail -25 ;;
    attntests) python3 -m pytest -q -m gpu tests/test_gpu_attention.py -p no:cacheprovider --tb=short 2>&1 | tail -25 ;;
    e2e) python3 bench/train_e2e.py --root /tmp/e2e --samples 8 --steps 5 --out "$OUT/train_e2e.json" 2>&1 | tail -6 ;;
    ddp)  # one GPU (cold cache) against two DDP ranks over NCCL (twice: is the cache warm for DDP?); 2 GPUs
      python3 bench/train_e2e.py --root /tmp/e2e --samples ${DDP_SAMPLES:-64} --steps ${DDP_STEPS:-20} --gpus ${DDP_GPUS:-0 0,1 0,1} \
        --out "$OUT/train_e2e_ddp.json" > "$OUT/train_e2e_ddp.log" 2>&1; tail -8 "$OUT/train_e2e_ddp.log" ;;
    e2emfu)  # issue 22 items 1+3 (1 GPU, ~4 min): `dflash train` at the 27B shape, accumulation 4: a 1-step run on a
             # cold compile cache, then 53 steps warm; prints the warm first batch (goal < 15 s) and the steady
             # end-to-end MFU over the last 50 steps (goal >= 68%)
      timeout ${E2E_LIMIT:-290} python3 bench/train_e2e.py --root /tmp/e2e --samples ${E2E_SAMPLES:-64} --cold-steps 1 \
        --steps ${E2E_STEPS:-53} --gpus 0 0 --out "$OUT/e2e_mfu.json" > "$OUT/e2e_mfu.log" 2>&1
      grep -E "first batch done|Error|error" "$OUT/e2e_mfu.log" | head -6; tail -6 "$OUT/e2e_mfu.log" ;;
    ddpopts)  # issue 22 item 2 (2 GPUs, ~4 min, right after e2emfu in the same call: its store, cache and 1-GPU rate):
              # 30 steps on GPUs 0,1 with torch's DDP defaults, then with gradient_as_bucket_view + 100 MB buckets;
              # prints steps/s and scaling vs e2emfu's 1-GPU samples/s (goal >= 95%)
      timeout ${E2E_LIMIT:-290} python3 bench/train_e2e.py --root /tmp/e2e --samples ${E2E_SAMPLES:-64} --reuse \
        --reference "$OUT/e2e_mfu.json" --steps ${DDPOPT_STEPS:-30} --gpus 0,1 \
        "0,1@train.ddp_gradient_as_bucket_view=true@train.ddp_bucket_cap_mb=100" \
        --out "$OUT/ddpopts.json" > "$OUT/ddpopts.log" 2>&1
      grep -E "first batch done|Error|error" "$OUT/ddpopts.log" | head -6; tail -6 "$OUT/ddpopts.log" ;;
    startup)  # issue 22 item 1 (1 GPU, ~1.5 min): the launch path's imports with and without cProfile, and the time
              # torch's custom-op registration (inspect.getframeinfo per op) really takes in each
      python3 bench/startup_bench.py --out "$OUT/startup.json" 2>&1 | tail -8 ;;
    extract2)  # extraction scaling: one process alone on GPU 0, then one per GPU at the same time (2 GPUs)
      x="bench/extract_bench.py --arch qwen3 --tokens ${EXTRACT_TOKENS:-120000} --clevel 1 --encodings int5"
      python3 $x --store-dir /tmp/xs --out "$OUT/extract_solo.json" > "$OUT/extract_solo.log" 2>&1; rm -rf /tmp/xs
      for g in 0 1; do CUDA_VISIBLE_DEVICES=$g python3 $x --store-dir /tmp/xp$g --out "$OUT/extract_gpu$g.json" > "$OUT/extract_gpu$g.log" 2>&1 & done
      wait; tail -n 6 "$OUT"/extract_*.log ;;
    dflash2)  # issue 20: the 27B-shape step (flex, compiled layers, bf16), plain DFlash then DFlash 2, same shape
      for arch in dflash dflash2; do
        python3 bench/train_bench.py --modes flex --steps 8 --arch $arch --cache-dir /tmp/cc-$arch \
          --out "$OUT/train_$arch.json" > "$OUT/train_$arch.log" 2>&1; tail -3 "$OUT/train_$arch.log"
      done ;;
    archtau)  # issue 20's paired dflash/dflash2 study on the host's CPUs: ARCH_SEEDS pairs, ARCH_EPOCHS epochs
              # (1, as the development machine's study; 3 is the demo schedule, ~3x longer per run)
      ( while sleep 15; do cp /tmp/archtau/results.jsonl "$OUT/archtau_results.jsonl" 2>/dev/null; done ) & copier=$!
      timeout ${ARCH_LIMIT:-560} python3 bench/arch_tau.py --out /tmp/archtau --seeds ${ARCH_SEEDS:-0..7} \
        --set train.epochs=${ARCH_EPOCHS:-1} --jobs ${ARCH_JOBS:-16} --threads 1 --cpu > "$OUT/archtau.log" 2>&1
      tail -12 "$OUT/archtau.log"
      kill $copier; cp /tmp/archtau/results.jsonl "$OUT/archtau_results.jsonl" ;;
    followtau)  # issue 17's tau check on the host's CPUs: FT_SEEDS seeds side by side, each its own bench/follow_tau.py
                # (own stores; 2 threads each), extraction slowed by FT_DELAY s a batch so training really follows
      for s in $(seq 0 $((${FT_SEEDS:-8} - 1))); do
        OMP_NUM_THREADS=2 timeout ${FT_LIMIT:-520} python3 bench/follow_tau.py --out /tmp/ft/s$s --seeds $s \
          --delay ${FT_DELAY:-3} --extract-set data.max_samples=${FT_SAMPLES:-800} > /tmp/ft-s$s.log 2>&1 &
      done; wait
      cat /tmp/ft/s*/results.jsonl > "$OUT/follow_tau.jsonl" 2>/dev/null; wc -l < "$OUT/follow_tau.jsonl"
      python3 -c "import json,sys; sys.path.insert(0,'.'); from bench.follow_tau import summarize; \
summarize([json.loads(x) for x in open('$OUT/follow_tau.jsonl')])" 2>&1 | tail -4 ;;
    dflash2tests) python3 -m pytest -q -m gpu tests/test_gpu_dflash2.py -p no:cacheprovider --tb=short 2>&1 | tail -25 ;;
    concurrent)  # issue 17: 27B-hybrid-shape extraction on GPU 0 and 27B-shape drafter training on GPU 1, alone, then
                 # both at once from one growing store (train --follow); fractions of solo rates, wall-time model
      timeout ${CONC_LIMIT:-420} python3 bench/concurrent_bench.py --root /tmp/cb --out "$OUT/concurrent.json" \
        > "$OUT/concurrent.log" 2>&1; grep -v "Warning\|warn(" "$OUT/concurrent.log" | tail -14; rm -rf /tmp/cb ;;
    sdpa) python3 bench/train_bench.py --modes sdpa --steps 5 --out "$OUT/train_sdpa.json" 2>&1 | tail -3 ;;
    whole) python3 bench/train_bench.py --modes flex --compile whole --steps 5 --cache-dir /tmp/ccw --out "$OUT/train_whole.json" 2>&1 | tail -3 ;;
    attention) python3 bench/train_bench.py --attention-only --cache-dir /tmp/cc --out "$OUT/attention.json" 2>&1 | tail -8 ;;
    profile) python3 bench/train_bench.py --modes flex --steps 3 --cache-dir /tmp/cc --profile 2>&1 | tail -45 ;;
    extract) python3 bench/extract_bench.py --arch qwen3 --tokens ${EXTRACT_TOKENS:-120000} --clevel 1 --encodings bf16,fp8,int5,int4 \
               --store-dir /tmp/xb --out "$OUT/extract.json" 2>&1 | tail -12 ;;
    tau)  # issue 7's paired tau study on the GPU: tiny drafters side by side; rows reach $OUT as they finish
      ( while sleep 15; do cp /tmp/tau/results.jsonl "$OUT/tau_results.jsonl" 2>/dev/null; done ) & copier=$!
      TORCHINDUCTOR_COMPILE_THREADS=1 timeout ${TAU_LIMIT:-520} python3 bench/encoding_tau.py --out /tmp/tau --encodings ${TAU_ENCODINGS:-bf16,int5} \
        --seeds ${TAU_SEEDS:-0..19} --jobs ${TAU_JOBS:-10} --threads 1 ${TAU_CPU:+--cpu} > "$OUT/tau.log" 2>&1; tail -20 "$OUT/tau.log"
      kill $copier; cp /tmp/tau/results.jsonl "$OUT/tau_results.jsonl"; cp -r /tmp/tau/logs "$OUT/tau_logs" ;;
    tau-start)  # the same study detached and niced: its own session outlives this call while the machine stays
                # warm, so GPU parts can run meanwhile; collect it with tau-collect in a later call
      # (from a copy of the tree: a later call re-sends the repo while these runs still start processes)
      rm -rf /tmp/taurepo; mkdir -p /tmp/tau /tmp/taurepo; cp -r pipeline stages data bench configs scripts .site /tmp/taurepo/
      ( cd /tmp/taurepo && PYTHONPATH=/tmp/taurepo/.site:/tmp/taurepo TORCHINDUCTOR_COMPILE_THREADS=1 \
        setsid nohup nice -n 19 python3 bench/encoding_tau.py --out /tmp/tau \
        --encodings ${TAU_ENCODINGS:-bf16,int5} --seeds ${TAU_SEEDS:-0..19} --jobs ${TAU_JOBS:-10} --threads 1 ${TAU_CPU:+--cpu} \
        > /tmp/tau.log 2>&1 < /dev/null & ); sleep 2; echo "tau started in the background" ;;
    tau-collect)  # wait for the detached study (at most TAU_WAIT s), then copy what it finished
      end=$((SECONDS + ${TAU_WAIT:-300})); while pgrep -f bench/encoding_tau.py > /dev/null && [ $SECONDS -lt $end ]; do sleep 10; done
      cp /tmp/tau/results.jsonl "$OUT/tau_results.jsonl"; cp /tmp/tau.log "$OUT/tau.log"; cp -r /tmp/tau/logs "$OUT/tau_logs"
      tail -20 /tmp/tau.log ;;
    tinyrate)  # the tiny drafter's GPU step rate without a profiler (num_workers=0, as the tau study trains)
      python3 -m pipeline.cli extract --store /tmp/tr/bf16.zarr --set store.encoding=bf16 > "$OUT/tiny-extract.log" 2>&1
      python3 -m pipeline.cli train --store /tmp/tr/bf16.zarr --no-export --set train.batch_size=8 \
        --set train.max_steps=${TINY_STEPS:-400} --set train.num_workers=0 --set train.run_dir=/tmp/tr/run \
        --set train.val_every=100000 --set train.log_every=50 2>&1 | grep -E "first batch|step [0-9]+/|Error" | head -12 ;;
    tinyprof)  # where a tiny drafter's GPU step goes (3.9 steps/s on the H200 vs 7.7 on the 2-core CPU)
      python3 -m pipeline.cli extract --store /tmp/tp/bf16.zarr --set store.encoding=bf16 > "$OUT/tiny-extract.log" 2>&1
      python3 -m cProfile -o "$OUT/tiny_train.prof" -m pipeline.cli train --store /tmp/tp/bf16.zarr --no-export \
        --set train.batch_size=8 --set train.max_steps=${TINY_STEPS:-200} --set train.num_workers=0 --set train.run_dir=/tmp/tp/run \
        --set train.val_every=100000 2>&1 | grep -E "first batch|step (50|100|150|200)/|Error|error" | head
      python3 -c "import pstats; s=pstats.Stats('$OUT/tiny_train.prof'); s.sort_stats('tottime').print_stats(30); s.sort_stats('cumulative').print_stats(60)" > "$OUT/tiny_train_prof.txt"
      head -60 "$OUT/tiny_train_prof.txt" ;;
    extract35)  # the real hybrid layout (Qwen3_5ForCausalLM, layers 0..61): kernels bound, first pass on a cold
                # kernel cache, bare forward vs >= 9,000 tok/s, extraction / bare for int5 (goal >= 0.95), fp8, bf16
      rm -rf /tmp/kc /tmp/xb; python3 bench/extract_bench.py --arch qwen3_5 --tokens ${EXTRACT_TOKENS:-120000} --clevel 1 \
        --encodings int5,fp8,bf16 --kernel-cache /tmp/kc --store-dir /tmp/xb --out "$OUT/extract35.json" 2>&1 | tail -16 ;;
    extractgil)  # issue 22 item 4: where bf16 extraction's lost ~12% goes, hybrid shape, one GPU (~3 min): the writer
                 # thread as shipped, a null writer (forward + capture + encode + copy, no store write) and the
                 # writer thread with a 0.5 ms GIL switch interval; prints each one's "vs bare" ratio
      python3 bench/extract_bench.py --arch qwen3_5 --tokens ${EXTRACT_TOKENS:-120000} --clevel 1 --encodings bf16 \
        --writers thread,null,switch --kernel-cache /tmp/kc --store-dir /tmp/xg --out "$OUT/extract_gil.json" 2>&1 | tail -10
      python3 bench/gil_bench.py --tokens 4096 --seconds 4 --out "$OUT/gil.json" 2>&1 | tail -4 ;;
    load35)  # peak host memory per worker of loading a real-width hybrid checkpoint (8 layers, ~11 GB): dflash vs old
      python3 bench/load_bench.py --layers ${LOAD_LAYERS:-8} --dir /tmp/ckpt35 --out "$OUT/load35.json" 2>&1 | tail -6
      rm -rf /tmp/ckpt35 ;;
    hybridtests) python3 -m pytest -q -m gpu tests/test_hybrid.py -p no:cacheprovider --tb=short 2>&1 | tail -15 ;;
    store) python3 bench/store_bench.py --root /tmp/sb --out "$OUT/store.json" 2>&1 | tail -22 ;;
    regen)  # dflash regenerate's batched generation vs a per-prompt generate loop, real 27B hybrid layout, one GPU
      python3 bench/regen_bench.py --prompts ${REGEN_PROMPTS:-64} --loop-prompts ${REGEN_LOOP:-4} \
        --new-tokens ${REGEN_NEW:-256} --out "$OUT/regen.json" > "$OUT/regen.log" 2>&1; grep -v "^\[transformers\]" "$OUT/regen.log" | tail -9 ;;
    long)  # issue 19.6: one training step of the 27B drafter at 2K/8K/16K tokens per sample: peak memory, step time
      python3 bench/long_bench.py --steps 5 --out "$OUT/long.json" 2>&1 | grep -v "Warning\|warn(" | tail -8 ;;
    packtests) python3 -m pytest -q -m gpu tests/test_packing.py -p no:cacheprovider --tb=short 2>&1 | tail -15 ;;  # issue 28
    packtau)  # issue 28 item 3: packed vs plain tau pairs (bench/pack_tau.py) on the host's CPUs, PT_SEEDS pairs,
              # PT_JOBS runs at once, PT_EPOCHS epochs; PT_SET / PT_EXTRACT_SET: one more training / extraction
              # override (the suite's smoke run)
      ( while sleep 15; do cp ${PT_DIR:-/tmp/packtau}/results.jsonl "$OUT/packtau_results.jsonl" 2>/dev/null; done ) & copier=$!
      timeout ${PT_LIMIT:-560} python3 bench/pack_tau.py --out ${PT_DIR:-/tmp/packtau} --seeds ${PT_SEEDS:-0..7} \
        --set train.epochs=${PT_EPOCHS:-1} ${PT_SET:+--set $PT_SET} ${PT_EXTRACT_SET:+--extract-set $PT_EXTRACT_SET} \
        --jobs ${PT_JOBS:-16} --threads 1 --cpu \
        > "$OUT/packtau.log" 2>&1
      tail -12 "$OUT/packtau.log"
      kill $copier; cp ${PT_DIR:-/tmp/packtau}/results.jsonl "$OUT/packtau_results.jsonl" ;;
    packmfu)  # issue 28 item 4 (1 GPU, ~4 min a mix; PM_MIXES=chat and PM_MIXES=long fit one call each): 27B-shape
              # stores of a length mix (chat: mean ~1K, max_length 3072; long: mean ~4.5K, max 8K), `dflash train`
              # PM_STEPS steps without then with packing (pack_tokens = max_length), accumulation 1; prints
              # samples/s, tokens/s and MFU of useful FLOPs only (goal >= 62% on both mixes). PM_ARGS: more
              # bench/train_e2e.py options (the suite's CPU smoke run: the tiny shape)
      for mix in ${PM_MIXES:-chat long}; do
        if [ "$mix" = long ]; then ml=8192; else ml=3072; fi
        timeout ${PM_LIMIT:-290} python3 bench/train_e2e.py --root ${PM_ROOT:-/tmp/pm}-$mix --mix $mix \
          --samples ${PM_SAMPLES:-96} --steps ${PM_STEPS:-55} --cold-steps ${PM_STEPS:-55} --set data.max_length=$ml \
          --set train.accumulate_grad_batches=1 ${PM_ARGS:-} --gpus 0 "0@train.packing=true" \
          --out "$OUT/packmfu_$mix.json" > "$OUT/packmfu_$mix.log" 2>&1
        grep -E "first batch done|Error|error" "$OUT/packmfu_$mix.log" | head -6; tail -5 "$OUT/packmfu_$mix.log"
        rm -rf ${PM_ROOT:-/tmp/pm}-$mix
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "=== done $(date +%T)"
