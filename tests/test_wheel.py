# SPDX-License-Identifier: Apache-2.0
"""The full wheel: upstream's binaries byte for byte, our patched Python."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, git

from hsfork import fork as hf
from hsfork.common import fork_dir, load_pin, patches_dir
from hsfork.fetch import fetch_file
from hsfork.wheelcheck import check_wheel


@pytest.fixture(scope="session", params=["stable", "current"])
def line_wheel(request) -> tuple[str, Path]:
    """dist/'s wheel for a line's current patch stack, built if missing."""
    line = request.param
    pin = load_pin(REPO / "upstream.toml", line=line)
    version = hf.fork_version(pin, patches_dir(pin))
    wheels = sorted((REPO / "dist").glob(f"vllm-{version}-*.whl"))
    if wheels:
        return line, wheels[-1]
    from hsfork.wheel import build_wheel

    mp = pytest.MonkeyPatch()
    mp.setenv("HSFORK_BASE", line)
    try:
        return line, build_wheel(python=sys.executable)
    finally:
        mp.undo()


def test_fork_wheel_matches_upstream(line_wheel):
    line, fork_wheel = line_wheel
    pin = load_pin(REPO / "upstream.toml", line=line)
    version = hf.fork_version(pin, patches_dir(pin))
    assert fork_wheel.name == f"vllm-{version}-cp38-abi3-linux_x86_64.whl"
    upstream = fetch_file(pin, pin.file("wheel"), REPO / ".cache" / "upstream")
    problems = check_wheel(fork_wheel, upstream, fork_dir(pin), pin.tag, version)
    assert problems == []
    with zipfile.ZipFile(fork_wheel) as z:
        sos = [n for n in z.namelist() if n.endswith(".so")]
        meta = z.read(f"vllm-{version}.dist-info/METADATA").decode()
    assert "vllm/_C_stable_libtorch.abi3.so" in sos
    assert f"Requires-Dist: torch=={pin.torch}" in meta.splitlines()


# --- the checker itself, on synthetic wheels --------------------------------

SO = b"\x7fELF compiled bytes"
UP_META = (
    "Metadata-Version: 2.4\nName: vllm\nVersion: {v}\n"
    "Requires-Dist: torch==2.11.0\n\nreadme\n"
)


def _wheel(path: Path, version: str, files: dict[str, bytes], meta: str = UP_META):
    di = f"vllm-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{di}/METADATA", meta.format(v=version))
        z.writestr(f"{di}/entry_points.txt", "[console_scripts]\nvllm = x:main\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nTag: cp38-abi3-linux_x86_64\n")
    return path


@pytest.fixture
def stack(synth):
    repo = hf.sync()
    (repo / "vllm" / "core.py").write_text("PATCHED = True\n")
    git(repo, "rm", "-q", "vllm/other.py")
    git(repo, "commit", "-qam", "Patch core, drop other")
    hf.export()
    upstream_files = {
        "vllm/__init__.py": (repo / "vllm" / "__init__.py").read_bytes(),
        "vllm/core.py": git(repo, "show", "v0.26.0:vllm/core.py").encode(),
        "vllm/other.py": b"X = 1\n",
        "vllm/_C.abi3.so": SO,
        "vllm/_version.py": b"__version__ = '0.26.0'\n",
    }
    upstream = _wheel(synth.root / "up.whl", "0.26.0", upstream_files)
    good = dict(upstream_files)
    good["vllm/core.py"] = b"PATCHED = True\n"
    del good["vllm/other.py"]
    good["vllm/_version.py"] = b"__version__ = 'fork'\n"
    return repo, upstream, good, hf.fork_version()


def test_checker_accepts_a_right_wheel(stack, tmp_path):
    repo, upstream, good, version = stack
    w = _wheel(tmp_path / "w.whl", version, good)
    assert check_wheel(w, upstream, repo, "v0.26.0", version) == []


@pytest.mark.parametrize(
    "tamper, expected",
    [
        (lambda f: f.update({"vllm/_C.abi3.so": SO + b"x"}), "compiled file differs"),
        (lambda f: f.pop("vllm/_C.abi3.so"), "compiled file missing"),
        (lambda f: f.update({"vllm/core.py": b"LINE_0 = 0\n"}), "unpatched content"),
        (lambda f: f.update({"vllm/other.py": b"X = 1\n"}), "deleted by the patches"),
        (lambda f: f.pop("vllm/__init__.py"), "upstream file missing"),
        (lambda f: f.update({"vllm/__init__.py": b"# edited\n"}), "no patch touches"),
        (
            lambda f: f.update({"vllm/stray.py": b""}),
            "not in upstream nor in the patches",
        ),
    ],
)
def test_checker_reports_tampering(stack, tmp_path, tamper, expected):
    repo, upstream, good, version = stack
    files = dict(good)
    tamper(files)
    w = _wheel(tmp_path / "w.whl", version, files)
    problems = check_wheel(w, upstream, repo, "v0.26.0", version)
    assert any(expected in p for p in problems), problems


def test_checker_reports_version_and_dependencies(stack, tmp_path):
    repo, upstream, good, version = stack
    w = _wheel(tmp_path / "w.whl", "0.26.0", good)
    assert any(
        "version" in p for p in check_wheel(w, upstream, repo, "v0.26.0", version)
    )
    meta = UP_META.replace("torch==2.11.0", "torch==2.13.0")
    w = _wheel(tmp_path / "w2.whl", version, good, meta)
    assert any(
        "Requires-Dist differs" in p
        for p in check_wheel(w, upstream, repo, "v0.26.0", version)
    )
