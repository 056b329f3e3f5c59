#!/usr/bin/env bash
# `vllm bench serve` for the fork and upstream v0.26.0 in one GPU call
# (benchmarks/serve_bench.py): servers one at a time, fork and upstream
# interleaved, each started, benchmarked over the concurrency list, stopped.
# Needs the bundle installed at /tmp/hybridspec (hsfork/install_bundle.sh);
# run from the repository root.
#
#   bash benchmarks/gpu_serve_bench.sh fastapply   # ~6-9 min
#       the fast-apply fixture (serving/make_model.py's copy with the chat
#       template, served with --tokenizer DIR/tokenizer), specs none, ngram
#       (k=64, lookup 2..10), mtp (k=3) x {fork, upstream}, concurrency
#       1/8/32, fast-apply prompts (custom dataset), TRITON_ATTN
#   bash benchmarks/gpu_serve_bench.sh qwen9b      # ~6-8 min
#       the Qwen3.5-9B shape with random weights (serving/make_model.py,
#       19 GB), no speculation x {fork, upstream}, concurrency 1/8/32/64,
#       random dataset (256 in, 128 out), FLASH_ATTN; the device copy
#       bandwidth and the weight bytes a decode step reads (weight-read floor)
#
# Results in $OUT: SUITE.tgz (runs/*.json: vLLM's saved results; meta.json;
# SUITE.md / .json / .png: tables, summary, plot; logs/) and SUITE.md again
# beside it. Exit status: serve_bench's (0: every server ran every
# concurrency; 1: something missing; 2: setup error; 124: watchdog).
#
# Environment:
#   BENCH_BUDGET   seconds for the whole call (default 560); 0: no budget
#                  (dry runs: every step waits for its condition, nothing is
#                  skipped for lack of time)
#   BENCH_SPECS    specs (presets of serving/serve_check.py), e.g. none,mtp
#   BENCH_CONC     concurrency list, e.g. 1,8,32
#   BENCH_ARGS     extra serve_bench run arguments (e.g. --prompts-mult 8)
#   BENCH_CLI      run this per concurrency instead of the in-process client,
#                  e.g. "python3 -m vllm.entrypoints.cli.main bench serve"
#   BENCH_ENGINE   extra vllm serve flags for every server
#   BENCH_EAGER=1  --enforce-eager (faster start, no CUDA graphs)
#   BENCH_KV_BYTES --kv-cache-memory-bytes per server
#   BENCH_MODEL_DIR where qwen9b writes its checkpoint (default /dev/shm or
#                  /tmp; removed at the end)
#   dry runs on a CPU host (tests): BENCH_BUNDLE_ENV=none, BENCH_VLLM_CMD
#   (e.g. "python -m serving.fake_server", both variants), BENCH_DEVICE=cpu
#   (model writing and bandwidth), BENCH_TINY=1, BENCH_BANDWIDTH_GIB
set -u
SUITE=${1:-}
if [[ $SUITE != fastapply && $SUITE != qwen9b ]]; then
  echo "usage: bash benchmarks/gpu_serve_bench.sh fastapply | qwen9b" >&2
  exit 2
fi
R=$PWD
OUT=${OUT:-$R/out}
WORK=${BENCH_WORK:-/tmp/serve-bench-work}
BUDGET=${BENCH_BUDGET:-560}
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
# serve_bench's --deadline, keeping $1 s back (at least 1); 0 (none) without
# a budget
deadline() {
  ((BUDGET > 0)) || { echo 0; return; }
  local d=$(($(left) - $1))
  echo $((d < 1 ? 1 : d))
}
mkdir -p "$OUT" "$WORK"
rm -rf "${WORK:?}/$SUITE"
# shellcheck disable=SC1091
PREFIX=BENCH NAME=gpu_serve_bench source "$R/serving/host_env.sh"
DEV=${BENCH_DEVICE:-cuda}
CLI=()
[[ -n ${BENCH_CLI:-} ]] && CLI=(--bench-cli "$BENCH_CLI")

# the two vLLM installs: the bundle's fork site and upstream v0.26.0 (the
# same site with the patch series reversed, harness/upstream_site.sh)
VARIANTS=()
META=()
if [[ -n ${BENCH_VLLM_CMD:-} ]]; then
  VARIANTS=(--variant "fork=$BENCH_VLLM_CMD" --variant "upstream=$BENCH_VLLM_CMD")
else
  # shellcheck disable=SC1091
  source "$R/harness/upstream_site.sh" && make_upstream_site || {
    echo "gpu_serve_bench: could not make the upstream site" >&2
    exit 2
  }
  # upstream_site.sh sourced env.sh again: this checkout first again
  export PYTHONPATH="$R:$PYTHONPATH"
  fp() { grep -q "def mark_zero_draft_decodes" "$1/vllm/v1/spec_decode/utils.py" 2>/dev/null && echo 1 || echo 0; }
  FP_FORK=$(fp "$BUNDLE_SITE")
  FP_UP=$(fp "$(_site_dir upstream)")
  echo "[gpu_serve_bench] fork patches present: fork site $FP_FORK, upstream site $FP_UP"
  if [[ $FP_FORK != 1 || $FP_UP != 0 ]]; then
    echo "gpu_serve_bench: the sites are not fork / upstream as expected" >&2
    exit 2
  fi
  META=(--meta "fork_site_patched=$FP_FORK" --meta "upstream_site_patched=$FP_UP")
  VARIANTS=(
    --variant "fork=env $(variant_env fork) $PY -m vllm.entrypoints.cli.main"
    --variant "upstream=env $(variant_env upstream) $PY -m vllm.entrypoints.cli.main"
  )
fi
{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv,noheader 2>&1
  "$PY" -c 'import vllm, torch; print("vllm", vllm.__version__, vllm.__file__); print("torch", torch.__version__)' 2>&1
} >"$WORK/host.txt"
head -3 "$WORK/host.txt"

case $SUITE in
fastapply)
  MODEL=$WORK/fastapply-model
  "$PY" -m serving.make_model fastapply "$MODEL" >/dev/null || exit 1
  # shellcheck disable=SC2086
  "$PY" -m benchmarks.serve_bench run --suite fastapply --model "$MODEL" \
    --tokenizer "$MODEL/tokenizer" --out "$WORK/$SUITE" \
    --specs "${BENCH_SPECS:-none,ngram,mtp}" --concurrency "${BENCH_CONC:-1,8,32}" \
    --max-model-len 2048 --gpu-mem 0.1 --kv-bytes "${BENCH_KV_BYTES:-4e9}" \
    --engine-args "$ENGINE --tokenizer $MODEL/tokenizer --attention-backend TRITON_ATTN" \
    --server-estimate 110 --python "$PY" "${VARIANTS[@]}" "${META[@]}" "${CLI[@]}" \
    --deadline "$(deadline 25)" ${BENCH_ARGS:-} 2>&1 | tee "$WORK/$SUITE.log" | tail -60
  rc=${PIPESTATUS[0]}
  ;;
qwen9b)
  MODEL=${BENCH_MODEL_DIR:-/tmp/serve-bench-qwen9b}
  if [[ -z ${BENCH_MODEL_DIR:-} && -d /dev/shm ]] &&
    (($(df -Pk /dev/shm | awk 'NR==2 {print $4}') > 26000000)); then
    MODEL=/dev/shm/serve-bench-qwen9b
  fi
  rm -rf "$MODEL"
  TINY=()
  [[ ${BENCH_TINY:-0} == 1 ]] && TINY=(--tiny)
  LIMIT=()
  if ((BUDGET > 0)); then
    MT=$(($(left) - 300))
    ((MT < 60)) && MT=60
    LIMIT=(timeout "$MT")
  fi
  "${LIMIT[@]}" "$PY" -m serving.make_model qwen9b "$MODEL" --device "$DEV" "${TINY[@]}" \
    >"$WORK/make_model.log" 2>&1 || { tail -20 "$WORK/make_model.log"; rm -rf "$MODEL"; exit 1; }
  echo "[gpu_serve_bench] model written after $((SECONDS - T0)) s: $(du -sh "$MODEL" | cut -f1)"
  # shellcheck disable=SC2086
  "$PY" -m benchmarks.serve_bench run --suite qwen9b --model "$MODEL" \
    --out "$WORK/$SUITE" --specs "${BENCH_SPECS:-none}" \
    --concurrency "${BENCH_CONC:-1,8,32,64}" --dataset random \
    --input-len 256 --output-len 128 --prompts-min 8 --prompts-mult 2 \
    --max-model-len 4096 --gpu-mem 0.3 --kv-bytes "${BENCH_KV_BYTES:-8e9}" \
    --engine-args "$ENGINE --attention-backend ${BENCH_ATTN:-FLASH_ATTN}" \
    --server-estimate 170 --python "$PY" "${VARIANTS[@]}" "${META[@]}" "${CLI[@]}" \
    --weights --bandwidth --bandwidth-device "$DEV" \
    --bandwidth-gib "${BENCH_BANDWIDTH_GIB:-4}" \
    --deadline "$(deadline 25)" ${BENCH_ARGS:-} 2>&1 | tee "$WORK/$SUITE.log" | tail -60
  rc=${PIPESTATUS[0]}
  cp "$MODEL/serving_model.json" "$WORK/$SUITE/" 2>/dev/null
  rm -rf "$MODEL"
  ;;
esac
mkdir -p "$WORK/$SUITE"
cp "$WORK/$SUITE.log" "$WORK/host.txt" "$WORK/$SUITE/" 2>/dev/null
tar -czf "$OUT/$SUITE.tgz" -C "$WORK" "$SUITE"
cp "$WORK/$SUITE/$SUITE.md" "$OUT/$SUITE.md" 2>/dev/null
ls -l "$OUT/$SUITE".*
echo "[gpu_serve_bench] $SUITE: exit $rc after $((SECONDS - T0)) s"
exit "$rc"
