"""Air-gapped GPU bundle: everything a GPU host without network needs to run
the fork and our GPU tests, split into upload-sized parts.

The host is assumed to have CPython 3.12 with torch 2.11.0+cu130 and the
packages in ``gpu_host_packages.txt`` (the image of the lent GPU machines).
The payload (one ``tar.xz``) holds:

- ``site/``: the fork wheel's contents (patched Python tree, dist-info and the
  compiled extensions, stripped), without the big optional binaries unless
  ``--with-optional``: FA2, the MoE kernels, DeepGEMM and the Rust frontend;
- ``wheels/``: the runtime dependency wheels (CPython 3.12, manylinux x86_64)
  that the host lacks;
- ``repo/``: our tests, fixtures and tooling, and the fork's ``tests/`` tree.

The payload is split into ``<name>.tar.xz.part-NNN`` files of at most
``part_size`` bytes. ``manifest.json`` lists each part's and the payload's
sha256; ``install.sh STAGING TARGET`` checks them, reassembles, unpacks into
TARGET, installs the wheels there and prints the environment to use.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Collection
from pathlib import Path

from .common import REPO, ToolError, dist_dir, fork_dir, info, load_pin, sha256_file
from .fork import fork_version

HOST_PACKAGES = Path(__file__).with_name("gpu_host_packages.txt")
INSTALL_SH = Path(__file__).with_name("install_bundle.sh")

# Big compiled parts that most GPU tests do not need (FA3 and the custom ops
# stay): left out unless named with --include (or all with --with-optional).
# The fused-MoE kernels are needed by MoE models (Qwen3-Next, Kimi-Linear).
OPTIONAL = {
    "fa2": "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "moe": "vllm/_moe_C_stable_libtorch.abi3.so",
    "deep_gemm": "vllm/third_party/deep_gemm/*",
    "rs": "vllm/vllm-rs",
}
# Test-only needs of the fork's conftest on the host.
TEST_DEPS = ("tblib", "pytest-asyncio")
PLATFORMS = (
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, re.I)
    if not m:
        raise ToolError(f"cannot read size {text!r} (use e.g. 60M, 512K)")
    return (
        int(m.group(1))
        * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]
    )


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def host_packages() -> set[str]:
    names = set()
    for line in HOST_PACKAGES.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonical(line))
    return names


def is_optional(name: str, include: Collection[str] = ()) -> bool:
    """Whether ``name`` (a path in the wheel) is an optional part not kept by
    ``include`` (keys of OPTIONAL)."""
    return any(
        fnmatch.fnmatch(name, pat)
        for key, pat in OPTIONAL.items()
        if key not in include
    )


def optional_keys(with_optional: bool | Collection[str]) -> frozenset[str]:
    """The OPTIONAL keys to keep: all for True, none for False, else the named
    ones (unknown names are an error)."""
    if with_optional is True:
        return frozenset(OPTIONAL)
    if with_optional is False:
        return frozenset()
    unknown = set(with_optional) - set(OPTIONAL)
    if unknown:
        raise ToolError(
            f"unknown optional part(s) {sorted(unknown)}; known: {sorted(OPTIONAL)}"
        )
    return frozenset(with_optional)


# ---------------------------------------------------------------------------
# dependency wheels


def _pip_target_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    args += ["--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args + ["--platform", "any"]


def _wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    head = text.split("\n\n", 1)[0]
    return [line[len("Requires-Dist: ") :] for line in head.splitlines()
            if line.startswith("Requires-Dist: ")]  # fmt: skip


def resolve_dependencies(requirements: list[str], dest: Path) -> list[Path]:
    """Download into ``dest`` the wheels the requirements need on a cp312
    host, walking dependencies breadth-first. Packages preinstalled on the
    host (by name) are neither carried nor walked into: their own needs are
    met there. Returns the wheels, one per project.

    Why not pip's resolver (``pip install --dry-run --report`` with
    ``--platform``): it cannot treat the host's packages as installed, so it
    walks into torch's CUDA wheels (absent at those versions for the target
    tags), and pinning the host's versions as constraints made it
    backtrack into a conflict (xgrammar vs transformers) with no solution."""
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import parse_wheel_filename

    env = {"python_version": "3.12", "python_full_version": "3.12.3",
           "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix",
           "extra": ""}  # fmt: skip
    host = host_packages()
    specs: dict[str, SpecifierSet] = {}
    extras: dict[str, set[str]] = {}
    chosen: dict[str, Path] = {}
    dest.mkdir(parents=True, exist_ok=True)
    todo = list(requirements)
    while todo:
        batch: dict[str, str] = {}
        for line in todo:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate(env):
                continue
            name = canonical(req.name)
            if name in host or name == "vllm":
                continue
            specs[name] = specs.get(name, SpecifierSet()) & req.specifier
            new_extras = set(req.extras) - extras.get(name, set())
            extras.setdefault(name, set()).update(req.extras)
            have = chosen.get(name)
            ok = have is not None and specs[name].contains(
                str(parse_wheel_filename(have.name)[1]), prereleases=True
            )
            if not ok or new_extras:
                batch[name] = f"{name}{specs[name]}"
        todo = []
        if not batch:
            break
        with tempfile.TemporaryDirectory(prefix="hsfork-dl-") as tmp:
            cmd = [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--dest", tmp, *_pip_target_args(), *batch.values(),
            ]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise ToolError(f"downloading wheels failed:\n{proc.stderr[-3000:]}")
            for whl in Path(tmp).glob("*.whl"):
                name = canonical(parse_wheel_filename(whl.name)[0])
                old = chosen.get(name)
                if old is not None and old.exists():
                    old.unlink()
                target = dest / whl.name
                shutil.move(whl, target)
                chosen[name] = target
                for dep in _wheel_requires(target):
                    r = Requirement(dep)
                    if r.marker and not any(
                        r.marker.evaluate({**env, "extra": e})
                        for e in (extras.get(name) or {""})
                    ):
                        continue
                    todo.append(dep.split(";", 1)[0])
    for whl in dest.glob("*.whl"):
        if whl not in chosen.values():
            whl.unlink()
    return sorted(chosen.values())


def runtime_requirements(repo: Path) -> list[str]:
    lines = []
    for line in (repo / "requirements" / "common.txt").read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "-")):
            lines.append(line)
    return lines + list(TEST_DEPS)


# ---------------------------------------------------------------------------
# payload


def _strip(data: bytes) -> bytes:
    strip = shutil.which("strip")
    if not strip:
        return data
    with tempfile.NamedTemporaryFile(suffix=".so", delete=False) as f:
        f.write(data)
        path = f.name
    try:
        proc = subprocess.run([strip, "--strip-unneeded", path], capture_output=True)
        return Path(path).read_bytes() if proc.returncode == 0 else data
    finally:
        os.unlink(path)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mode = mode
    ti.mtime = 0
    tar.addfile(ti, io.BytesIO(data))


def _add_tree(tar: tarfile.TarFile, src: Path, prefix: str) -> None:
    for path in sorted(src.rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        rel = path.relative_to(src).as_posix()
        mode = 0o755 if os.access(path, os.X_OK) else 0o644
        _add_bytes(tar, f"{prefix}/{rel}", path.read_bytes(), mode)


def write_payload(
    tar_path: Path,
    wheel: Path,
    dep_wheels: list[Path],
    repo_files: dict[str, Path],
    with_optional: bool | Collection[str],
    strip: bool = True,
) -> dict:
    keep = optional_keys(with_optional)
    contents = {"site": 0, "wheels": [], "excluded": [], "stripped": []}
    with tarfile.open(tar_path, "w") as tar, zipfile.ZipFile(wheel) as whl:
        for zi in whl.infolist():
            if zi.is_dir():
                continue
            if is_optional(zi.filename, keep):
                contents["excluded"].append(zi.filename)
                continue
            data = whl.read(zi)
            mode = (zi.external_attr >> 16) & 0o777 or 0o644
            if strip and zi.filename.endswith(".so"):
                data = _strip(data)
                contents["stripped"].append(zi.filename)
            _add_bytes(tar, f"site/{zi.filename}", data, mode)
            contents["site"] += 1
        for w in dep_wheels:
            _add_bytes(tar, f"wheels/{w.name}", w.read_bytes())
            contents["wheels"].append(w.name)
        for prefix, src in repo_files.items():
            if src.is_dir():
                _add_tree(tar, src, f"repo/{prefix}")
            else:
                _add_bytes(tar, f"repo/{prefix}", src.read_bytes())
    return contents


def compress(tar_path: Path, level: str) -> Path:
    out = tar_path.with_suffix(".tar.xz")
    xz = shutil.which("xz")
    if xz:
        subprocess.run([xz, "-T0", f"-{level}", "-f", "-k", str(tar_path)], check=True)
    else:
        import lzma

        preset = int(level[0]) | (lzma.PRESET_EXTREME if "e" in level else 0)
        with open(tar_path, "rb") as src, lzma.open(out, "wb", preset=preset) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


def split(path: Path, part_size: int, outdir: Path) -> list[Path]:
    parts = []
    with open(path, "rb") as fh:
        i = 0
        while block := fh.read(part_size):
            part = outdir / f"{path.name}.part-{i:03d}"
            part.write_bytes(block)
            parts.append(part)
            i += 1
    return parts


def build_bundle(
    out: Path,
    wheel: Path,
    dep_wheels: list[Path],
    repo_files: dict[str, Path],
    version: str,
    part_size: int,
    with_optional: bool | Collection[str] = False,
    level: str = "9e",
    strip: bool = True,
) -> dict:
    """Write parts, manifest.json and install.sh into ``out``; return manifest."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    name = f"vllm-{version}-bundle"
    with tempfile.TemporaryDirectory(prefix="hsfork-bundle-", dir=out.parent) as tmp:
        tar_path = Path(tmp) / f"{name}.tar"
        info(f"writing payload from {wheel.name} and {len(dep_wheels)} wheel(s)")
        contents = write_payload(
            tar_path, wheel, dep_wheels, repo_files, with_optional, strip
        )
        info(f"compressing ({tar_path.stat().st_size >> 20} MiB, xz -{level})")
        payload = compress(tar_path, level)
        parts = split(payload, part_size, out)
        manifest = {
            "version": version,
            "payload": {
                "name": payload.name,
                "size": payload.stat().st_size,
                "sha256": sha256_file(payload),
            },
            "parts": [
                {"name": p.name, "size": p.stat().st_size, "sha256": sha256_file(p)}
                for p in parts
            ],
            "part_size": part_size,
            "with_optional": sorted(optional_keys(with_optional)),
            "assumes": {
                "python": "CPython 3.12, x86_64 Linux",
                "preinstalled": "torch 2.11.0+cu130 and the packages in "
                "repo/hsfork/gpu_host_packages.txt",
            },
            "contents": contents,
        }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.copyfile(INSTALL_SH, out / "install.sh")
    os.chmod(out / "install.sh", 0o755)
    return manifest


def repo_payload_files() -> dict[str, Path]:
    files = {
        "hsfork": REPO / "hsfork",
        "tests": REPO / "tests",
        "upstream.toml": REPO / "upstream.toml",
        "patches": REPO / "patches",
        "fork-tests": fork_dir() / "tests",
    }
    for extra in ("benchmarks", "examples", "harness"):
        if (REPO / extra).is_dir():
            files[extra] = REPO / extra
    return files


def make_bundle(
    out: str | None = None,
    part_size: str = "60M",
    with_optional: bool | Collection[str] = False,
    wheels: str | None = None,
) -> dict:
    pin = load_pin()
    version = fork_version(pin)
    fork_wheels = sorted(dist_dir().glob(f"{pin.name}-{version}-*.whl"))
    if not fork_wheels:
        raise ToolError(f"no wheel for {version} in {dist_dir()}: run `make wheel`")
    out_dir = Path(out) if out else REPO / "build" / "bundle"
    if wheels:
        dep_wheels = sorted(Path(wheels).glob("*.whl"))
    else:
        cache = REPO / ".cache" / "bundle-wheels"
        if cache.exists():
            shutil.rmtree(cache)
        dep_wheels = resolve_dependencies(runtime_requirements(fork_dir()), cache)
        info(f"{len(dep_wheels)} dependency wheel(s) the GPU host lacks")
    manifest = build_bundle(
        out_dir,
        fork_wheels[-1],
        dep_wheels,
        repo_payload_files(),
        version,
        parse_size(part_size),
        with_optional,
    )
    for p in manifest["parts"]:
        print(f"{out_dir / p['name']}  {p['size']} bytes")
    print(f"{out_dir / 'manifest.json'}\n{out_dir / 'install.sh'}")
    return manifest
