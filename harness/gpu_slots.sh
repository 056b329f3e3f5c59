# Spread a GPU call's processes over the host's GPUs (sourced by
# harness/gpu_matrix.sh and harness/gpu_fuzz.sh).
#
#   on_gpu K CMD...   # run CMD with CUDA_VISIBLE_DEVICES set to the K-th
#                     # process's GPU: round-robin over the host's GPUs
#
# The GPUs: HS_GPUS (a blank-separated list of indices), else the list in
# CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists. With none (a CPU
# host, or CUDA_VISIBLE_DEVICES set empty) CMD runs as it is. A lent host of
# several GPUs counts its held time as one of one GPU: one call there runs
# as many processes as its CPU cores allow, each engine on its own GPU.
# Why by hand: vLLM's launchers place the ranks of one engine; nothing
# places many independent single-GPU processes.
#
# Triton's autotuner keeps its picks in memory only, unless
# TRITON_CACHE_AUTOTUNING=1 writes them to Triton's cache. An engine at
# TP=1 runs in the harness's process and autotunes once; at TP > 1 each
# engine starts new worker processes, and NemotronH's warm-up of its Mamba2
# kernels then took 51-66 s on every engine (reference, floor, candidate,
# teacher-forced pass). The correctness runs cache them (how fast a pick is
# is not what they judge; a pick is per kernel and shape, so verify rows
# still get their own); set it to 0 to autotune in every process again.
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}

gpu_list() {
  if [ -n "${HS_GPUS:-}" ]; then
    echo "$HS_GPUS"
  elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    echo "${CUDA_VISIBLE_DEVICES//,/ }"
  else
    nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' '
  fi
}

gpu_slot() {  # K: the GPU of the K-th process (empty: no GPU)
  local gpus
  read -r -a gpus <<< "$(gpu_list)"
  ((${#gpus[@]})) || return 0
  echo "${gpus[$(($1 % ${#gpus[@]}))]}"
}

on_gpu() {
  local g
  g=$(gpu_slot "$1")
  shift
  if [ -n "$g" ]; then
    CUDA_VISIBLE_DEVICES=$g "$@"
  else
    "$@"
  fi
}
