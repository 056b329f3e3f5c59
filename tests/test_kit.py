"""hsfork.kit and hsfork/install_kit.sh: an sdist-only package, carried with
its build requirements and built on the host (arctic-inference for suffix
decoding). No network: the downloads are stood in for, the host build runs
with this interpreter."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import REPO, run_until_done

from hsfork import kit


def _sdist(path: Path, name: str, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


PYPROJECT = """[build-system]
requires = ["setuptools>=61.0", "nanobind==2.9.2", "torch>=2.10.0", "cmake>=3.12"]
build-backend = "setuptools.build_meta"
"""


def test_build_requires_and_what_the_kit_carries(tmp_path):
    files = {"pyproject.toml": PYPROJECT, "sub/pyproject.toml": "x"}
    sdist = _sdist(tmp_path / "p-1.0.tar.gz", "p-1.0", files)
    req = kit.build_requires(sdist)
    assert req == ["setuptools>=61.0", "nanobind==2.9.2", "torch>=2.10.0",
                   "cmake>=3.12"]  # fmt: skip
    # torch is the host's; everything else travels
    assert kit.to_fetch(req) == ["setuptools>=61.0", "nanobind==2.9.2", "cmake>=3.12"]
    legacy = _sdist(tmp_path / "q-1.0.tar.gz", "q-1.0", {"setup.py": ""})
    assert kit.build_requires(legacy) == ["setuptools>=40.8.0", "wheel"]


def test_make_kit_records_every_file(tmp_path, monkeypatch):
    calls = []

    def fake_pip(*args):
        calls.append(args)
        dest = Path(args[args.index("-d") + 1])
        if "--no-binary=:all:" in args:
            _sdist(dest / "p-1.0.tar.gz", "p-1.0", {"pyproject.toml": PYPROJECT})
        else:
            (dest / "nanobind-2.9.2-py3-none-any.whl").write_bytes(b"w")

    monkeypatch.setattr(kit, "_pip", fake_pip)
    m = kit.make_kit("p==1.0", tmp_path / "kit")
    assert m["sdist"] == "p-1.0.tar.gz"
    # the build requirements are fetched for the host (CPython 3.12 wheels)
    assert "--only-binary=:all:" in calls[1] and "3.12" in calls[1]
    assert "torch>=2.10.0" not in calls[1]
    wheel = "build-deps/nanobind-2.9.2-py3-none-any.whl"
    assert set(m["files"]) == {"p-1.0.tar.gz", "install_kit.sh", wheel}
    assert json.loads((tmp_path / "kit" / "kit.json").read_text()) == m


def _toy_kit(tmp_path: Path) -> Path:
    out = tmp_path / "kit"
    out.mkdir()
    files = {
        "pyproject.toml": '[build-system]\nrequires = ["setuptools"]\n'
        'build-backend = "setuptools.build_meta"\n'
        '[project]\nname = "hskit_toy"\nversion = "1.0"\n',
        "hskit_toy/__init__.py": "ANSWER = 42\n",
    }
    sdist = _sdist(out / "hskit_toy-1.0.tar.gz", "hskit_toy-1.0", files)
    from hsfork.common import sha256_file

    (out / "kit.json").write_text(json.dumps({
        "requirement": "hskit_toy==1.0", "sdist": sdist.name,
        "files": {sdist.name: sha256_file(sdist)},
    }))  # fmt: skip
    return out


def _install(kit_dir: Path, target: Path):
    env = {**os.environ, "PYTHON": sys.executable, "PIP_NO_INDEX": "1"}
    return run_until_done(
        ["bash", str(REPO / "hsfork" / "install_kit.sh"), str(kit_dir), str(target)],
        what="install_kit.sh building and installing the toy kit", env=env,
    )  # fmt: skip


def test_install_kit_builds_the_sdist_on_the_host(tmp_path):
    pytest.importorskip("setuptools")
    out = _toy_kit(tmp_path)
    target = tmp_path / "hybridspec"
    done = _install(out, target)
    assert done.returncode == 0, done.stderr
    assert "[kit] 1 file(s) verified for hskit_toy==1.0" in done.stdout
    env = {**os.environ, "PYTHONPATH": str(target / "deps")}
    check = subprocess.run(
        [sys.executable, "-c", "import hskit_toy; print(hskit_toy.ANSWER)"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert check.stdout.strip() == "42", check.stderr


def test_install_kit_refuses_a_changed_file(tmp_path):
    out = _toy_kit(tmp_path)
    with open(out / "hskit_toy-1.0.tar.gz", "ab") as f:
        f.write(b"\0")
    done = _install(out, tmp_path / "t")
    assert done.returncode != 0
    assert "sha256 mismatch: hskit_toy-1.0.tar.gz" in done.stderr
    assert not (tmp_path / "t" / "deps").exists()
