"""The CPU test bed: an ignored venv that runs the fork's Python on a CPU.

- torch 2.13.0 (the local CPU build) and triton 3.6.0, whose interpreter runs
  the Triton kernels on the CPU (``TRITON_INTERPRET=1``);
- vLLM's runtime requirements for no device (``requirements/common.txt``),
  the CUDA-only ones (flashinfer, cutlass, ...) left out;
- torchvision 0.28.0 (built for torch 2.13.0), whose CUDA extension cannot
  load on a CPU torch: it is removed and the two operator schemas that
  torchvision's import registers fakes for are declared instead, so its pure
  Python transforms (which vLLM's Qwen3-VL/3.5 processors import) work;
- a vLLM platform plugin (``cpu_platform_plugin/``) that, with
  ``HSFORK_CPU_TESTBED=1``, picks vLLM's CPU platform;
- ``fork/`` installed editable with ``VLLM_TARGET_DEVICE=empty``; the Rust
  frontend binaries come from the pinned upstream wheel.

Re-running is cheap: a stamp of the inputs skips pip when nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .common import REPO, ToolError, info, load_pin
from .fetch import fetch_file
from .fork import ensure_synced, fork_version

VENV = Path(os.environ.get("HSFORK_VENV", REPO / ".venv"))
REQUIREMENTS = REPO / "tests" / "requirements-cpu.txt"
TORCH = "torch==2.13.0"
TRITON = "triton==3.6.0"
TORCHVISION = "torchvision==0.28.0"
PLATFORM_PLUGIN = Path(__file__).with_name("cpu_platform_plugin")

_TV_SHIM = '''\
"""Written by the hsfork test bed: torchvision's CUDA ops cannot load on a CPU
torch; declare the schemas its import registers fake kernels for."""
import torch

_lib = torch.library.Library("torchvision", "FRAGMENT")
for _schema in (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
):
    try:
        _lib.define(_schema)
    except RuntimeError:  # already defined (the real extension loaded)
        pass
'''


def python() -> Path:
    return VENV / "bin" / "python"


def _pip(*args: str) -> None:
    # No wheel cache: a fresh CI machine installs once, and the cache would
    # hold a second copy of every wheel (triton alone is ~200 MB) on a disk
    # that has run out during this step.
    cmd = [
        str(python()), "-m", "pip", "install", "--disable-pip-version-check",
        "--no-cache-dir", *args,
    ]  # fmt: skip
    info(" ".join(cmd[3:])[:200])
    if subprocess.run(cmd).returncode != 0:
        raise ToolError(f"pip failed: {' '.join(cmd)}")


def _stamp_inputs(repo: Path) -> str:
    h = hashlib.sha256()
    for path in (
        repo / "requirements" / "common.txt",
        REQUIREMENTS,
        Path(__file__),
        PLATFORM_PLUGIN / "hsfork_cpu_platform.py",
    ):
        h.update(path.read_bytes())
    return h.hexdigest()


def _site_packages() -> Path:
    out = subprocess.run(
        [
            str(python()),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Path(out)


def _cpu_torchvision() -> None:
    tv = _site_packages() / "torchvision"
    (tv / "_C.so").unlink(missing_ok=True)
    shim = tv / "_hsfork_cpu_ops.py"
    shim.write_text(_TV_SHIM)
    meta = tv / "_meta_registrations.py"
    text = meta.read_text()
    line = "import torchvision._hsfork_cpu_ops  # noqa: F401  (hsfork test bed)\n"
    if line not in text:
        meta.write_text(line + text)


def _installed_vllm() -> dict | None:
    code = (
        "import json, importlib.metadata as m\n"
        "try:\n d = m.distribution('vllm')\n"
        " print(json.dumps({'version': d.version,"
        " 'direct': d.read_text('direct_url.json')}))\n"
        "except m.PackageNotFoundError:\n print('null')\n"
    )
    out = subprocess.run(
        [str(python()), "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


def ensure_testbed() -> Path:
    pin = load_pin()
    repo = ensure_synced(allow_local_work=True)
    if not python().exists():
        info(f"creating {VENV}")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    stamp = VENV / ".hsfork-stamp"
    want = _stamp_inputs(repo)
    if not stamp.exists() or stamp.read_text() != want:
        _pip("-q", TORCH, TRITON)
        _pip(
            "-q",
            TORCH,
            TRITON,
            "-r",
            str(repo / "requirements" / "common.txt"),
            "-r",
            str(REQUIREMENTS),
        )
        _pip("-q", "--no-deps", TORCHVISION)
        _cpu_torchvision()
        _pip("-q", "--no-deps", "--no-build-isolation", str(PLATFORM_PLUGIN))
        stamp.write_text(want)

    version = fork_version(pin)
    installed = _installed_vllm()
    direct = (
        json.loads(installed["direct"]) if installed and installed["direct"] else {}
    )
    editable_here = direct.get("dir_info", {}).get("editable") and direct.get(
        "url", ""
    ).endswith(str(repo))
    if not installed or installed["version"] != version or not editable_here:
        wheel = fetch_file(pin, pin.file("wheel"))
        env = dict(os.environ)
        env.update(
            {
                "VLLM_TARGET_DEVICE": "empty",
                "VLLM_USE_PRECOMPILED_RUST": "1",
                "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel),
                "VLLM_VERSION_OVERRIDE": version,
            }
        )
        cmd = [
            str(python()), "-m", "pip", "install", "-q", "--no-cache-dir",
            "--no-build-isolation", "--no-deps", "-e", str(repo),
        ]  # fmt: skip
        info(f"installing {repo} editable as vllm {version}")
        if subprocess.run(cmd, env=env).returncode != 0:
            raise ToolError("editable install of fork/ failed")
    return python()


def main() -> None:
    print(ensure_testbed())


if __name__ == "__main__":
    shutil.which("git") or sys.exit("git is required")
    main()
