#!/usr/bin/env bash
# The soak, the malformed requests and the engine-core fault (issue:
# reliability) on a GPU host, in one call: three `serving.soak` runs on one
# GPU, each started once the candidates before it are up, each with its own
# non-speculative reference server, on the trained fast-apply fixture (its
# chat template added by `serving make-model fastapply`).
#
#   bash serving/gpu_soak.sh            # ~9 min
#
#   soak-ngram  n-gram k=64 (lookup 2..10): SOAK_CLIENTS clients for
#               SOAK_DURATION s, then the malformed requests
#               (serving/bad_requests.py) against the loaded server
#   soak-mtp    MTP k=3 (the fixture's trained head), the same load
#   fault-mtp   MTP k=3, SOAK_FAULT_REQUESTS requests; after a third of them
#               completed, its engine core is SIGKILLed; restart and replay
#   dp2-ngram   n-gram k=64 with --data-parallel-size 2 (two engine cores,
#   dp2-mtp     one GPU each: CUDA_VISIBLE_DEVICES with two GPUs), resp. MTP
#               k=3, SOAK_DP_REQUESTS requests, against the reference at
#               DP=1 (every greedy answer compared as in the soaks)
#
# Every server: chunked prefill with a per-step budget of 512 tokens, prefix
# caching (align mode for the fixture's Gated DeltaNet layers), a KV pool
# small enough that 64 running sequences preempt (the soaks require
# preemptions > 0), CUDA graphs, Triton attention. The pool is in bytes and
# a token's cost depends on the drafter: with n-gram k=64 in align mode the
# Mamba page holds more and the attention block grows to 208 tokens; with
# MTP k=3 the block is 80 tokens. A pool too small does not preempt either:
# the scheduler then admits only as many requests as fit, and those few
# never outgrow it. On an H200 the n-gram candidate with 3.5e7 bytes (25
# blocks) ran one request at a time, each holding 63 % of the pool, and
# neither it nor 6e7 (43 blocks, on an H100) preempted in 5 minutes; 2.5e7
# is below one 4,096-token request and does not start. MTP with 2.5e7 (136
# blocks) ran 18-24 requests and preempted 1,521 times.
# The n-gram candidate is held back by its per-step token budget first:
# each running request schedules up to 65 tokens a step, so 512 tokens fit
# about 7, and pools of 6e7, 1.2e8 and 2.5e8 bytes (42, 85 and 179 blocks,
# about 15 per request) ran 1-2, 4-5 and 5-7 requests with about 270
# waiting and, in the largest, 38-57 % of the pool free: no preemption in
# 5 minutes, even with long answers. So its candidate gets
# SOAK_NGRAM_BUDGET (1024) tokens a step, enough for about 15 requests,
# and SOAK_KV_NGRAM (1.2e8) holds about 5 of them: the pool, not the
# budget, is what runs out. Its
# requests also have to grow once admitted: a fast-apply answer ends
# within one 208-token block, so every tenth asks for SOAK_LONG_TOKENS
# tokens with ignore_eos (serving.soak --long-tokens). With 1,024 the
# candidate ran 4-5 requests with 73-92 % of the pool in use and still
# never preempted: the scheduler admits a request only when its prompt
# fits beside the blocks in-flight prefills hold, and the 7-8 blocks left
# outlasted what the running answers grew by (about 5 blocks for a long
# one) before one of them finished. 3,072 tokens (the prompts are 57-228
# tokens, max_model_len 4,096) grow a long answer by about 15 blocks, so
# two long answers running together outgrow what is left.
# A call can try several pools side by side (RUN@BYTES, below).
# The runs share the GPU: correctness checks only, no timing is judged.
#
# A fresh host compiles each candidate for minutes (270-360 s beside other
# work; 62-66 s from a warm cache), too long for five minutes of load in
# one call.
# The compile caches live in $SOAK_WORK (default /tmp/soak-work), one per
# drafter (cache-ngram, cache-mtp), so a short first call warms them for
# the next ones on the same host:
#
#   SOAK_ARGS="--duration 0 --requests 32" SOAK_RUNS="soak-ngram soak-mtp" \
#     bash serving/gpu_soak.sh                      # warm up (and a smoke test)
#   SOAK_STAGGER=0 SOAK_RUNS="soak-ngram soak-mtp" bash serving/gpu_soak.sh
#   SOAK_RUNS=fault-mtp bash serving/gpu_soak.sh
#
# A run named RUN@BYTES is RUN with a pool of BYTES (its results in
# RUN-BYTES, its servers on ports of their own), so that one call can try
# several pool sizes side by side:
#
#   SOAK_STAGGER=0 SOAK_RUNS="soak-ngram@1.2e8 soak-ngram@2.5e8" bash serving/gpu_soak.sh
#
# Every run ends, its servers stopped, by SOAK_DEADLINE seconds after this
# script started (+20 s hang guard): give the GPU call at least 60 s more.
# Results in $OUT: one archive per run (RUN.tgz: soak.json / .md / .png,
# bad_requests.md, server logs) and SOAK.md, the three summaries. Exit 0
# when every run passed.
#
# Environment: SOAK_CLIENTS (256), SOAK_DURATION (300), SOAK_FAULT_REQUESTS
# (3000), SOAK_DP_REQUESTS (2000), SOAK_KV_DP (4e8), SOAK_KV_NGRAM (1.2e8), SOAK_NGRAM_BUDGET (1024), SOAK_KV_MTP
# (2.5e7), SOAK_KV_REF (4e9 bytes, the references' pool), SOAK_MAX_SEQS (64), SOAK_LONG_TOKENS (3072; 0: no long requests),
# SOAK_DEADLINE (540: the
# load stops 120 s before it, then the checks),
# SOAK_RUNS ("soak-ngram soak-mtp fault-mtp"), SOAK_STAGGER (1: each run
# starts once the candidates before it are up; 0 once the caches are warm),
# SOAK_ARGS, SOAK_PORT_BASE (the first port of the runs, 20 a run; unset:
# 9000 for RUN@BYTES runs, the kind's own for the others), PYTHON (python3),
# SOAK_BUNDLE_ENV
# (/tmp/hybridspec/env.sh; "none" to use this Python's vLLM).
set -u
R=$PWD
T0=$SECONDS
OUT=${OUT:-$R/out}
WORK=${SOAK_WORK:-/tmp/soak-work}
CLIENTS=${SOAK_CLIENTS:-256}
DURATION=${SOAK_DURATION:-300}
FAULT_REQUESTS=${SOAK_FAULT_REQUESTS:-3000}
KV_NGRAM=${SOAK_KV_NGRAM:-1.2e8}
NGRAM_BUDGET=${SOAK_NGRAM_BUDGET:-1024}
KV_MTP=${SOAK_KV_MTP:-2.5e7}
KV_REF=${SOAK_KV_REF:-4000000000}
SEQS=${SOAK_MAX_SEQS:-64}
LONG=${SOAK_LONG_TOKENS:-3072}
DEADLINE=${SOAK_DEADLINE:-540}
KV_DP=${SOAK_KV_DP:-4e8}
DP_REQUESTS=${SOAK_DP_REQUESTS:-2000}
RUNS=${SOAK_RUNS:-soak-ngram soak-mtp fault-mtp}
ENVF=${SOAK_BUNDLE_ENV:-/tmp/hybridspec/env.sh}
PY=${PYTHON:-python3}
# shellcheck disable=SC1090
[[ $ENVF == none ]] || source "$ENVF"
# FlashInfer off (where the bundle carries it): every server would
# autotune and JIT-compile it at start (hsfork/flashinfer_toggle.sh)
[[ $ENVF == none ]] || [ ! -d /tmp/hybridspec/deps ] ||
  bash "$R/hsfork/flashinfer_toggle.sh" off
export VLLM_USE_FLASHINFER_SAMPLER=0
mkdir -p "$OUT" "$WORK"
MODEL=$WORK/fastapply
[ -f "$MODEL/config.json" ] ||
  "$PY" -m serving make-model fastapply "$MODEL" || exit 1
ENGINE="--gdn-prefill-backend triton --language-model-only"
ENGINE+=" --limit-mm-per-prompt '{\"image\":0,\"video\":0}'"
ENGINE+=" --attention-backend TRITON_ATTN --enable-prefix-caching"
ENGINE+=" --max-num-batched-tokens 512"
# the references run eager: they start faster and compile nothing while
# the candidates are loaded (the comparison is margin-aware). A reference
# has a pool of its own (SOAK_KV_REF): --kv-bytes sizes the candidate's to
# preempt, and a reference that preempts as well answered its replay at a
# fraction of its speed. It answers the candidate's greedy requests while
# the load runs (serving.soak): eager, it decodes about 3,000 tokens/s at
# 64 sequences, and the distinct answers of five minutes of load (about
# 450,000 tokens with the long ones) left after the load outlasted the
# deadline.
common=(--model "$MODEL" --server ref=none
  --server-args "ref=--enforce-eager --kv-cache-memory-bytes=$KV_REF"
  --clients "$CLIENTS"
  --max-num-seqs "$SEQS" --gpu-mem 0.08
  --engine-args "$ENGINE")
declare -A ARGS=(
  [soak-ngram]="--server cand=ngram --kv-bytes $KV_NGRAM --duration $DURATION --expect-preemption --bad-requests --long-tokens $LONG --server-args cand=--max-num-batched-tokens=$NGRAM_BUDGET --port 8400"
  [soak-mtp]="--server cand=mtp --kv-bytes $KV_MTP --duration $DURATION --expect-preemption --port 8500"
  [fault-mtp]="--server cand=mtp --kv-bytes $KV_MTP --duration 0 --requests $FAULT_REQUESTS --fault kill-engine --kill-after $((FAULT_REQUESTS / 3)) --port 8600"
  [dp2-ngram]="--server cand=ngram --kv-bytes $KV_DP --duration 0 --requests $DP_REQUESTS --server-args cand=--data-parallel-size=2 --port 8700"
  [dp2-mtp]="--server cand=mtp --kv-bytes $KV_DP --duration 0 --requests $DP_REQUESTS --server-args cand=--data-parallel-size=2 --port 8800"
)
# SOAK_ARGS: more soak arguments for every run (the last of an option wins;
# the CPU dry run passes a fake server and a request count)
eval "EXTRA=(${SOAK_ARGS:-})"
# RUN@BYTES -> RUN-BYTES, the folder and summary name of a run
run_name() { if [[ $1 == *@* ]]; then echo "${1%@*}-${1#*@}"; else echo "$1"; fi; }
pids=()
started=()
i=0
for spec in $RUNS; do
  kind=${spec%@*}
  run=$(run_name "$spec")
  own=()
  # after the kind's arguments: the last of an option wins. Ports: a
  # RUN@BYTES run's from SOAK_PORT_BASE (9000), 20 a run; with
  # SOAK_PORT_BASE set, every run's (runs overlap in time: each needs
  # ports of its own)
  if [[ $spec == *@* ]]; then
    own=(--kv-bytes "${spec#*@}" --port $((${SOAK_PORT_BASE:-9000} + 20 * i)))
  elif [[ -n ${SOAK_PORT_BASE:-} ]]; then
    own=(--port $((SOAK_PORT_BASE + 20 * i)))
  fi
  i=$((i + 1))
  if ((${#started[@]})) && [[ ${SOAK_STAGGER:-1} != 0 ]]; then
    # each run starts once the candidates of the runs before it are up:
    # servers that start together compile the same Triton kernels at once
    # (on a fresh host 6 of them took 260-350 s where one takes about 70 s),
    # while a later one finds them in the cache; the soaks need their
    # minutes of load inside the deadline (a hang guard of half of it)
    for ((w = 0; w < DEADLINE / 2; w += 2)); do
      ready=1
      for r in "${started[@]}"; do
        grep -q "launched ref" "$WORK/$r.log" 2>/dev/null || ready=0
      done
      ((ready)) && break
      sleep 2
    done
  fi
  started+=("$run")
  # a run's folder from an earlier call (the compile caches stay in $WORK)
  # would otherwise stand in for this run's results if it fails to start
  rm -rf "${WORK:?}/$run" "$WORK/$run.log"
  # SOAK_DEADLINE counts from this script's start, for every run, a later
  # one included; a hang guard 20 s past it, so that this script always
  # gets to pack what each run left before the GPU call's own limit
  left=$((DEADLINE - (SECONDS - T0)))
  ((left > 60)) || { echo "[gpu_soak] $run: no time left, not started"; continue; }
  # shellcheck disable=SC2086
  timeout -k 10 $((left + 20)) "$PY" -m serving soak "${common[@]}" ${ARGS[$kind]} \
    "${own[@]}" --deadline "$left" \
    --cache-root "$WORK/cache-${kind#*-}" --out "$WORK/$run" "${EXTRA[@]}" \
    > "$WORK/$run.log" 2>&1 &
  pids+=($!)
  sleep 3
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
: > "$OUT/SOAK.md"
for spec in $RUNS; do
  run=$(run_name "$spec")
  { echo "## $run"; echo
    cat "$WORK/$run/soak.md" 2>/dev/null || tail -20 "$WORK/$run.log"
    echo; } >> "$OUT/SOAK.md"
  cp "$WORK/$run.log" "$WORK/$run/" 2>/dev/null
  tar -czf "$OUT/$run.tgz" -C "$WORK" "$run"
done
cat "$OUT/SOAK.md"
exit $rc
