#!/usr/bin/env bash
# `vllm serve` end to end on the GPU host: speculative servers against a
# non-speculative reference (serving/serve_check.py), one GPU call per step.
# Needs the bundle installed at /tmp/hybridspec (hsfork/install_bundle.sh);
# run from the repository root.
#
#   bash serving/gpu_serve.sh fastapply [--lm-eval]   # ~4-6 min
#       the fast-apply fixture (fixtures/fastapply + chat template), servers
#       ref=none ngram=ngram (k=64, lookup 2..10) mtp=mtp (k=3), fast-apply
#       prompts (64 requests, 64 in flight, completions/chat, streamed or
#       not); --lm-eval: lm-eval's fastapply task (completions and chat)
#       against each server (carry .whl-lmeval: serving/install_lm_eval.sh)
#       plus a negative control (SERVE_UPSTREAM=1, the default): the n-gram
#       server on upstream v0.26.0, expected to FAIL (not in the verdict)
#   bash serving/gpu_serve.sh qwen9b                  # ~6-9 min
#       the Qwen3.5-9B shape with random weights written here (19 GB of
#       safetensors, serving/make_model.py), servers ref=none
#       ngram=ngram8 (k=8) mtp=mtp (k=3), text/code prompts
#
# Results in $OUT (at most 3 files per step, 2 steps fit the 8-file limit):
# STEP.md (summary), STEP.json (every response, judgement and metric),
# STEP-logs.tgz (server and lm-eval logs, lm-eval outputs). Exit status:
# serve_check's (0: every candidate PASS or PASS-TIES).
#
# Environment:
#   SERVE_BUDGET   seconds for the whole step (default 560): everything,
#                  servers included, is stopped by then; 0: no budget (dry
#                  runs: every step waits for its condition)
#   SERVERS        the servers, "NAME=SPEC ..." (first = reference)
#   SERVE_ARGS     extra serve_check arguments
#   SERVE_ENGINE   extra vllm serve flags for every server
#   SERVE_KV_BYTES --kv-cache-memory-bytes per server
#   SERVE_EAGER=1  --enforce-eager (faster start, no CUDA graphs)
#   SERVE_MODEL_DIR where qwen9b writes its checkpoint (default /dev/shm or
#                  /tmp; removed at the end)
#   dry runs on a CPU host (tests): SERVE_BUNDLE_ENV=none, SERVE_VLLM_CMD
#   (e.g. "python -m serving.fake_server"), SERVE_DEVICE=cpu, SERVE_TINY=1
set -u
STEP=${1:-}
if [[ $STEP != fastapply && $STEP != qwen9b ]]; then
  echo "usage: bash serving/gpu_serve.sh fastapply [--lm-eval] | qwen9b" >&2
  exit 2
fi
LMEVAL=0
[[ ${2:-} == --lm-eval ]] && LMEVAL=1
R=$PWD
OUT=${OUT:-$R/out}
WORK=${SERVE_WORK:-/tmp/serve-work}
BUDGET=${SERVE_BUDGET:-560}
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
# serve_check's --deadline, keeping $1 s back (at least 1); 0 (none) without
# a budget
deadline() {
  ((BUDGET > 0)) || { echo 0; return; }
  local d=$(($(left) - $1))
  echo $((d < 1 ? 1 : d))
}
mkdir -p "$OUT"
rm -rf "${WORK:?}/$STEP"
mkdir -p "$WORK"
# shellcheck disable=SC1091
PREFIX=SERVE NAME=gpu_serve source "$R/serving/host_env.sh"
VCMD=()
[[ -n ${SERVE_VLLM_CMD:-} ]] && VCMD=(--vllm-cmd "$SERVE_VLLM_CMD")

pack() {
  local s=$1
  cp "$WORK/$s/serve_check.md" "$OUT/$s.md" 2>/dev/null
  cp "$WORK/$s/serve_check.json" "$OUT/$s.json" 2>/dev/null
  tar -czf "$OUT/$s-logs.tgz" -C "$WORK" --exclude='*.safetensors' "$s" 2>/dev/null
  ls -l "$OUT"/"$s"* 2>/dev/null
}

host_info() {
  {
    echo "date: $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1
    "$PY" - <<'PYEOF' 2>&1
import importlib
for m in ("vllm", "torch", "transformers", "tokenizers", "aiohttp", "pyarrow",
          "pandas", "datasets", "lm_eval"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as e:
        print(m, "unavailable:", type(e).__name__, e)
PYEOF
    df -h /tmp /dev/shm 2>&1
  } >"$1"
  head -3 "$1"
}

servers_args() {
  local s
  for s in $1; do printf -- '--server\n%s\n' "$s"; done
}

case $STEP in
fastapply)
  MODEL=$WORK/fastapply-model
  "$PY" -m serving.make_model fastapply "$MODEL" || exit 1
  LM=()
  if ((LMEVAL)); then
    if bash "$R/serving/install_lm_eval.sh" /tmp/lmeval-site; then
      export PYTHONPATH="$PYTHONPATH:/tmp/lmeval-site"
      LM=(--lm-eval "$R/serving/lm_eval_task")
    else
      echo "gpu_serve: lm-eval not installed, skipping it" >&2
    fi
  fi
  mkdir -p "$WORK/fastapply"
  host_info "$WORK/fastapply/host.txt"
  mapfile -t SRV < <(servers_args "${SERVERS:-ref=none ngram=ngram mtp=mtp}")
  # negative control: the same n-gram server on upstream v0.26.0 (the
  # bundle's site with the patch series reversed, harness/upstream_site.sh),
  # which the harness saw diverge on these prompts; expected to FAIL
  if [[ ${SERVE_UPSTREAM:-1} == 1 && ${SERVE_BUNDLE_ENV:-} != none ]]; then
    # shellcheck disable=SC1091
    if source "$R/harness/upstream_site.sh" && make_upstream_site; then
      # upstream_site.sh sourced env.sh again: this checkout first again
      export PYTHONPATH="$R:$PYTHONPATH"
      SRV+=(--server ngram-upstream=ngram --control ngram-upstream
        --server-cmd "ngram-upstream=env $(variant_env upstream) $PY -m vllm.entrypoints.cli.main")
    else
      echo "gpu_serve: no upstream site, running without the control" >&2
    fi
  fi
  # shellcheck disable=SC2086
  "$PY" -m serving.serve_check --model "$MODEL" --out "$WORK/fastapply" \
    --prompts fastapply --n 64 --concurrency 64 --max-tokens 128 \
    --max-model-len 2048 --gpu-mem 0.08 --kv-bytes "${SERVE_KV_BYTES:-2e9}" \
    --engine-args "$ENGINE --tokenizer $MODEL/tokenizer --attention-backend TRITON_ATTN" \
    "${SRV[@]}" "${VCMD[@]}" "${LM[@]}" --deadline "$(deadline 30)" \
    ${SERVE_ARGS:-} 2>&1 | tee "$WORK/fastapply.log" | grep -v '^\[serve_check\] lm-eval' | tail -40
  rc=${PIPESTATUS[0]}
  mkdir -p "$WORK/fastapply" && cp "$WORK/fastapply.log" "$WORK/fastapply/"
  pack fastapply
  ;;
qwen9b)
  MODEL=${SERVE_MODEL_DIR:-/tmp/serve-qwen9b}
  if [[ -z ${SERVE_MODEL_DIR:-} && -d /dev/shm ]] &&
    (($(df -Pk /dev/shm | awk 'NR==2 {print $4}') > 26000000)); then
    MODEL=/dev/shm/serve-qwen9b
  fi
  rm -rf "$MODEL"
  mkdir -p "$WORK/qwen9b"
  host_info "$WORK/qwen9b/host.txt"
  TINY=()
  [[ ${SERVE_TINY:-0} == 1 ]] && TINY=(--tiny)
  LIMIT=()
  if ((BUDGET > 0)); then
    MT=$(($(left) - 200))
    ((MT < 60)) && MT=60
    LIMIT=(timeout "$MT")
  fi
  "${LIMIT[@]}" "$PY" -m serving.make_model qwen9b "$MODEL" \
    --device "${SERVE_DEVICE:-cuda}" "${TINY[@]}" || { rm -rf "$MODEL"; exit 1; }
  echo "[gpu_serve] model written after $((SECONDS - T0)) s: $(du -sh "$MODEL" | cut -f1)"
  mapfile -t SRV < <(servers_args "${SERVERS:-ref=none ngram=ngram8 mtp=mtp}")
  # shellcheck disable=SC2086
  "$PY" -m serving.serve_check --model "$MODEL" --out "$WORK/qwen9b" \
    --prompts text --n 64 --concurrency 64 --max-tokens 128 \
    --max-model-len 4096 --gpu-mem 0.1 --kv-bytes "${SERVE_KV_BYTES:-5e9}" \
    --engine-args "$ENGINE --attention-backend ${SERVE_ATTN:-FLASH_ATTN}" \
    --client-budget 100 "${SRV[@]}" "${VCMD[@]}" --deadline "$(deadline 30)" \
    ${SERVE_ARGS:-} 2>&1 | tee "$WORK/qwen9b.log" | tail -40
  rc=${PIPESTATUS[0]}
  cp "$MODEL/serving_model.json" "$WORK/qwen9b/" 2>/dev/null
  rm -rf "$MODEL"
  mkdir -p "$WORK/qwen9b" && cp "$WORK/qwen9b.log" "$WORK/qwen9b/"
  pack qwen9b
  ;;
esac
echo "[gpu_serve] $STEP: exit $rc after $((SECONDS - T0)) s"
exit "$rc"
