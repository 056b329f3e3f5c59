#!/usr/bin/env bash
# Stage the GPU bundle on a device host one upload at a time, and install it
# once every part is there.
#
#   bash hsfork/gpu_stage.sh UPLOAD_DIR [UPLOAD_DIR ...]
#
# Each UPLOAD_DIR (build/<tag>/bundle/upload-N, carried with one device call:
# one part, manifest.json, install.sh) is copied into $HS_STAGING
# (/tmp/hs-staging). When the manifest's parts are all there, install.sh
# installs into $HS_TARGET (/tmp/hybridspec), unless that already holds the
# same payload; the manifest is kept beside the install, so that the harness
# knows which patches the bundle's site carries (harness/upstream_site.sh).
# Exit 0: installed (or already was); 3: parts still missing (named).
set -euo pipefail
STAGING=${HS_STAGING:-/tmp/hs-staging}
TARGET=${HS_TARGET:-/tmp/hybridspec}
HERE=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] || { echo "usage: $0 UPLOAD_DIR [UPLOAD_DIR ...]" >&2; exit 2; }
mkdir -p "$STAGING"
payload_sha() {
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["payload"]["sha256"])' "$1"
}
parts_sig() {  # the split: a bundle cut again (hsfork resplit) keeps its payload
  python3 -c 'import hashlib, json, sys; m = json.load(open(sys.argv[1])); print(hashlib.sha256(json.dumps([m["payload"]["sha256"]] + [p["sha256"] for p in m["parts"]]).encode()).hexdigest())' "$1"
}
for d in "$@"; do
  [ -f "$d/manifest.json" ] || { echo "error: $d has no manifest.json" >&2; exit 2; }
  # parts of another payload or split (a rebuilt or resplit bundle: same
  # part names, other bytes) would count as present and fail the
  # installer's sha256 check
  if [ -f "$STAGING/manifest.json" ] &&
     [ "$(parts_sig "$STAGING/manifest.json")" != "$(parts_sig "$d/manifest.json")" ]; then
    rm -f "$STAGING"/*.part-*
  fi
  cp -f "$d"/* "$STAGING"/
done
want=$(payload_sha "$STAGING/manifest.json")
if [ -f "$TARGET/manifest.json" ] && [ "$(payload_sha "$TARGET/manifest.json")" = "$want" ]; then
  echo "[stage] $TARGET already holds this bundle"
  exit 0
fi
missing=$(python3 - "$STAGING" <<'EOF'
import json, os, sys
m = json.load(open(os.path.join(sys.argv[1], "manifest.json")))
print(" ".join(p["name"] for p in m["parts"]
               if not os.path.exists(os.path.join(sys.argv[1], p["name"]))))
EOF
)
if [ -n "$missing" ]; then
  echo "[stage] waiting for: $missing"
  exit 3
fi
t0=$(date +%s)
installer="$STAGING/install.sh"
[ -f "$installer" ] || installer="$HERE/install_bundle.sh"
bash "$installer" "$STAGING" "$TARGET" --check
cp -f "$STAGING/manifest.json" "$TARGET/manifest.json"
rm -f "$STAGING"/*.part-*
echo "[stage] installed in $(( $(date +%s) - t0 )) s"
