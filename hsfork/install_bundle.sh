#!/usr/bin/env bash
# Install the vllm-hybrid-spec GPU bundle on a host without network.
#
#   install.sh STAGING TARGET [--check]
#
# STAGING holds manifest.json and every <payload>.part-NNN (uploaded in as
# many trips as needed). Each part and the reassembled payload are checked
# against manifest.json; the payload is unpacked into TARGET, the dependency
# wheels are installed into TARGET/deps, and TARGET/env.sh is written.
# --check then imports vllm with that environment.
# Needs: bash, python3 (the one with torch 2.11.0+cu130), tar with xz.
set -euo pipefail

usage() { echo "usage: $0 STAGING TARGET [--check]" >&2; exit 2; }
[ $# -ge 2 ] || usage
STAGING=$(cd "$1" && pwd)
TARGET=$2
CHECK=${3:-}
PY=${PYTHON:-python3}
MANIFEST="$STAGING/manifest.json"
[ -f "$MANIFEST" ] || { echo "error: $MANIFEST not found" >&2; exit 1; }

# 1. every part present and intact
"$PY" - "$STAGING" <<'EOF'
import hashlib, json, os, sys
staging = sys.argv[1]
m = json.load(open(os.path.join(staging, "manifest.json")))
bad = []
for p in m["parts"]:
    path = os.path.join(staging, p["name"])
    if not os.path.exists(path):
        bad.append(f"missing: {p['name']}")
        continue
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != p["sha256"]:
        bad.append(f"sha256 mismatch: {p['name']} (expected {p['sha256']})")
if bad:
    print("error: the staging folder is incomplete:\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
print(f"[bundle] {len(m['parts'])} part(s) verified for vllm {m['version']}")
EOF

# 2. reassemble and verify the payload
read -r PAYLOAD PAYLOAD_SHA < <("$PY" -c '
import json, sys; m = json.load(open(sys.argv[1]))
print(m["payload"]["name"], m["payload"]["sha256"])' "$MANIFEST")
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
  echo "error: reassembled $PAYLOAD has sha256 $GOT, expected $PAYLOAD_SHA" >&2
  exit 1
fi
echo "[bundle] payload verified: $PAYLOAD"

# 3. unpack next to TARGET, install the wheels, then swap into place
NEW="$TMP/target"
mkdir -p "$NEW"
tar -xJf "$TMP/$PAYLOAD" -C "$NEW"
rm -f "$TMP/$PAYLOAD"
mkdir -p "$NEW/deps"
if compgen -G "$NEW/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target "$NEW/deps" "$NEW"/wheels/*.whl
  rm -rf "$NEW/wheels"
fi
rm -rf "$TARGET"
mv "$NEW" "$TARGET"
TARGET=$(cd "$TARGET" && pwd)
# pip --target does not make deps a site directory, so the .pth files wheels
# put there are never read (nvidia-cutlass-dsl puts its `cutlass` package on
# sys.path with one): run them once here, as site does for a site directory,
# and add the paths they add to env.sh's PYTHONPATH
PTH_PATHS=$(cd / && PYTHONPATH="$TARGET/site:$TARGET/deps" "$PY" - "$TARGET/deps" <<'EOF'
import site
import sys

deps = sys.argv[1]
before = list(sys.path)
site.addsitedir(deps)
print(":".join(p for p in sys.path if p not in before and p != deps))
EOF
)
mkdir -p "$TARGET/bin"
cat >"$TARGET/bin/vllm" <<EOF
#!/usr/bin/env bash
exec $PY -m vllm.entrypoints.cli.main "\$@"
EOF
chmod +x "$TARGET/bin/vllm"
BASE_VERSION=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["version"].split("+")[0])' "$STAGING/manifest.json")
cat >"$TARGET/env.sh" <<EOF
# source this file to use the vllm-hybrid-spec bundle
# the line of the bundle: hsfork's tools pick its patch series
export HSFORK_BASE="$BASE_VERSION"
export PYTHONPATH="$TARGET/site:$TARGET/deps:${PTH_PATHS:+$PTH_PATHS:}$TARGET/repo\${PYTHONPATH:+:\$PYTHONPATH}"
export PATH="$TARGET/bin:$TARGET/deps/bin:\$PATH"
export HSFORK_BUNDLE="$TARGET"
export VLLM_USE_FLASHINFER_SAMPLER=0
export HF_HUB_OFFLINE=1
EOF
echo "[bundle] installed into $TARGET; use it with:"
cat "$TARGET/env.sh"

if [ "$CHECK" = "--check" ]; then
  # shellcheck disable=SC1091
  source "$TARGET/env.sh"
  (cd / && "$PY" -c 'import vllm; from vllm import LLM; print("[bundle] import vllm", vllm.__version__, "from", vllm.__file__)')
fi
