#!/usr/bin/env bash
# Build and install a kit of hsfork.kit (an sdist and the wheels of its
# build requirements) on a host without network.
#
#   install_kit.sh KIT TARGET
#
# Checks every file against KIT/kit.json, installs the build requirements
# into a temporary folder, builds the sdist's wheel with the host's Python
# (no index, no build isolation: what the kit lacks, e.g. torch, comes from
# the host) and installs that wheel into TARGET/deps (the bundle's
# dependency folder, already on env.sh's PYTHONPATH).
# Needs: bash, python3 (PYTHON), a C++ compiler where the sdist builds one.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 KIT TARGET" >&2; exit 2; }
KIT=$(cd "$1" && pwd)
TARGET=$2
PY=${PYTHON:-python3}
[ -f "$KIT/kit.json" ] || { echo "error: $KIT/kit.json not found" >&2; exit 1; }
"$PY" - "$KIT" <<'EOF'
import hashlib, json, os, sys
kit = sys.argv[1]
m = json.load(open(os.path.join(kit, "kit.json")))
bad = []
for name, want in m["files"].items():
    path = os.path.join(kit, name)
    if not os.path.exists(path):
        bad.append(f"missing: {name}")
        continue
    if hashlib.sha256(open(path, "rb").read()).hexdigest() != want:
        bad.append(f"sha256 mismatch: {name}")
if bad:
    sys.exit("error: the kit is incomplete:\n  " + "\n  ".join(bad))
print(f"[kit] {len(m['files'])} file(s) verified for {m['requirement']}")
EOF
SDIST=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["sdist"])' "$KIT/kit.json")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/bdeps" "$TMP/wheel" "$TARGET/deps"
if compgen -G "$KIT/build-deps/*.whl" >/dev/null; then
  "$PY" -m pip install --quiet --no-index --no-deps --no-cache-dir \
    --disable-pip-version-check --target "$TMP/bdeps" "$KIT"/build-deps/*.whl
fi
t0=$SECONDS
# the build requirements first on the path; the host's (torch) after them
PYTHONPATH="$TMP/bdeps${PYTHONPATH:+:$PYTHONPATH}" PATH="$TMP/bdeps/bin:$PATH" \
  "$PY" -m pip wheel --quiet --no-index --no-deps --no-build-isolation \
  --no-cache-dir --disable-pip-version-check -w "$TMP/wheel" "$KIT/$SDIST"
"$PY" -m pip install --quiet --no-index --no-deps --no-cache-dir \
  --disable-pip-version-check --upgrade --target "$TARGET/deps" "$TMP"/wheel/*.whl
echo "[kit] built and installed $(basename "$TMP"/wheel/*.whl) into $TARGET/deps in $((SECONDS - t0)) s"
