"""A package PyPI ships as an sdist only, built on the GPU host.

    python -m hsfork.kit arctic-inference==0.3.0 --out build/kit-arctic

Writes OUT/ (one upload): the sdist; the wheels of its build requirements
for the host (CPython 3.12, manylinux x86-64), leaving out those the host
has (torch: ``hsfork.bundle.in_host_stack``); ``install_kit.sh`` (a copy of
``hsfork/install_kit.sh``); and ``kit.json`` (the requirement and the
sha256 of every file). On the host:

    bash OUT/install_kit.sh OUT /tmp/hybridspec

checks the sha256s, builds the sdist's wheel there (no index, no build
isolation: the build requirements from the kit, torch from the host) and
installs it into ``/tmp/hybridspec/deps``, where the bundle's
``env.sh`` already points.

Why by hand: the bundle (``hsfork.bundle``) carries binary wheels only, and
pip builds an sdist only with an index or with every build requirement
installed; with build isolation it would also want torch, which
``setup.py`` imports, as a wheel. arctic-inference (vLLM's suffix decoding)
has no wheels on PyPI, and this machine's Python (3.11) cannot build one
for the host's 3.12.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

from .bundle import _pip_target_args, canonical, in_host_stack
from .common import REPO, ToolError, info, sha256_file

INSTALLER = REPO / "hsfork" / "install_kit.sh"


def build_requires(sdist: Path) -> list[str]:
    """``[build-system].requires`` of an sdist's top-level pyproject.toml
    (setuptools' legacy default where it has none)."""
    with tarfile.open(sdist) as tar:
        names = [
            m
            for m in tar.getmembers()
            if m.name.count("/") == 1 and m.name.endswith("/pyproject.toml")
        ]
        if not names:
            return ["setuptools>=40.8.0", "wheel"]
        f = tar.extractfile(names[0])
        assert f is not None
        data = tomllib.loads(f.read().decode())
    return list(data.get("build-system", {}).get("requires", []))


def _name(requirement: str) -> str:
    from packaging.requirements import Requirement

    return canonical(Requirement(requirement).name)


def to_fetch(requires: list[str]) -> list[str]:
    """The build requirements the kit carries: all but the host's stack."""
    return [r for r in requires if not in_host_stack(_name(r))]


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise ToolError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")


def make_kit(requirement: str, out: Path) -> dict:
    if out.exists():
        shutil.rmtree(out)
    (out / "build-deps").mkdir(parents=True)
    # the sdist as it is: no build isolation, so that preparing its
    # metadata does not fetch its build requirements (torch) first
    _pip("--no-deps", "--no-binary=:all:", "--no-build-isolation", "-d", str(out),
         requirement)  # fmt: skip
    sdists = sorted(p for p in out.iterdir() if p.name.endswith((".tar.gz", ".zip")))
    if len(sdists) != 1:
        raise ToolError(f"expected one sdist for {requirement}, got {sdists}")
    sdist = sdists[0]
    fetch = to_fetch(build_requires(sdist))
    if fetch:
        _pip(*_pip_target_args(), "-d", str(out / "build-deps"), *fetch)
    shutil.copy2(INSTALLER, out / "install_kit.sh")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    manifest = {
        "requirement": requirement,
        "sdist": sdist.name,
        "files": {str(p.relative_to(out)): sha256_file(p) for p in files},
    }
    (out / "kit.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in files)
    info(f"kit {out}: {sdist.name}, {len(files) - 2} build wheel(s), "
         f"{size / 2**20:.1f} MiB")  # fmt: skip
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hsfork.kit", description=__doc__.split("\n")[0]
    )
    ap.add_argument("requirement", help="e.g. arctic-inference==0.3.0")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    make_kit(a.requirement, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
