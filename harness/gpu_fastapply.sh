#!/usr/bin/env bash
# The fast-apply fixture on a GPU host (bundle installed at /tmp/hybridspec).
#
#   bash harness/gpu_fastapply.sh train MODEL_DIR [BUDGET_S]
#       train the fixture (bf16 checkpoint) into MODEL_DIR, copy it to
#       $OUT/fastapply
#   bash harness/gpu_fastapply.sh eval MODEL_DIR "fork upstream" [N]
#       vLLM exact match, BS 1 and 8, no speculation and n-gram k=64
#       (prompt_lookup_min 2, max 10), one process per variant side by side
#       on the GPU: $OUT/fastapply-eval-VARIANT.json, logs in $OUT/logs
set -u
R=$PWD
OUT=${OUT:-$R/out}
mkdir -p "$OUT/logs"
# shellcheck disable=SC1091
source "$R/harness/upstream_site.sh"
export PYTHONUNBUFFERED=1
case $1 in
train)
  make_site fork || exit 1
  in_variant fork python3 -m harness.fastapply train \
    --out "$2" --device cuda --budget-s "${3:-210}" --eval-n 64 \
    --save-dtype bfloat16 2>&1 | tee "$OUT/logs/fastapply-train.log" | grep -v '"step"' | tail -5
  mkdir -p "$OUT/fastapply" && cp "$2"/* "$OUT/fastapply/"
  ;;
eval)
  for v in $3; do make_site "$v" || exit 1; done
  export HSFORK_GPU_MEM=${HSFORK_GPU_MEM:-0.2} HSFORK_KV_BYTES=${HSFORK_KV_BYTES:-4e9}
  pids=()
  for v in $3; do
    in_variant "$v" python3 -m harness.fastapply vllm \
      --model "$2" --n "${4:-64}" --batch 1 8 --spec none ngram --k 64 \
      --out "$OUT/fastapply-eval-$v.json" > "$OUT/logs/fastapply-eval-$v.log" 2>&1 &
    pids+=($!)
    sleep 2
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for v in $3; do echo "== $v"; grep -vE '^(INFO|WARNING|DEBUG)' "$OUT/logs/fastapply-eval-$v.log" | tail -8; done
  ;;
*) echo "usage: $0 train|eval ..."; exit 2 ;;
esac
