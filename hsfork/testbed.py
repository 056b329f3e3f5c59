"""The CPU test bed: an ignored venv per line (``.venv/<version>``) that runs
that line's fork on a CPU.

- the torch and triton the line names in ``upstream.toml`` (``testbed_*``):
  triton's interpreter runs the Triton kernels on the CPU
  (``TRITON_INTERPRET=1``). v0.26.0 takes the local torch 2.13.0 CPU build;
  v0.33.0 takes torch 2.14.1, a CUDA build that runs on a CPU;
- vLLM's runtime requirements for no device (``requirements/common.txt``),
  the CUDA-only ones (flashinfer, cutlass, ...) left out;
- the matching torchvision. Where torch is a CPU build, torchvision's CUDA
  extension cannot load: it is removed and the two operator schemas that
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

from .common import REPO, Pin, ToolError, info, load_pin, venv_dir
from .fetch import fetch_file
from .fork import ensure_synced, fork_version

REQUIREMENTS = REPO / "tests" / "requirements-cpu.txt"
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


def python(pin: Pin | None = None) -> Path:
    return venv_dir(pin) / "bin" / "python"


def _versions(pin: Pin) -> tuple[str, str, str]:
    tb = pin.testbed
    try:
        return (
            f"torch=={tb['torch']}",
            f"triton=={tb['triton']}",
            f"torchvision=={tb['torchvision']}",
        )
    except KeyError as e:
        raise ToolError(
            f"upstream.toml: line {pin.line!r} names no testbed_{e}"
        ) from None


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


def _stamp_inputs(repo: Path, pin: Pin) -> str:
    h = hashlib.sha256(" ".join(_versions(pin)).encode())
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
    """Drop torchvision's CUDA extension where torch is a CPU build."""
    cpu_torch = subprocess.run(
        [str(python()), "-c", "import torch; print(torch.version.cuda is None)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if cpu_torch != "True":
        return  # a CUDA build of torch loads torchvision's extension as it is
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


def version_file_holds(repo: Path, version: str) -> bool:
    """Whether ``repo``'s ``vllm/_version.py`` names ``version``: the
    editable install writes it there, and a fork materialized again (``make
    sync``) has upstream's file back, so its vLLM would report another
    version than the install's metadata."""
    try:
        text = (repo / "vllm" / "_version.py").read_text()
    except OSError:
        return False
    return f"'{version}'" in text or f'"{version}"' in text


def ensure_testbed() -> Path:
    pin = load_pin()
    repo = ensure_synced(allow_local_work=True)
    venv = venv_dir(pin)
    torch, triton, torchvision = _versions(pin)
    if not python().exists():
        info(f"creating {venv}")
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    stamp = venv / ".hsfork-stamp"
    want = _stamp_inputs(repo, pin)
    if not stamp.exists() or stamp.read_text() != want:
        _pip("-q", torch, triton)
        _pip(
            "-q",
            torch,
            triton,
            "-r",
            str(repo / "requirements" / "common.txt"),
            "-r",
            str(REQUIREMENTS),
        )
        _pip("-q", "--no-deps", torchvision)
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
    if (
        not installed
        or installed["version"] != version
        or not editable_here
        or not version_file_holds(repo, version)
    ):
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
