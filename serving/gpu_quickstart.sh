#!/usr/bin/env bash
# The README's "Installing the wheel on a GPU box and serving" followed on an
# air-gapped GPU host, from the repository root:
#
#   bash serving/gpu_quickstart.sh WHEEL_DIR DEPS_DIR
#
# WHEEL_DIR holds the fork wheel's parts (`split -b` of dist/*.whl, names
# *.whl.part-*) and WHEEL.sha256 (`sha256sum` of the whole wheel); DEPS_DIR
# holds the dependency wheels the host lacks (the bundle's wheels/).
#
# What the README says, and what this host forces instead (no network, no
# model hub, none of vLLM's CUDA extras that pip would pull):
#   pip install dist/vllm-...whl
#       -> the wheel reassembled and checked, then `pip install --no-deps` of
#          it into a fresh venv over the host's torch, and
#          `pip install --no-index --no-deps DEPS_DIR/*.whl`: with resolution
#          pip would need flashinfer-python, nvidia-cutlass-dsl,
#          quack-kernels, torchaudio, torchcodec and numba==0.65.0 (the host
#          has 0.68), which the host lacks and cannot download;
#   vllm serve Qwen/Qwen3.5-9B --speculative-config '{"method": "ngram", ...}'
#       -> the same command line on the fast-apply fixture made by
#          serving/make_model.py (no hub), plus --gdn-prefill-backend triton
#          (FlashInfer is absent) and the fixture's tokenizer folder.
# Then one /v1/completions and one /v1/chat/completions request, streaming
# and not, and the server's speculative-decoding counters.
set -u -o pipefail
WHEEL_DIR=${1:?wheel parts folder}
DEPS_DIR=${2:?dependency wheels folder}
R=$PWD
VENV=${QS_VENV:-/tmp/qs-venv}
MODEL=${QS_MODEL:-/tmp/qs-fastapply}
PORT=${QS_PORT:-8011}
step() { echo; echo "### $*"; }

step "reassemble the wheel and check it"
name=$(awk '{print $2}' "$WHEEL_DIR/WHEEL.sha256")
cat "$WHEEL_DIR/$name".part-* > "/tmp/$name" || exit 1
(cd /tmp && sha256sum -c "$WHEEL_DIR/WHEEL.sha256") || exit 1
ls -la "/tmp/$name"

step "pip install the wheel (fresh venv over the host's torch)"
# the host's torch lives in the site-packages of the python3 on PATH (itself a
# venv here): the new venv sees it through a .pth file
host_site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m venv "$VENV" || exit 1
echo "$host_site" > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/host-site.pth"
"$VENV/bin/pip" install -q --no-index --no-deps --no-compile "$DEPS_DIR"/*.whl \
  || exit 1
"$VENV/bin/pip" install --no-deps --no-compile "/tmp/$name" 2>&1 | tail -3 || exit 1
"$VENV/bin/pip" show vllm 2>/dev/null | head -3
cd / && "$VENV/bin/python" -c \
  "import vllm, vllm._C_stable_libtorch; print('vllm', vllm.__version__, 'from', vllm.__file__)" \
  || exit 1
cd "$R" || exit 1
which_vllm="$VENV/bin/vllm"
ls -la "$which_vllm" || exit 1

step "the served model (no hub): fast-apply fixture with tokenizer and chat template"
PYTHONPATH=$R "$VENV/bin/python" -m serving.make_model fastapply "$MODEL" | tail -2 \
  || exit 1

step "vllm serve with the README's n-gram speculative config"
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
cmd=("$which_vllm" serve "$MODEL" --port "$PORT" --tokenizer "$MODEL/tokenizer"
     --gdn-prefill-backend triton --language-model-only
     --limit-mm-per-prompt '{"image":0,"video":0}'
     --speculative-config '{"method": "ngram", "num_speculative_tokens": 8,
                            "prompt_lookup_min": 2, "prompt_lookup_max": 10}')
printf '%q ' "${cmd[@]}"; echo
"${cmd[@]}" > /tmp/qs-server.log 2>&1 &
pid=$!
# up when /v1/models answers; failed when the server exits; 600 s only
# guards against a hang
up=0
for _ in $(seq 600); do
  curl -sf "localhost:$PORT/v1/models" > /dev/null && { up=1; break; }
  kill -0 $pid 2>/dev/null || { tail -40 /tmp/qs-server.log; exit 1; }
  sleep 1
done
((up)) || { echo "gpu_quickstart: the server did not answer /v1/models in 600 s" >&2
  tail -40 /tmp/qs-server.log; kill $pid; exit 1; }
curl -s "localhost:$PORT/v1/models"; echo
grep -E "Starting vLLM|speculative|Loading weights took|init engine" /tmp/qs-server.log \
  | cut -c1-220 | head -8

prompt=$(PYTHONPATH=$R "$VENV/bin/python" - <<'EOF'
from serving.prompts import fastapply_requests
print(fastapply_requests(1, seed=3)[0].prompt)
EOF
)
body() {  # $1: completions|chat, $2: stream true|false
  PROMPT="$prompt" MODEL="$MODEL" "$VENV/bin/python" - "$1" "$2" <<'EOF'
import json, os, sys
kind, stream = sys.argv[1], sys.argv[2] == "true"
b = {"model": os.environ["MODEL"], "max_tokens": 128, "temperature": 0,
     "stream": stream}
if kind == "chat":
    b["messages"] = [{"role": "user", "content": os.environ["PROMPT"]}]
else:
    b["prompt"] = os.environ["PROMPT"]
print(json.dumps(b))
EOF
}
for kind in completions chat; do
  path=/v1/completions; [[ $kind == chat ]] && path=/v1/chat/completions
  for stream in false true; do
    step "POST $path stream=$stream"
    curl -s "localhost:$PORT$path" -H 'Content-Type: application/json' \
      -d "$(body $kind $stream)" > "/tmp/qs-$kind-$stream.out"
    if [[ $stream == false ]]; then
      "$VENV/bin/python" -c "
import json,sys; r=json.load(open('/tmp/qs-$kind-$stream.out')); c=r['choices'][0]
print(json.dumps({'finish_reason': c['finish_reason'], 'usage': r['usage'],
  'text': (c.get('text') or c['message']['content'])[:300]}, indent=1))"
    else
      echo "$(grep -c '^data: {' "/tmp/qs-$kind-$stream.out") chunks;" \
        "$(tail -2 "/tmp/qs-$kind-$stream.out" | head -1)"
    fi
  done
done
step "speculative-decoding counters (/metrics)"
curl -s "localhost:$PORT/metrics" | grep -E "^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total"
kill $pid; wait $pid 2>/dev/null
echo; echo "quickstart: done"
