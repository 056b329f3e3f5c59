"""Build the full fork wheel through vLLM's precompiled-binaries build path.

The committed state of the line's fork (``fork/<version>``) is cloned into
``build/<version>/wheel-src`` and
built there with ``VLLM_USE_PRECOMPILED=1`` and
``VLLM_PRECOMPILED_WHEEL_LOCATION`` pointing at the pinned upstream wheel:
setup.py copies every compiled extension out of that wheel, nothing is
compiled. The version is ``<upstream>+<label of the patch stack>``.

setup.py asks torch which CUDA it was built for. The build machine has a CPU
torch, so the driver reports the CUDA version of the pinned binaries instead
(``cuda`` in upstream.toml); this only selects ``requirements/cuda.txt``, the
same dependency list upstream's wheel was built with.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .common import (
    ToolError,
    build_dir,
    dist_dir,
    fork_dir,
    info,
    load_pin,
    run,
)
from .fetch import fetch_file
from .fork import ensure_synced, fork_version, git

_DRIVER = r"""
import os, sys
import torch
if torch.version.cuda is None:
    torch.version.cuda = os.environ["HSFORK_CUDA"]
from setuptools import build_meta
name = build_meta.build_wheel(sys.argv[1])
print("HSFORK_WHEEL=" + name)
"""


def _checkout(repo: Path, dest: Path) -> None:
    """A clean clone of HEAD: setuptools-scm's git file finder then puts every
    tracked data file into the wheel, as in upstream's release build."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    run(["git", "clone", "-q", "--no-checkout", str(repo), str(dest)])
    run(
        [
            "git",
            "-c",
            "advice.detachedHead=false",
            "checkout",
            "-q",
            git(repo, "rev-parse", "HEAD").stdout.strip(),
        ],
        cwd=dest,
    )


def build_wheel(python: str, out: Path | None = None) -> Path:
    pin = load_pin()
    repo = fork_dir()
    ensure_synced(allow_local_work=False)
    version = fork_version(pin)
    upstream_wheel = fetch_file(pin, pin.file("wheel"))
    src = build_dir(pin) / "wheel-src"
    info(f"checking out {repo} HEAD into {src}")
    _checkout(repo, src)
    out = out or dist_dir()
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="hsfork-wheel-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "CUDA"))}
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cuda",
            "VLLM_USE_PRECOMPILED": "1",
            "VLLM_PRECOMPILED_WHEEL_LOCATION": str(upstream_wheel),
            "VLLM_VERSION_OVERRIDE": version,
            "HSFORK_CUDA": pin.cuda,
            "MAX_JOBS": "1",
            # upstream's release wheels are built with --py-limited-api=cp38
            "DIST_EXTRA_CONFIG": str(staging / "bdist.cfg"),
        }
    )
    (staging / "bdist.cfg").write_text("[bdist_wheel]\npy_limited_api = cp38\n")
    info(f"building vllm {version} (precompiled binaries from {upstream_wheel.name})")
    try:
        proc = run([python, "-c", _DRIVER, str(staging)], cwd=src, env=env, check=False)
        if proc.returncode != 0:
            log = build_dir(pin) / "wheel.log"
            log.write_text(proc.stdout + proc.stderr)
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise ToolError(f"wheel build failed (full log: {log}):\n{tail}")
        name = [
            line.split("=", 1)[1]
            for line in proc.stdout.splitlines()
            if line.startswith("HSFORK_WHEEL=")
        ][-1]
        built = staging / name
        dest = out / name
        for old in out.glob(f"{pin.name}-{pin.version}+*.whl"):
            old.unlink()
        shutil.move(built, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    info(f"built {dest}")
    return dest
