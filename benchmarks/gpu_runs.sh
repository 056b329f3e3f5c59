#!/usr/bin/env bash
# Benchmark runs on a GPU host (bundle installed at /tmp/hybridspec), from the
# repository root. Results under $OUT (default ./out).
#
#   bash benchmarks/gpu_runs.sh profile [decode_latency args]
#       host time per runner method, fork then upstream (benchmarks.step_profile),
#       default: n-gram never matching, BS 1 and 64: $OUT/profile-{fork,upstream}
#       (PROFILE_ORDER="upstream fork" runs upstream first)
#   bash benchmarks/gpu_runs.sh tq [BATCH_SIZES]
#       issue 6: MTP k=3 with a TurboQuant KV cache (turboquant_k8v4) on the
#       fork, three engines in turn: full CUDA graphs (the fix), TurboQuant's
#       graph support downgraded to single-token decodes (the workaround),
#       eager: $OUT/tq/<config>.json
#   bash benchmarks/gpu_runs.sh mtp-mrv2 [DEADLINE_S]
#       issue 5: MTP k=3 on Model Runner V2, fork vs upstream side by side
#       (benchmarks.side_by_side): $OUT/mtp-mrv2
#   bash benchmarks/gpu_runs.sh align-mtp [DEADLINE_S_PER_RUNNER]
#       MTP k=3 with prefix caching in align mode, fork vs upstream side by
#       side on V1 and on Model Runner V2 (ALIGN_RUNNERS, default both; one
#       per GPU runs them at once), ALIGN_REPEATS (2) ABBA pairs per runner:
#       one pair per side leaves a shift of a whole run in the ratio:
#       $OUT/align-mtp-{v1,mrv2}
#   bash benchmarks/gpu_runs.sh traces
#       record per-request draft/accept traces (harness.traces) of the real
#       drafters on the trained fast-apply fixture and on random prompts,
#       TRACES entries DRAFTER,K,PROMPTS[,TEMPERATURE] (default: n-gram k=64,
#       n-gram k=8, MTP k=3 on fastapply; n-gram k=64 on random, greedy and
#       sampled at temperature 1: the low-acceptance trace): $OUT/traces/*.jsonl
#   bash benchmarks/gpu_runs.sh replay TRACE.jsonl [DEADLINE_S]
#       that trace replayed through the scripted drafter on the Qwen3.5-9B
#       shape (k = the trace's longest draft; each of REPLAY_ROUNDS (4) measured
#       rounds replays the next BS traces), no speculation and the replay,
#       fork vs upstream side by side, BS 1/8/32/64 (REPLAY_BS) with CUDA
#       graphs (decode_latency --trace); for n-gram traces then the fork's
#       draft_length_policy="acceptance" cutting the same drafts
#       (REPLAY_POLICY=0: not; REPLAY_VARIANTS=fork: the fork alone); speedups
#       over no speculation
#       (benchmarks.configs_report): $OUT/replay-<trace name>;
#       REPLAY_REFILL=1 keeps BS requests in flight instead of closed batches;
#       REPLAY_PADDING=1 adds the fork with uniform_draft_padding
set -u
R=$PWD
OUT=${OUT:-$R/out}
mkdir -p "$OUT/logs"
# shellcheck disable=SC1091
source "$R/harness/upstream_site.sh"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
case ${1:-} in
profile)
  shift
  args=("$@")
  ((${#args[@]})) || args=(--mode ngram_nomatch --batch-sizes 1,64 --tokens 96)
  python3 -c "
from benchmarks.side_by_side import ensure_upstream_site, series
print('upstream site:', ensure_upstream_site('$BUNDLE_SITE', '$(_site_dir upstream)', series('$PATCHES')))"
  for v in ${PROFILE_ORDER:-fork upstream}; do
    in_variant "$v" python3 -m benchmarks.step_profile \
      --variant "$v" --out "$OUT/profile-$v" -- "${args[@]}" \
      > "$OUT/logs/profile-$v.log" 2>&1
    grep -E '^\[profile\]|Error' "$OUT/logs/profile-$v.log" | tail -5
  done
  python3 -m benchmarks.step_profile --compare "$OUT"/profile-{fork,upstream}/step_profile.json
  ;;
tq)
  bs=${2:-1,8,32}
  mkdir -p "$OUT/tq"
  common=(--mode mtp --mtp-k 3 --kv-cache-dtype turboquant_k8v4 --batch-sizes "$bs"
          --tokens 96 --variant fork)
  for cfg in fix downgrade eager; do
    extra=(--label "tq_$cfg")
    [[ $cfg == downgrade ]] && extra+=(--tq-cudagraph downgrade)
    [[ $cfg == eager ]] && extra+=(--eager)
    in_variant fork timeout 300 python3 -m benchmarks.decode_latency \
      "${common[@]}" "${extra[@]}" --out "$OUT/tq/tq_$cfg.json" --deadline 280 \
      > "$OUT/logs/tq-$cfg.log" 2>&1
    grep -E '^\[bench\]|Error' "$OUT/logs/tq-$cfg.log" | tail -6
  done
  ;;
mtp-mrv2)
  in_variant fork python3 -m benchmarks.side_by_side \
    --modes mtp --out "$OUT/mtp-mrv2" --run mtp-mrv2 --deadline "${2:-540}" \
    -- --runner mrv2 --label mtp_mrv2 --mtp-k 3 --tokens 96
  ;;
align-mtp)
  # MTP k=3 with prefix caching in align mode (the fork copies recurrent
  # state at block boundaries there), fork vs upstream, V1 then MRV2;
  # ALIGN_EXTRA: more decode_latency arguments, e.g. --fixed-fusion (the
  # same compiled graph in every run: whole runs of unchanged code moved by
  # 10-26 %, and vLLM times its candidate kernel fusions in each process)
  for r in ${ALIGN_RUNNERS:-v1 mrv2}; do
    in_variant fork python3 -m benchmarks.side_by_side \
      --modes mtp --out "$OUT/align-mtp-$r" --run "align-mtp-$r" \
      --deadline "${2:-270}" --repeats "${ALIGN_REPEATS:-2}" \
      -- --runner "$r" --cache-mode align --label "mtp_align_$r" --mtp-k 3 --tokens 96 \
      ${ALIGN_EXTRA:-}
  done
  ;;
traces)
  mkdir -p "$OUT/traces"
  for spec in ${TRACES:-ngram,64,fastapply ngram,8,fastapply mtp,3,fastapply ngram,64,random ngram,64,random,1.0}; do
    IFS=, read -r d k p t <<<"$spec"
    name="${d//:/-}-k$k-$p${t:+-t$t}"
    in_variant fork timeout "${TRACE_TIMEOUT:-240}" python3 -m harness.traces record \
      --drafter "$d" --k "$k" --prompts "$p" --batch 8 --n 64 \
      --temperature "${t:-0}" \
      --out "$OUT/traces/$name.jsonl" > "$OUT/logs/trace-$name.log" 2>&1
    python3 -m harness.traces summary "$OUT/traces/$name.jsonl" 2>&1 | tail -1
  done
  ;;
replay)
  trace=${2:?trace file}
  name=$(basename "$trace" .jsonl)
  end=$((SECONDS + ${3:-540}))
  # the scripted drafter's k: the trace's longest draft (n-gram up to 64)
  k=$(python3 -c "
import sys
from harness.traces import load
print(max(1, min(64, max((d for t in load(sys.argv[1])[1] for d, _ in t), default=1))))" "$trace")
  bench=(--trace "$trace" --scripted-k "$k" --batch-sizes "${REPLAY_BS:-1,8,32,64}"
         --tokens "${REPLAY_TOKENS:-256}" --rounds "${REPLAY_ROUNDS:-4}")
  # REPLAY_REFILL=1: the rounds' requests in flight at once, at most BS
  # running (decode_latency --refill), in place of closed batches
  [[ -n ${REPLAY_REFILL:-} ]] && bench+=(--refill)
  in_variant fork python3 -m benchmarks.side_by_side --modes "${REPLAY_MODES:-none,scripted70}" \
    --variants "${REPLAY_VARIANTS:-fork,upstream}" --out "$OUT/replay-$name" --run "trace-$name" --deadline $((end - SECONDS)) \
    -- "${bench[@]}"
  # the fork's per-request draft length (draft_length_policy="acceptance")
  # cutting the same drafts; n-gram traces only (the policy is n-gram's),
  # and only after the fixed-k replay ran: twice (2026-11-28) side_by_side
  # skipped the fixed run for lack of time and the policy run then took
  # what was left, which left the policy with nothing to be compared to
  fixed=$(compgen -G "$OUT/replay-$name/scripted70-*.json" | head -1)
  if [[ $name == ngram* && ${REPLAY_POLICY:-1} == 1 && -z $fixed ]]; then
    echo "[replay] the fixed-k replay did not run: the policy run is left out (give the replay a longer deadline: a cold 9B engine starts in 140-180 s)"
  elif [[ $name == ngram* && ${REPLAY_POLICY:-1} == 1 ]]; then
    in_variant fork python3 -m benchmarks.side_by_side --variants fork \
      --modes scripted70 --out "$OUT/replay-$name/policy" --run "trace-$name-policy" \
      --deadline $((end - SECONDS)) \
      -- "${bench[@]}" --draft-policy acceptance --label scripted_policy
  fi
  # REPLAY_PADDING=1: the fork's uniform_draft_padding on the same drafts
  # (stable patch 38: mixed draft counts padded to k, the verify graph
  # replayed), after the runs above
  if [[ ${REPLAY_PADDING:-0} == 1 && -n $(compgen -G "$OUT/replay-$name/scripted70-*.json") ]]; then
    in_variant fork python3 -m benchmarks.side_by_side --variants fork \
      --modes scripted70 --out "$OUT/replay-$name/padded" --run "trace-$name-padded" \
      --deadline $((end - SECONDS)) \
      -- "${bench[@]}" --uniform-draft-padding --label scripted_padded
  fi
  python3 -m benchmarks.configs_report "$OUT/replay-$name" --baseline none \
    --out "$OUT/replay-$name" --run "speedup-$name" 2>&1 | tail -3
  ;;
*) echo "usage: $0 profile|tq|mtp-mrv2|align-mtp|traces|replay ..."; exit 2 ;;
esac
