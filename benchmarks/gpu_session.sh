#!/usr/bin/env bash
# One device lease, four calls of a warm machine (each under the 10-minute command limit):
#
#   bash benchmarks/gpu_session.sh tests   # family build in the background + engine GPU tests
#   bash benchmarks/gpu_session.sh e2e     # kernel GPU tests; then (build done) e2e batch 1 and 64
#   bash benchmarks/gpu_session.sh ptd     # PTD vs autoregressive EAGLE-3, K = 2..8
#   bash benchmarks/gpu_session.sh speed   # decode.py (sync/async), spec_step, attention, gemv
#   bash benchmarks/gpu_session.sh recheck # after changes: async + gemv GPU tests, decode.py
#                                          # (sync/async/auto), PTD vs EAGLE-3 draft cost K=2..8
#   bash benchmarks/gpu_session.sh splits  # graph == eager at max_model_len 4096 (split-KV),
#                                          # batch-1 decode per MIN_KEYS_PER_SPLIT
#   bash benchmarks/gpu_session.sh fuse    # fused norm + gemv GPU tests, decode per variant
#   bash benchmarks/gpu_session.sh overlap # decode per gemv PDL overlap variant (no tests)
#   bash benchmarks/gpu_session.sh check   # every GPU test of the engine, attention and ops
#   bash benchmarks/gpu_session.sh decode  # decode.py: batch 1 and 16 with transformers
#   bash benchmarks/gpu_session.sh next-tests  # experiments (EARLY_METADATA, FUSE_ROPE_KV,
#   bash benchmarks/gpu_session.sh next-sweep  # gemv candidates):
#                                          # their GPU tests, then decode with each
#   bash benchmarks/gpu_session.sh final-kernels  # decode.py, then the kernel GPU tests
#   bash benchmarks/gpu_session.sh final-engine   # every engine GPU test (test_gpu.py)
#   bash benchmarks/gpu_session.sh final-tests    # kernel and engine GPU tests side by side
#   bash benchmarks/gpu_session.sh confirm        # decode.py (batch 1, with transformers) twice
#   bash benchmarks/gpu_session.sh moe            # MoE GPU tests (models, fused-MoE kernels),
#                                                 # benchmarks/moe.py --quick, then moe_decode.py
#                                                 # --quick (batch 1) in the time left (it skips
#                                                 # the configurations that would not fit)
#   bash benchmarks/gpu_session.sh moe-decode     # moe_decode.py alone, every configuration
#   bash benchmarks/gpu_session.sh step           # issue 23: skinny.py, decode.py B=1/16, spec_step
#   bash benchmarks/gpu_session.sh timelines      # batch-1 device timelines (SHAPES=...)
#   bash benchmarks/gpu_session.sh warmup         # warm-up / lifetime GPU tests (no compile or
#                                                 # capture after start-up; del llm frees)
#   bash benchmarks/gpu_session.sh serve-plain    # serve_sweep.py --shape llama3-8b, plain half
#   bash benchmarks/gpu_session.sh serve-eagle3   # the EAGLE-3 half, then compare + plot
#   bash benchmarks/gpu_session.sh serve-short    # both halves at 64 output tokens (stalls)
#   bash benchmarks/gpu_session.sh verify         # session 10's GPU tests (all pass in session 11)
#   bash benchmarks/gpu_session.sh serve-long     # both serving halves in one call (344 s, warm)
#   bash benchmarks/gpu_session.sh mla-prefill    # MLA prefill: latent vs expanded K/V (issue 21)
#   bash benchmarks/gpu_session.sh oss            # issue 22: MXFP4 kernel tests + sweep
#                                                 # (benchmarks/mxfp4.py), gpt-oss-20b timeline,
#                                                 # gpt_oss_decode.py --quick (20b, 120b)
#   bash benchmarks/gpu_session.sh remeasure      # batch 1 of issues 18 / 21 / 22 with session
#                                                 # 14's corrected step timing (two calls:
#                                                 # PART=moe, then PART=mla)
#   bash benchmarks/gpu_session.sh mla-check      # GPU tests of MLA's fused_qkv_a_proj (session
#                                                 # 19), then `PART=mla ... remeasure`
#   bash benchmarks/gpu_session.sh coldplan       # decode_matmul=auto's planning from an
#                                                 # empty Triton cache, threads vs serial
#   bash benchmarks/gpu_session.sh b16            # Llama-3-8B batch-16 timeline (issue 23)
#   bash benchmarks/gpu_session.sh attn16         # batch-16 attention: key-loop pipeline depth
#                                                 # and splits (NUM_STAGES, PROGRAMS_PER_SM)
#   bash benchmarks/gpu_session.sh spec-timeline  # EAGLE-3 K=4 steps at batch 1 / 16 / 64
#                                                 # traced, kernel by kernel (issue 23)
#   bash benchmarks/gpu_session.sh skinny-norm    # the decode plan: GPU tests, its TB/s per
#                                                 # shape, batch 1 / 16, EAGLE-3 K=3 / 4
#   bash benchmarks/gpu_session.sh early-params   # attention parameters before the PDL wait
#                                                 # (triton_paged.EARLY_ATTN_PARAMS): GPU tests
#                                                 # with it, step A/B (issues 18, 22)
#   bash benchmarks/gpu_session.sh pps            # key splits at batches that fill the SMs
#                                                 # (PROGRAMS_PER_SM = 4): batch 4 / 16 steps,
#                                                 # EAGLE-3 K=4 at batch 1 / 16
#   bash benchmarks/gpu_session.sh sol            # exposed cost of the latency-bound kernels:
#                                                 # each skipped in turn (GLM MLA, Qwen3
#                                                 # attention; outputs garbage, timing only;
#                                                 # SOL_SET=kv: the MLA prologue without its
#                                                 # KV-write program)
#   bash benchmarks/gpu_session.sh ncu            # Nsight Compute on the batch-1 MoE kernels
#                                                 # (MXFP4 v5 gate_up / down at gpt-oss-20b,
#                                                 # bf16 decode at Qwen3-30B-A3B): full sets
#   bash benchmarks/gpu_session.sh persist        # the persistent MoE gate_up kernel (issue 18):
#                                                 # the expert stream alone
#                                                 # (benchmarks/moe_stream.py), then batch-1
#                                                 # steps A/B (PERSIST_SHAPE, default Qwen3)
#   bash benchmarks/gpu_session.sh confirm24      # session 24's defaults: MoE / MLA GPU tests,
#                                                 # Qwen3 and GLM-4.7-Flash batch 1
#   bash benchmarks/gpu_session.sh mla-early      # issue 21: MLA attention's EARLY_KV: the MLA
#                                                 # GPU tests with it on, GLM steps A/B
#   bash benchmarks/gpu_session.sh tma            # issue 23: a TMA swap-AB matmul prototype
#                                                 # (verify_tile.py --kernel tma) vs cuBLAS
#   bash benchmarks/gpu_session.sh confirm28      # issue 18 (Qwen3, twice) and 21 (GLM) batch-1
#                                                 # figures with the defaults
#   bash benchmarks/gpu_session.sh early28        # Qwen3 attention's early first tile / 32-key
#                                                 # split tiles beside the preloading o, A/B
#   bash benchmarks/gpu_session.sh split-tiles    # GQA split launches' key tile
#                                                 # (triton_paged.SPLIT_BLOCK_N, 16 by default)
#                                                 # and SPLIT_EARLY_KV: GPU tests, steps A/B
#   bash benchmarks/gpu_session.sh h200           # the first H200 lease: MoE GPU sanity, issue
#                                                 # 18's batch-1 figure, the Qwen3 timeline
#   bash benchmarks/gpu_session.sh h200-step      # issue 23 on the H200: decode B 1 / 16,
#                                                 # EAGLE-3 K = 4 at B 1 / 16 / 64
#   bash benchmarks/gpu_session.sh h200-tests     # every GPU test, 4 xdist workers
# (`check` in two calls: session 6's split of it, each well inside the 10-minute limit.)
#
# Logs and JSON go to $OUT (the device tool brings them back even when a call is cut off).
# The build's PID is kept in a file: `pgrep -f build_family` also matches the calling shell.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
FAMILY=${FAMILY:-/tmp/family}
PIDFILE=/tmp/family_build.pid
mkdir -p "$OUT"

wait_build() {  # $1: seconds to wait at most
  local pid
  pid=$(cat "$PIDFILE" 2>/dev/null) || return 0
  for _ in $(seq "$1"); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  tail -6 /tmp/family_build.log
}

case "${1:-}" in
  tests)
    setsid python benchmarks/build_family.py --family gpu --cache "$FAMILY" \
      --methods eagle3,ptd >/tmp/family_build.log 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    timeout 540 python -m pytest -q -m gpu tests/test_gpu.py tests/test_spec_kernels.py \
      -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    wait_build 30
    ;;
  e2e)
    python -m pytest -q -m gpu tests/test_ops.py tests/test_triton_attention.py \
      -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_kernels.log" | tail -15
    wait_build 300
    python benchmarks/e2e.py --family-dir "$FAMILY" --parts methods,batch64 2>&1 \
      | grep -v Warning | tee "$OUT/e2e.log" | tail -40
    ;;
  ptd)
    wait_build 300
    python benchmarks/e2e.py --family-dir "$FAMILY" --parts ptd 2>&1 \
      | grep -v Warning | tee "$OUT/e2e_ptd.log" | tail -40
    ;;
  speed)
    python benchmarks/decode.py --no-hf --batch-sizes 1,16 --kernels 2>&1 | tee "$OUT/decode.log" | tail -30
    python benchmarks/spec_step.py --ks 4 --modes fused 2>&1 | tee "$OUT/spec_step.log" | tail -8
    python benchmarks/spec_step.py --ks 4 --modes fused --async-scheduling 2>&1 \
      | tee "$OUT/spec_step_async.log" | tail -8
    python benchmarks/attention.py 2>&1 | tee "$OUT/attention.log" | tail -16
    python benchmarks/gemv.py 2>&1 | tee "$OUT/gemv.log" | tail -18
    ;;
  recheck)
    timeout 200 python -m pytest -q -m gpu tests/test_ops.py tests/test_gpu.py \
      -k "async or decode_linear or decode_matmul" -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_tests_recheck.log" | tail -6
    python benchmarks/decode.py --no-hf --batch-sizes 1,16 2>&1 | grep -v tokenizer \
      | tee "$OUT/decode.log" | tail -24
    python benchmarks/spec_step.py --methods eagle3,ptd --modes fused --batches 1 \
      --ks 2,3,4,5,6,7,8 2>&1 | grep -v tokenizer | tee "$OUT/spec_step_ptd.log" | tail -18
    python benchmarks/spec_step.py --ks 4 --modes fused --async-scheduling 2>&1 \
      | grep -v tokenizer | tee "$OUT/spec_step_async.log" | tail -5
    ;;
  splits)
    timeout 200 python -m pytest -q -m gpu tests/test_gpu.py tests/test_triton_attention.py \
      -k "equals_eager or split" -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_splits.log" | tail -6
    python benchmarks/decode.py --sweep "split=1024;split=256;split=64;split=1024" 2>&1 \
      | grep -v tokenizer | tee "$OUT/split_sweep.log" | tail -6
    ;;
  fuse)
    timeout 300 python -m pytest -q -m gpu tests/test_gpu.py tests/test_ops.py \
      -k "equals_eager or pdl or gemv or decode_linear or decode_matmul" -p no:cacheprovider \
      2>&1 | tee "$OUT/gpu_tests_fuse.log" | tail -8
    python benchmarks/decode.py --sweep "fuse_norm=0;fuse_norm=1;fuse_norm=0;fuse_norm=1" \
      2>&1 | grep -v tokenizer | tee "$OUT/fuse_sweep.log" | tail -7
    ;;
  overlap)
    python benchmarks/decode.py --sweep \
      ";gemv_preload=0,gemv_early=0;gemv_preload=0;gemv_early=0;" 2>&1 \
      | grep -v tokenizer | tee "$OUT/overlap_sweep.log" | tail -7
    ;;
  check)
    # Session 5 ran out of its 570 s after 178 tests (default max_num_seqs 64 then: 11 graph
    # sizes an engine); --durations names the slow ones for the next split of this stage.
    timeout 570 python -m pytest -q -m gpu tests/test_triton_attention.py tests/test_ops.py \
      tests/test_gpu.py -p no:cacheprovider --durations=15 2>&1 \
      | tee "$OUT/gpu_tests_check.log" | tail -30
    ;;
  decode)
    python benchmarks/decode.py --batch-sizes 1,16 2>&1 | grep -v tokenizer \
      | tee "$OUT/decode.log" | tail -22
    ;;
  next-tests)
    # The experiments that are off by default (and this session's unmeasured changes): tests.
    timeout 400 python -m pytest -q -m gpu tests/test_gpu.py tests/test_triton_attention.py \
      tests/test_ops.py tests/test_spec_kernels.py -k "pdl or equals_eager or split or \
      experiments or fused_kv or argmax or place_on_device or async" -p no:cacheprovider \
      --durations=8 2>&1 | tee "$OUT/gpu_tests_next.log" | tail -14
    ;;
  next-sweep)
    # ... then batch-1 decode with each (the first and last variants: the defaults).
    python benchmarks/decode.py --sweep ";early_meta=1;fuse_kv=1;candidates=0/1/4;\
early_meta=1,fuse_kv=1;" 2>&1 | grep -v tokenizer | tee "$OUT/next_sweep.log" | tail -9
    ;;
  final-kernels)
    python benchmarks/decode.py --batch-sizes 1,16 2>&1 | grep -v tokenizer \
      | tee "$OUT/decode.log" | tail -22
    # Session 7: 300 s ran out after 20 tests (test_gemv_norm compiles for 10-90 s a case).
    timeout 540 python -m pytest -q -m gpu tests/test_ops.py tests/test_spec_kernels.py \
      tests/test_triton_attention.py -p no:cacheprovider --durations=5 2>&1 \
      | tee "$OUT/gpu_tests_kernels.log" | tail -12
    ;;
  final-tests)
    # Both halves of `check` at once (one GPU, two processes: ~530 s in session 7); the
    # per-test --timeout names a hang instead of losing the whole call to it.
    timeout 570 python -m pytest -q -m gpu tests/test_ops.py tests/test_spec_kernels.py \
      tests/test_triton_attention.py -p no:cacheprovider --timeout=150 --durations=12 \
      >"$OUT/gpu_tests_kernels.log" 2>&1 &
    timeout 570 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
      --timeout=200 --durations=12 >"$OUT/gpu_tests_engine.log" 2>&1
    echo "engine rc $?"
    wait $!
    echo "kernels rc $?"
    tail -n 3 "$OUT/gpu_tests_kernels.log" "$OUT/gpu_tests_engine.log"
    ;;
  confirm)
    # Is batch-1 async + auto at >= 90% of the floor reproducible? Two full runs, each with
    # its own copy-bandwidth floor and transformers baseline.
    for i in 1 2; do
      mkdir -p "$OUT/run$i"
      OUT="$OUT/run$i" timeout 280 python benchmarks/decode.py --batch-sizes 1 2>&1 \
        | grep -v tokenizer | tee "$OUT/run$i/decode.log" | grep -A4 "copy bandwidth"
    done
    ;;
  final-engine)
    timeout 560 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
      --durations=10 2>&1 | tee "$OUT/gpu_tests_engine.log" | tail -25
    ;;
  moe)
    # 570 s in all: tests <= 200 s, the kernel benchmark <= 90 s, moe_decode.py --quick the rest
    # (--budget-s: no configuration starts past it; its JSON is saved after each one).
    tests=(tests/test_moe_gpu.py)
    [ -f tests/test_moe_ops.py ] && tests+=(tests/test_moe_ops.py)
    timeout 200 python -m pytest -q -m gpu "${tests[@]}" -p no:cacheprovider --durations=8 \
      2>&1 | tee "$OUT/gpu_tests_moe.log" | tail -14
    if [ -f benchmarks/moe.py ]; then
      timeout 90 python benchmarks/moe.py --quick 2>&1 | tee "$OUT/moe_kernels.log" | tail -20
    fi
    left=$((570 - SECONDS))
    if [ "$left" -lt 150 ]; then
      echo "moe_decode.py not run: $left s left (run the moe-decode stage)"
    else
      timeout "$left" python benchmarks/moe_decode.py --quick --budget-s $((left - 90)) 2>&1 \
        | grep --line-buffered -v tokenizer | tee "$OUT/moe_decode.log" | tail -30
    fi
    ;;
  warmup)
    timeout 560 python -m pytest -q -s -m gpu tests/test_warmup.py tests/test_llm_lifetime.py \
      -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/gpu_tests_warmup.log" | tail -25
    ;;
  serve-plain | serve-eagle3)
    # Results stay in /tmp/sweep8b on the warm machine: the second half prints the compare.
    timeout 570 python benchmarks/serve_sweep.py --shape llama3-8b --labels "${1#serve-}" \
      --result-dir /tmp/sweep8b 2>&1 | grep --line-buffered -v "^INFO" \
      | tee "$OUT/serve_${1#serve-}.log" | tail -60
    ;;
  mla-prefill)
    timeout 570 python benchmarks/mla_prefill.py 2>&1 | grep --line-buffered -v tokenizer \
      | tee "$OUT/mla_prefill.log" | tail -12
    ;;
  oss)
    timeout 150 python -m pytest -q -m gpu tests/test_moe_mxfp4.py tests/test_gpt_oss_mxfp4.py \
      -p no:cacheprovider -rfE --tb=short 2>&1 | tee "$OUT/gpu_tests_oss.log" | tail -8
    [ -f benchmarks/mxfp4.py ] && timeout 200 python benchmarks/mxfp4.py 2>&1 \
      | tee "$OUT/mxfp4.log" | tail -30
    timeout 90 python benchmarks/timeline.py --shape gpt-oss-20b --rows 10 2>&1 \
      | grep -v -i "tokenizer\|warn" | tee "$OUT/timeline_oss.log" | tail -14
    timeout $((580 - SECONDS)) python benchmarks/gpt_oss_decode.py --quick \
      --budget-s $((480 - SECONDS)) 2>&1 | grep --line-buffered -v tokenizer \
      | tee "$OUT/gpt_oss_decode.log" | tail -20
    ;;
  serve-long)
    timeout 580 python benchmarks/serve_sweep.py --shape llama3-8b --result-dir /tmp/long 2>&1 \
      | grep --line-buffered -v "^INFO" | tee "$OUT/serve_long.log" | tail -40
    cp /tmp/long/*.json /tmp/long/sweep.png "$OUT/" 2>/dev/null
    ;;
  serve-short)
    timeout 570 python benchmarks/serve_sweep.py --shape llama3-8b --output-len 64 \
      --result-dir /tmp/sweep8b_short 2>&1 | grep --line-buffered -v "^INFO" \
      | tee "$OUT/serve_short.log" | tail -60
    ;;
  moe-decode)
    timeout 570 python benchmarks/moe_decode.py 2>&1 | grep --line-buffered -v tokenizer \
      | tee "$OUT/moe_decode.log" | tail -30
    ;;
  step)
    # Issue 23: the skinny matmul per row bucket, plain decode at batch 1 / 16, the EAGLE-3
    # step cost at K = 2 / 4 and batch 1 / 16 / 64 (async scheduling, decode_matmul=auto).
    timeout 200 python benchmarks/skinny.py 2>&1 | tee "$OUT/skinny.log" | tail -40
    timeout 150 python benchmarks/decode.py --no-hf --batch-sizes 1,16 2>&1 \
      | tee "$OUT/decode.log" | tail -14
    timeout $((580 - SECONDS)) python benchmarks/spec_step.py --ks 2,4 --batches 1,16,64 \
      --modes fused --async-scheduling 2>&1 | tee "$OUT/spec_step.log" | tail -14
    ;;
  timelines)
    # Batch-1 device timelines of the MoE / MLA / gpt-oss shapes (benchmarks/timeline.py).
    timeout 570 python benchmarks/timeline.py --shape "${SHAPES:-qwen3-30b-a3b,glm47-flash}" \
      2>&1 | grep --line-buffered -v tokenizer | tee "$OUT/timelines.log" | tail -120
    ;;
  verify)
    # What session 10 built but could not run on a GPU (device time ran out), most important
    # first; carry .whl (fastapi / uvicorn / aiohttp / jsonschema wheels) for the server tests.
    timeout 570 python -m pytest -q -rfE -m gpu \
      tests/test_warmup.py tests/test_mla_triton.py tests/test_graph_rows.py \
      tests/test_multi_layer_mtp_gpu.py tests/test_fp8_checkpoint.py tests/test_fp8_matmul.py \
      tests/test_draft_rows_gpu.py tests/test_gpu.py \
      -p no:cacheprovider --tb=short --timeout=250 --durations=8 2>&1 \
      | tee "$OUT/gpu_verify.log" | tail -40
    ;;
  remeasure)
    if [ "${PART:-moe}" = moe ]; then
      timeout 200 python benchmarks/moe_decode.py --quick --models qwen3 --budget-s 150 2>&1 \
        | tee "$OUT/moe_decode.log" | tail -12
      timeout $((580 - SECONDS)) python benchmarks/gpt_oss_decode.py --quick \
        --budget-s $((520 - SECONDS)) 2>&1 | tee "$OUT/gpt_oss_decode.log" | tail -20
    else
      timeout 560 python benchmarks/mla_decode.py --quick --budget-s 400 2>&1 \
        | tee "$OUT/mla_decode.log" | tail -30
    fi
    ;;
  mla-check)
    # Session 19's fused_qkv_a_proj (MLA's q_a + kv_a in one matmul) and the strided q_in
    # (written without a GPU): the MLA / fp8 / multi-layer MTP / fused-norm GPU tests. Then
    # `PART=mla bash benchmarks/gpu_session.sh remeasure` against session 16's 3.57 ms.
    timeout 560 python -m pytest -q -m gpu -p no:cacheprovider tests/test_mla_triton.py \
      tests/test_fp8_checkpoint.py tests/test_multi_layer_mtp_gpu.py tests/test_ops.py \
      tests/test_skinny.py -k "mla or fp8 or mtp or norm" 2>&1 | tee "$OUT/mla_check.log" | tail -8
    ;;
  coldplan)
    # decode_matmul=auto's start-up planning from an empty Triton cache (a fresh machine), the
    # candidates compiled in threads first (ops/plan_compile.PARALLEL) or one by one.
    for mode in ${MODES:-True False}; do
      TRITON_CACHE_DIR=$(mktemp -d) timeout 280 python -c "
import runpy, sys
import specserve.ops.plan_compile as g
g.PARALLEL = $mode
sys.argv = ['decode.py', '--no-hf', '--batch-sizes', '1']
runpy.run_path('benchmarks/decode.py', run_name='__main__')" 2>&1 \
        | grep -E "planned|compiled| 1 +[0-9.]+ " | sed "s/^/PARALLEL=$mode: /"
    done
    ;;
  b16)
    # Issue 23's batch-16 gap: where a Llama-3-8B batch-16 step goes, kernel by kernel.
    timeout 400 python benchmarks/timeline.py --shape llama3-8b --batch 16 --rows 40 --step-ms \
      2>&1 | grep -v Warning | tee "$OUT/timeline_b16.log" | tail -60
    ;;
  attn16)
    # Issue 23's batch 16 (session 20 ran it with PROMPT=1024: NUM_STAGES=5 became the default
    # for unsplit launches): GPU tests with the key pipeline at 3, then the Llama-3-8B batch-16
    # step per variant (and batch 1 for side effects: `BATCH=1 ... attn16`). Not yet run:
    # VARIANTS="base;$T.PROGRAMS_PER_SM=4" on top of the 5-stage default. PROMPT=1024: the serving sweep's contexts (84 +
    # 1536 tokens: ~850 on average), where batch-16 attention reads ~56 MB a layer and the
    # sweep's plain TPOT at concurrency 16 sits 0.8 ms above the 128-token decode step.
    T=specserve.attention.triton_paged
    timeout 200 python -c "
import sys, pytest
import specserve.attention.triton_paged as t
t.NUM_STAGES = 3
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/test_triton_attention.py']))
" 2>&1 | tail -2
    timeout $((585 - SECONDS)) python benchmarks/timeline_sweep.py --shape llama3-8b \
      --batch "${BATCH:-16}" --prompt-len "${PROMPT:-256}" --step-ms --variants \
      "${VARIANTS:-base;$T.NUM_STAGES=3;$T.NUM_STAGES=5;$T.PROGRAMS_PER_SM=4;$T.PROGRAMS_PER_SM=4,$T.NUM_STAGES=3;base}" \
      2>&1 | grep -E "^### |_paged|_combine|^variant|\| [0-9]+ \|" | tee "$OUT/attn16.log"
    ;;
  spec-timeline)
    # Issue 23's step cost: where an EAGLE-3 K = 4 step goes (drafting and verification), at
    # each batch (written in session 18, not yet run).
    for b in ${BATCHES:-1 16 64}; do
      timeout $((580 - SECONDS)) python benchmarks/timeline.py --shape llama3-8b --batch "$b" \
        --spec-k 4 --rows 30 2>&1 | grep -v -i "warn\|tokenizer" | tee "$OUT/spec_timeline_b$b.log" \
        | tail -45
    done
    ;;
  skinny-norm)
    # The decode plan (issue 23): the skinny / plan GPU tests, decode.py at batch 1 / 16 with
    # each shape's candidates at each row bucket as TB/s (RESULTS.md session 21: norm-fed qkv
    # 2.3, gate_up + SiLU 2.8-2.9, down 2.8, lm_head 3.0 at 2-16 rows), then the EAGLE-3 K=3 / 4
    # step ratios.
    timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_skinny.py \
      tests/test_plan_compile.py 2>&1 | tail -2
    timeout 240 python benchmarks/decode.py --no-hf --batch-sizes 1,16 2>&1 \
      | grep -v -i "warn\|tokenizer" > "$OUT/decode.log"
    grep -E "^ *(1|16) " "$OUT/decode.log" | head -8
    python benchmarks/plan_tbs.py "$OUT/decode.json"
    timeout $((585 - SECONDS)) python benchmarks/spec_step.py --ks 3,4 --batches 1,16,64 \
      --modes fused --async-scheduling 2>&1 | tee "$OUT/spec_step.log" | tail -12
    ;;
  ncu)
    # ncu replays each profiled kernel with the L2 flushed (its default cache control): the
    # cold-weight case of a decode step. Clocks left alone (METHOD.md).
    NCU=(ncu --clock-control none --set full --import-source no)
    timeout 240 "${NCU[@]}" --kernel-name regex:'_moe_mxfp4_(gate_up|down)_kernel_v5' \
      --launch-skip 16 --launch-count 4 python benchmarks/mxfp4.py --models gpt-oss-20b \
      --variants v5 --configs table --layers 2 >"$OUT/ncu_mxfp4.txt" 2>&1
    timeout 240 "${NCU[@]}" --kernel-name regex:'_moe_decode_(gate_up|down)' \
      --launch-skip 16 --launch-count 4 python benchmarks/moe.py --quick \
      --models qwen3-30b-a3b >"$OUT/ncu_moe.txt" 2>&1
    for f in "$OUT"/ncu_*.txt; do
      echo "== $f"
      grep -E "^  _moe|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occ|Theoretical Occ|Grid Size|Block Size|Waves Per SM|Stall Long|L2 Hit|One or More|No Eligible|Issued Warp|Warp Cycles Per Issued" "$f" | head -120
    done
    ;;
  early-params)
    # Session 22's switch (off): the attention's own parameters (Qwen3's fused qk-norm
    # weights, gpt-oss's sinks) loaded before the PDL wait. The GPU tests of the fused path
    # and the sinks with it on, then the step A/B on both shapes.
    T=specserve.attention.triton_paged
    timeout 200 python -c "import $T as t, sys, pytest; t.EARLY_ATTN_PARAMS = True; \
      sys.exit(pytest.main(['-q', '-m', 'gpu', 'tests/test_triton_attention.py', \
      'tests/test_triton_sinks.py', '-k', 'fused or sinks']))" 2>&1 | tail -3
    for S in qwen3-30b-a3b gpt-oss-20b; do
      timeout 200 python benchmarks/timeline_sweep.py --shape $S --step-ms \
        --variants "base;$T.EARLY_ATTN_PARAMS=True;base;$T.EARLY_ATTN_PARAMS=True" \
        2>&1 | tee "$OUT/early_params_$S.log" | grep -E "^###|attention|\|"
    done
    ;;
  pps)
    # Key splits for batches that fill the SMs once (T.PROGRAMS_PER_SM = 4: session 18's 2
    # splits at batch 16 saved 25-60 us a step, other batches unmeasured): the step at batches
    # 4 and 16, then plain and EAGLE-3 K = 4 at batches 1 and 16 (verification: 5 / 80 rows).
    T=specserve.attention.triton_paged
    for b in ${BATCHES:-4 16}; do
      timeout 200 python benchmarks/timeline_sweep.py --shape llama3-8b --batch "$b" --step-ms \
        --variants "base;$T.PROGRAMS_PER_SM=4" 2>&1 | tee "$OUT/pps_b$b.log" \
        | grep -E "_paged|_combine|^variant|\| [0-9]+ \|"
    done
    timeout $((585 - SECONDS)) python benchmarks/ab.py --tail 5 \
      --variants "base;$T.PROGRAMS_PER_SM=4" -- benchmarks/spec_step.py --ks 4 --batches 1,16 \
      --modes fused --async-scheduling 2>&1 | tee "$OUT/pps_spec.log"
    ;;
  sol)
    # What a latency-bound kernel costs the step (its exposed time, net of PDL overlap): each
    # variant replaces kernels by a launch that does nothing (D), so their outputs are garbage
    # (never used for anything but this timing; the models' own routing keeps every index in
    # range). GLM-4.7-Flash's MLA prologue / attention / merge, Qwen3-30B-A3B's attention and
    # split merge.
    D="type('D', (), {'__getitem__': lambda self, g: lambda *a, **k: None})()"
    A=specserve.attention
    # The prologue without its last program (the latent RMSNorm, k_pe RoPE and cache write):
    # whether that program is the prologue's straggler.
    P="(lambda K: type('P', (), {'__getitem__': lambda self, g: K[(g[0] - 1,)]})())"
    P="$P(__import__('$A.mla_fused', fromlist=['x'])._mla_prologue_kernel)"
    # SOL_SET=kv: only that, twice, GLM alone.
    KV="base;$A.mla_fused._mla_prologue_kernel=$P;base;$A.mla_fused._mla_prologue_kernel=$P"
    [ "${SOL_SET:-}" = kv ] && GLM_VARIANTS=$KV GLM_ONLY=1
    timeout 330 python benchmarks/timeline_sweep.py --shape glm47-flash --step-ms --variants \
      "${GLM_VARIANTS:-base;$A.mla_fused._mla_prologue_kernel=$D;$A.mla_triton._mla_merge_kernel=$D;$A.mla_fused._mla_prologue_kernel=$D,$A.mla_triton._mla_attention_kernel=$D,$A.mla_triton._mla_merge_kernel=$D}" \
      2>&1 | tee "$OUT/sol_glm.log" | grep -E "^###|^variant|\| [0-9]+ \|"
    [ -n "${GLM_ONLY:-}" ] && exit 0
    timeout $((585 - SECONDS)) python benchmarks/timeline_sweep.py --shape qwen3-30b-a3b \
      --step-ms --variants \
      "base;$A.triton_paged._combine_splits_kernel=$D;$A.triton_paged._paged_attention_kernel=$D,$A.triton_paged._combine_splits_kernel=$D" \
      2>&1 | tee "$OUT/sol_qwen3.log" | grep -E "^###|^variant|\| [0-9]+ \|"
    ;;
  persist)
    # The persistent gate_up (moe_triton.GATE_UP_PERSISTENT) as the tables now pick it, against
    # session 23's table config in waves; the expert stream alone first.
    M=specserve.ops.moe_triton
    INF="float('inf')"
    [ -z "${SKIP_STREAM:-}" ] && timeout 150 python benchmarks/moe_stream.py 2>&1 \
      | tee "$OUT/moe_stream.log" | tail -22
    timeout $((585 - SECONDS)) python benchmarks/timeline_sweep.py \
      --shape "${PERSIST_SHAPE:-qwen3-30b-a3b}" --step-ms --variants "${PERSIST_VARIANTS:-\
base;$M.GATE_UP_PERSISTENT={},$M.DECODE_GATE_UP_TABLE=(($INF, $INF, (4, 2048, 4)),);base}" \
      2>&1 | tee "$OUT/persist_steps.log" | grep -E "^###|^variant|\| [0-9]+ \|"
    ;;
  confirm24)
    # Session 24's defaults (persistent gate_up at Qwen3-30B-A3B, the MLA merge and prologue
    # loads): their GPU tests, then batch 1 of issues 21 and 18.
    timeout 170 python -m pytest -q -m gpu -p no:cacheprovider tests/test_mla_triton.py \
      tests/test_moe_ops.py -k "mla_fused or mla_model or qwen3 or graph" 2>&1 \
      | tee "$OUT/confirm_tests.log" | tail -4
    timeout 250 python benchmarks/mla_decode.py --quick --budget-s 60 2>&1 \
      | tee "$OUT/mla_decode.log" | tail -14
    timeout $((585 - SECONDS)) python benchmarks/moe_decode.py --quick --models qwen3 \
      --budget-s 60 2>&1 | tee "$OUT/moe_decode.log" | tail -12
    ;;
  mla-early)
    A=specserve.attention.mla_triton
    timeout 240 python -c "import sys, pytest, $A as m; m.EARLY_KV = True; \
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/test_mla_triton.py']))" \
      2>&1 | tee "$OUT/mla_early_tests.log" | tail -3
    timeout $((585 - SECONDS)) python benchmarks/timeline_sweep.py --shape glm47-flash \
      --step-ms --variants "base;$A.EARLY_KV=True;base;$A.EARLY_KV=True" 2>&1 \
      | tee "$OUT/mla_early_steps.log" | grep -E "^###|^variant|\| [0-9]+ \|"
    ;;
  tma)
    timeout 560 python benchmarks/verify_tile.py --kernel tma --rows "${TMA_ROWS:-16,64,80,128}" \
      2>&1 | tee "$OUT/verify_tma.log" | grep -v "^  " | tail -30
    ;;
  split-tiles)
    T=specserve.attention.triton_paged
    timeout 150 python -c "import sys, pytest, $T as t; t.SPLIT_BLOCK_N = 16; \
t.SPLIT_EARLY_KV = True; sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', \
'tests/test_triton_attention.py', '-k', 'fused_kv_write_gpu or split_kv_gpu']))" 2>&1 \
      | tee "$OUT/split_tiles_tests.log" | tail -3
    timeout $((585 - SECONDS)) python benchmarks/timeline_sweep.py \
      --shape "${TILE_SHAPE:-qwen3-30b-a3b}" --step-ms --variants "${TILE_VARIANTS:-\
base;$T.SPLIT_BLOCK_N=0;$T.SPLIT_EARLY_KV=True;$T.SPLIT_BLOCK_N=32;base}" 2>&1 \
      | tee "$OUT/split_tiles_steps.log" | grep -E "^variant|^base|^spec|_paged_attention_kernel|_combine"
    ;;
  overhead)
    # PDL for the step's bookkeeping kernels (spec_kernels_triton.PDL_STEP_KERNELS): its GPU
    # tests, then EAGLE-3 K = 4 at batch 1 (Llama-3-8B), where the draft loop's kernels run too,
    # base not first (the first variant of a fresh machine ran 6% slow in session 26).
    P=specserve.ops.spec_kernels_triton.PDL_STEP_KERNELS=True
    if [ -z "${SKIP_TESTS:-}" ]; then
      timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_spec_kernels.py \
        -k "step_kernels_pdl" 2>&1 | tee "$OUT/overhead_tests.log" | tail -3
    fi
    timeout $((585 - SECONDS)) python benchmarks/ab.py --tail 4 \
      --variants "$P;base;$P;base" -- benchmarks/spec_step.py --ks 4 --batches 1 \
      --modes fused --async-scheduling 2>&1 | tee "$OUT/overhead_spec.log" | grep -v tokenizer
    ;;
  route-warp)
    # The router's choice: one partial sort (moe_router.ROUTE_TOPK_SORT, the default since
    # session 27) against the k rounds (ROUTE_TOPK_SORT=False, the fallback): GPU tests, then
    # batch-1 steps (ROUTE_SHAPES, default Qwen3; then ROUTE_SHAPES=glm47-flash SKIP_TESTS=1).
    # The one-warp / preload-all experiments were dropped (session 27; commit 7c598c7).
    R=specserve.ops.moe_router
    K=$R.ROUTE_TOPK_SORT=False
    if [ -z "${SKIP_TESTS:-}" ]; then
      timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_router.py \
        tests/test_moe_gpu.py -k "real_shapes or k_rounds or router_variants" 2>&1 \
        | tee "$OUT/route_warp_tests.log" | tail -3
    fi
    for s in ${ROUTE_SHAPES:-qwen3-30b-a3b}; do
      timeout $((585 - SECONDS)) python benchmarks/timeline_sweep.py --shape "$s" --step-ms \
        --variants "${ROUTE_VARIANTS:-base;$K;base;$K}" 2>&1 \
        | tee "$OUT/route_warp_$s.log" | grep -E "^variant|^base|^spec|_norm_route"
    done
    ;;
  confirm27)
    # Issue 18's EAGLE-3 step with the router's sort on / off (k rounds), then issue 21's
    # figures with the defaults.
    # (A budget of 60 s skips every row: the model's build counts against it.)
    timeout 300 python benchmarks/ab.py --tail 7 --variants \
      "specserve.ops.moe_router.ROUTE_TOPK_SORT=False;base" -- \
      benchmarks/moe_decode.py --quick --models qwen3 --budget-s 150 2>&1 | tee "$OUT/ab_qwen3.log"
    timeout $((590 - SECONDS)) python benchmarks/mla_decode.py --quick --budget-s 330 2>&1 \
      | tee "$OUT/mla_decode.log" | tail -16
    ;;
  softmax28)
    # Renormalized softmax routers as the k best logits' softmax (moe_router.ROUTE_SOFTMAX_TOPK:
    # the choosing program without the full softmax's reductions): GPU tests, Qwen3 batch-1
    # steps, then issue 18's figures with and without it.
    S=specserve.ops.moe_router.ROUTE_SOFTMAX_TOPK=True
    timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_router.py \
      tests/test_moe_gpu.py -k "softmax_topk or SOFTMAX_TOPK" 2>&1 | tee "$OUT/softmax_tests.log" \
      | tail -3
    timeout $((400 - SECONDS)) python benchmarks/timeline_sweep.py --shape qwen3-30b-a3b \
      --step-ms --variants "base;$S;base;$S" 2>&1 | tee "$OUT/softmax_qwen3.log" \
      | grep -E "^variant|^base|^spec|_norm_route"
    timeout $((590 - SECONDS)) python benchmarks/ab.py --tail 7 --variants "base;$S" -- \
      benchmarks/moe_decode.py --quick --models qwen3 --budget-s 150 2>&1 \
      | tee "$OUT/softmax_moe_decode.log"
    ;;
  head29)
    # Session 29's call 6, dropped (slower): the lm_head captured in plain engines' decode
    # graphs (batches 1-8) and the greedy keys taken by the token write (no launch of their
    # own), from benchmarks/experiments/lm-head-in-graph.patch (applied to the device's copy
    # here): GPU tests, an A/B of Qwen3-30B-A3B's batch-1 step against G.FUSED=False (neither),
    # then issue 18's figure twice.
    git apply benchmarks/experiments/lm-head-in-graph.patch || exit 1
    timeout 300 python -m pytest -q -m gpu tests/test_ops.py tests/test_spec_kernels.py \
      tests/test_gpu.py tests/test_moe_gpu.py -k "argmax or write_verified or greedy_head \
or bf16_graphs_equal or test_cudagraph_equals_eager" 2>&1 | tail -4
    G=specserve.ops.greedy_head
    timeout 200 python benchmarks/timeline_sweep.py --shape qwen3-30b-a3b --step-ms \
      --variants "$G.FUSED=False;base" 2>&1 | tee "$OUT/head29.log" \
      | grep -E "^variant|^base|^spec|^span|^outside"
    for i in 1 2; do
      timeout $((590 - SECONDS)) python benchmarks/moe_decode.py --quick --models qwen3 \
        --budget-s 150 2>&1 | tee "$OUT/moe_decode_$i.log" \
        | grep -E "copy bandwidth|^ Qwen3|target|check"
    done
    ;;
  h200)
    # Session 30: the first H200 lease (H100s no longer lent). MoE GPU sanity, issue 18's
    # batch-1 figure on this chip, then the Qwen3-30B-A3B batch-1 kernel timeline.
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    timeout 200 python -m pytest -q -m gpu \
      "tests/test_moe_gpu.py::test_moe_bf16_graphs_equal_eager_and_track_transformers" \
      tests/test_gpu.py::test_greedy_head_epilogue_in_the_engine_cuda 2>&1 | tail -3
    timeout 200 python benchmarks/moe_decode.py --quick --models qwen3 --budget-s 150 2>&1 \
      | tee "$OUT/moe_decode.log" | grep -E "copy bandwidth|^ Qwen3|target|check"
    timeout $((590 - SECONDS)) python benchmarks/timeline.py --shape qwen3-30b-a3b --step-ms \
      2>&1 | grep --line-buffered -v tokenizer | tee "$OUT/timeline.log" | tail -60
    ;;
  h200-step)
    # Session 30: issue 23's figures on the H200 (H100s no longer lent): plain decode at batch
    # 1 / 16 against the floor, the EAGLE-3 K = 4 step at batch 1 / 16 / 64.
    timeout 150 python benchmarks/decode.py --no-hf --batch-sizes 1,16 2>&1 \
      | tee "$OUT/decode.log" | tail -14
    timeout $((580 - SECONDS)) python benchmarks/spec_step.py --ks 4 --batches 1,16,64 \
      --modes fused --async-scheduling 2>&1 | tee "$OUT/spec_step.log" | tail -14
    ;;
  h200-tests)
    # Session 30: every GPU test on the H200 (or TESTS=...), four pytest-xdist workers on the
    # one GPU (the machine's 16 cores compile in parallel), cut at LIMIT seconds (480).
    # -o addopts="": pyproject's -q would cancel -v (session 30's call 3 printed dots only).
    timeout ${LIMIT:-480} python -m pytest -o addopts="" -m gpu ${TESTS:-tests} -n 4 -v \
      --timeout=300 -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" \
      | grep -E "FAILED|ERROR|passed|failed" | tail -40
    ;;
  confirm29)
    # The greedy epilogue's GPU tests (kernel and engine), then issue 18's batch-1 figure twice
    # (the floor moves with each run's copy measurement).
    timeout 200 python -m pytest -q -m gpu tests/test_ops.py -k "argmax" \
      tests/test_gpu.py::test_greedy_head_epilogue_in_the_engine_cuda \
      "tests/test_moe_gpu.py::test_moe_bf16_graphs_equal_eager_and_track_transformers" 2>&1 \
      | tail -3
    for i in 1 2; do
      timeout 200 python benchmarks/moe_decode.py --quick --models qwen3 --budget-s 150 2>&1 \
        | tee "$OUT/moe_decode_$i.log" | grep -E "copy bandwidth|^ Qwen3|target|check"
    done
    ;;
  greedy29)
    # The lm_head gemv's argmax epilogue (ops/greedy_head.py: no argmax launches after it),
    # A/B on Qwen3-30B-A3B's batch-1 step; first its GPU tests. (Session 29's call 1 also ran
    # the lm_head's first 16 / 32 MiB pinned in the L2, since removed: ops/l2.py.)
    timeout 240 python -m pytest -q -m gpu tests/test_ops.py -k "argmax or gemv" 2>&1 | tail -3
    G=specserve.ops.greedy_head
    timeout $((585 - SECONDS)) python benchmarks/timeline_sweep.py --shape qwen3-30b-a3b \
      --step-ms --variants "$G.FUSED=False;base;$G.FUSED=False;base" 2>&1 \
      | tee "$OUT/greedy29.log" | grep -E "^variant|^base|^spec|argmax|_take|^span|^outside"
    ;;
  confirm28)
    # Issue 18's and 21's batch-1 figures with session 28's defaults: Qwen3-30B-A3B twice (the
    # floor moves with each run's copy measurement), then GLM-4.7-Flash.
    for i in 1 2; do
      timeout 200 python benchmarks/moe_decode.py --quick --models qwen3 --budget-s 150 2>&1 \
        | tee "$OUT/moe_decode_$i.log" | grep -E "copy bandwidth|^ Qwen3|target|check"
    done
    timeout $((590 - SECONDS)) python benchmarks/mla_decode.py --quick --budget-s 330 2>&1 \
      | tee "$OUT/mla_decode.log" | tail -18
    ;;
  early28)
    # With the o projection's whole grid preloading during attention (session 28), attention
    # shares HBM with that stream: its first key tile before the PDL wait (SPLIT_EARLY_KV), and
    # 32-key split tiles (fewer live splits to merge), A/B on Qwen3-30B-A3B's batch-1 step.
    T=specserve.attention.triton_paged
    timeout 400 python benchmarks/timeline_sweep.py --shape qwen3-30b-a3b --step-ms --variants \
      "base;$T.SPLIT_EARLY_KV=True;$T.SPLIT_BLOCK_N=32;base;$T.SPLIT_EARLY_KV=True" 2>&1 \
      | tee "$OUT/early28.log" | grep -E "^variant|^base|^spec|_paged_attention|_combine"
    ;;
  confirm26)
    # Issue 21's and 18's figures with the defaults.
    timeout 400 python benchmarks/mla_decode.py --quick --budget-s 330 2>&1 \
      | tee "$OUT/mla_decode.log" | tail -16
    timeout $((585 - SECONDS)) python benchmarks/moe_decode.py --quick --models qwen3 \
      --budget-s 100 2>&1 | tee "$OUT/moe_decode.log" | tail -12
    ;;
  *)
    echo "usage: $0 MODE (the modes are listed at the top of this file):" >&2
    echo "  tests e2e ptd speed recheck splits fuse overlap check decode next-tests next-sweep final-kernels final-tests confirm final-engine moe warmup mla-prefill oss serve-plain serve-eagle3 serve-long serve-short moe-decode step timelines verify remeasure mla-check coldplan b16 attn16 spec-timeline skinny-norm ncu early-params pps sol persist confirm24 mla-early tma split-tiles overhead confirm26 route-warp confirm27 softmax28 confirm28 early28" >&2
    exit 2
    ;;
esac
