#!/usr/bin/env bash
# Install the torch/triton stack a line declares (hsfork/stage_torch.py) on a
# GPU host without network that has torch 2.11.0+cu130 and its CUDA wheels.
#
#   install.sh STAGING TARGET [--from UPLOAD_DIR]... [--check]
#
# --from copies an upload folder (upload-N/: one part, manifest.json,
# install.sh) into STAGING first, so each upload can call this script; exit 3
# names the parts still missing. Once all are there: each part and the joined
# payload are checked against manifest.json, the host's versions of the
# libraries the bundle does not carry are checked against what the manifest
# assumed (HSFORK_IGNORE_HOST=1 to go on anyway), the wheels are installed
# with `pip install --no-index --no-deps --target TARGET`, the host's
# nvidia/* folders that the bundle does not carry are linked into
# TARGET/nvidia/ (torch's rpath $ORIGIN/../../nvidia/*/lib resolves there)
# and TARGET/env.sh is written. A TARGET that holds the same payload is kept.
# --check then imports torch and triton from TARGET and runs a matmul, a
# cuDNN convolution and a triton kernel on the GPU.
# Needs: bash, python3 with pip (the host's, $PYTHON), tar with xz, sha256sum.
set -euo pipefail

usage() { echo "usage: $0 STAGING TARGET [--from UPLOAD_DIR]... [--check]" >&2; exit 2; }
[ $# -ge 2 ] || usage
mkdir -p "$1"
STAGING=$(cd "$1" && pwd)
TARGET=$2
shift 2
CHECK=
FROM=()
while [ $# -gt 0 ]; do
  case $1 in
    --check) CHECK=1 ;;
    --from) [ $# -ge 2 ] || usage; FROM+=("$2"); shift ;;
    *) usage ;;
  esac
  shift
done
PY=${PYTHON:-python3}
payload_sha() {
  "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["payload"]["sha256"])' "$1"
}
parts_sig() {  # the split: a bundle cut again (hsfork resplit) keeps its payload
  "$PY" -c 'import hashlib, json, sys; m = json.load(open(sys.argv[1])); print(hashlib.sha256(json.dumps([m["payload"]["sha256"]] + [p["sha256"] for p in m["parts"]]).encode()).hexdigest())' "$1"
}
for d in ${FROM[@]+"${FROM[@]}"}; do
  [ -f "$d/manifest.json" ] || { echo "error: $d has no manifest.json" >&2; exit 2; }
  # parts of another payload or split (a rebuilt or resplit bundle: same
  # part names, other bytes) would count as present and then as corrupt
  if [ -f "$STAGING/manifest.json" ] &&
     [ "$(parts_sig "$STAGING/manifest.json")" != "$(parts_sig "$d/manifest.json")" ]; then
    rm -f "$STAGING"/*.part-*
  fi
  cp -f "$d"/* "$STAGING"/
done
MANIFEST="$STAGING/manifest.json"
[ -f "$MANIFEST" ] || { echo "error: $MANIFEST not found" >&2; exit 1; }
PAYLOAD_SHA=$(payload_sha "$MANIFEST")

if [ -f "$TARGET/manifest.json" ] && [ "$(payload_sha "$TARGET/manifest.json")" = "$PAYLOAD_SHA" ]; then
  echo "[torch] $TARGET already holds this payload"
else
  # 1. every part present and intact (3: some missing, 1: corrupt)
  "$PY" - "$STAGING" <<'EOF'
import hashlib, json, os, sys
staging = sys.argv[1]
m = json.load(open(os.path.join(staging, "manifest.json")))
missing, bad = [], []
for p in m["parts"]:
    path = os.path.join(staging, p["name"])
    if not os.path.exists(path):
        missing.append(p["name"])
        continue
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != p["sha256"]:
        bad.append(f"sha256 mismatch: {p['name']} (expected {p['sha256']})")
if bad:
    print("error: corrupt part(s):\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
if missing:
    have = len(m["parts"]) - len(missing)
    print(f"[torch] {have} of {len(m['parts'])} part(s) here; waiting for: "
          + " ".join(missing))
    sys.exit(3)
print(f"[torch] {len(m['parts'])} part(s) verified for torch {m['torch']}")
EOF

  # 2. the host's libraries that the bundle does not carry
  "$PY" - "$MANIFEST" <<'EOF'
import json, os, sys
from importlib.metadata import PackageNotFoundError, version
try:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.version import Version
m = json.load(open(sys.argv[1]))
bad = []
for d in m["host_serves"]:
    if d["rule"] == "meta":
        continue
    try:
        have = version(d["name"])
    except PackageNotFoundError:
        bad.append(f"{d['name']}: not installed (needs {d['required'] or 'any'})")
        continue
    ok = SpecifierSet(d["required"]).contains(have, prereleases=True)
    if not ok and d["rule"] == "same-minor":
        want = Version(d["host"])
        hv = Version(have)
        ok = hv.major == want.major and hv.release[:2] >= want.release[:2]
    print(f"[torch] host {d['name']} {have}: {'ok' if ok else 'NOT OK'} "
          f"(needs {d['required'] or 'any'}; {d['rule']})")
    if not ok and d["rule"] in ("assumed", "forced"):
        print(f"[torch] warning: {d['name']} {have} does not meet {d['required']}")
    elif not ok:
        bad.append(f"{d['name']} {have} (needs {d['required']}; {d['rule']})")
if bad:
    print("error: the host does not have what the bundle relies on:\n  "
          + "\n  ".join(bad), file=sys.stderr)
    sys.exit(0 if os.environ.get("HSFORK_IGNORE_HOST") == "1" else 1)
EOF

  # 3. join and verify the payload
  PAYLOAD=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["payload"]["name"])' "$MANIFEST")
  mkdir -p "$(dirname "$TARGET")"
  TMP=$(mktemp -d "${TARGET%/}.install-XXXXXX")
  trap 'rm -rf "$TMP"' EXIT
  "$PY" - "$STAGING" "$TMP/$PAYLOAD" <<'EOF'
import json, os, sys
staging, out = sys.argv[1], sys.argv[2]
m = json.load(open(os.path.join(staging, "manifest.json")))
with open(out, "wb") as dst:
    for p in m["parts"]:
        with open(os.path.join(staging, p["name"]), "rb") as src:
            while block := src.read(1 << 20):
                dst.write(block)
EOF
  GOT=$(sha256sum "$TMP/$PAYLOAD" | cut -d' ' -f1)
  if [ "$GOT" != "$PAYLOAD_SHA" ]; then
    echo "error: joined $PAYLOAD has sha256 $GOT, expected $PAYLOAD_SHA" >&2
    exit 1
  fi
  echo "[torch] payload verified: $PAYLOAD"

  # 4. unpack the wheels, install them into a new folder, link the host's
  # nvidia/* folders the bundle lacks, then swap it into place
  mkdir -p "$TMP/unpacked" "$TMP/target"
  tar -xJf "$TMP/$PAYLOAD" -C "$TMP/unpacked"
  rm -f "$TMP/$PAYLOAD"
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target "$TMP/target" "$TMP"/unpacked/wheels/*.whl
  rm -rf "$TMP/unpacked"
  rm -rf "$TARGET"
  mv "$TMP/target" "$TARGET"
  TARGET=$(cd "$TARGET" && pwd)
  "$PY" - "$TARGET" <<'EOF'
import os, sys
target = sys.argv[1]
mine = os.path.join(target, "nvidia")
os.makedirs(mine, exist_ok=True)
linked = []
for entry in sys.path:
    host = os.path.join(entry or ".", "nvidia")
    if not os.path.isdir(host) or os.path.realpath(entry or ".").startswith(target):
        continue
    for name in sorted(os.listdir(host)):
        src = os.path.join(host, name)
        dst = os.path.join(mine, name)
        if name.startswith("__") or not os.path.isdir(src) or os.path.lexists(dst):
            continue
        os.symlink(src, dst)
        linked.append(f"{name} -> {src}")
print("[torch] linked from the host: " + (", ".join(linked) or "nothing"))
EOF
  cat >"$TARGET/env.sh" <<EOF
# source this file to use the staged torch stack (hsfork/stage_torch.py):
# TARGET comes before the host's site-packages (and its torch); torch's rpath
# finds the libraries in $TARGET/nvidia, no LD_LIBRARY_PATH needed
export PYTHONPATH="$TARGET\${PYTHONPATH:+:\$PYTHONPATH}"
export PATH="$TARGET/bin:\$PATH"
export HSFORK_TORCH_STACK="$TARGET"
EOF
  # last: the manifest marks a complete install ("already holds" above)
  cp -f "$MANIFEST" "$TARGET/manifest.json"
  echo "[torch] installed into $TARGET; use it with:"
  cat "$TARGET/env.sh"
fi

if [ -n "$CHECK" ]; then
  TARGET=$(cd "$TARGET" && pwd)
  # shellcheck disable=SC1091
  source "$TARGET/env.sh"
  # triton's @jit reads its function's source: the check runs from a file
  # (from stdin it fails with "@jit functions should be defined in a Python
  # file")
  CHECK_PY=$(mktemp --suffix=.py)
  cat > "$CHECK_PY" <<'EOF'
import json, os, sys
target = sys.argv[1]
m = json.load(open(os.path.join(target, "manifest.json")))
import torch
import triton
import triton.language as tl

def under(path):
    return os.path.realpath(path).startswith(os.path.realpath(target) + os.sep)

print(f"[check] torch {torch.__version__} from {torch.__file__}; "
      f"triton {triton.__version__} from {triton.__file__}")
assert torch.__version__.split("+")[0] == m["torch"], torch.__version__
assert under(torch.__file__) and under(triton.__file__), "not the staged stack"
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
dev = torch.device("cuda")
cap = torch.cuda.get_device_capability()
print(f"[check] {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, "
      f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
sm = cap[0] * 10 + cap[1]
if m.get("keep_sm") and sm // 10 != m["keep_sm"] // 10:
    sys.exit(f"[check] error: this GPU is sm_{sm}; the bundle keeps sm_{m['keep_sm']} code only")
a = torch.randn(512, 256, device=dev)
b = torch.randn(256, 384, device=dev)
ref = a.double().cpu() @ b.double().cpu()
for dtype, tol in ((torch.float32, 1e-2), (torch.bfloat16, 1.0)):
    got = (a.to(dtype) @ b.to(dtype)).double().cpu()
    err = (got - ref).abs().max().item()
    assert err < tol, f"matmul {dtype}: max error {err}"
print("[check] matmul fp32 and bf16 (cuBLAS) ok")
x = torch.randn(2, 3, 16, 16, device=dev)
w = torch.randn(4, 3, 3, 3, device=dev)
with torch.backends.cudnn.flags(enabled=True):
    y = torch.nn.functional.conv2d(x, w, padding=1)
y_ref = torch.nn.functional.conv2d(x.cpu(), w.cpu(), padding=1)
assert (y.cpu() - y_ref).abs().max().item() < 1e-2, "cuDNN conv2d"
print("[check] conv2d (cuDNN) ok")

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask)
             + tl.load(y_ptr + offs, mask=mask), mask=mask)

n = 98_432
u = torch.rand(n, device=dev)
v = torch.rand(n, device=dev)
out = torch.empty_like(u)
add_kernel[(triton.cdiv(n, 1024),)](u, v, out, n, BLOCK=1024)
torch.cuda.synchronize()
assert torch.equal(out, u + v), "triton add kernel"
print("[check] triton kernel ok")
compiled = torch.compile(lambda t: torch.relu(t) * 2 + 1)
assert torch.allclose(compiled(u), torch.relu(u) * 2 + 1), "torch.compile"
print("[check] torch.compile (inductor, triton) ok")

carried = ("libtorch_cuda.so", "libtriton.so", "libcudnn", "libnccl.so")
watched = carried + ("libcublas.so", "libcublasLt.so", "libcudart.so",
                     "libcusparseLt.so", "libnvshmem_host.so", "libnvrtc.so")
seen = {}
for line in open("/proc/self/maps"):
    path = line.split()[-1] if "/" in line else ""
    if os.path.basename(path).startswith(watched):
        seen[os.path.basename(path)] = os.path.realpath(path)
bad = []
for base, path in sorted(seen.items()):
    staged = under(path)
    print(f"[check] {base}: {'staged' if staged else 'host  '} {path}")
    if base.startswith(carried) and not staged:
        bad.append(f"{base} loaded from the host: {path}")
for lib in ("libcudnn.so", "libnccl.so", "libcublas.so"):
    if not any(b.startswith(lib) for b in seen):
        bad.append(f"{lib} not loaded")
assert not bad, bad
print("[check] ok: torch", torch.__version__, "triton", triton.__version__)
EOF
  status=0
  (cd / && "$PY" "$CHECK_PY" "$TARGET") || status=$?
  rm -f "$CHECK_PY"
  exit "$status"
fi
