"""Air-gapped GPU bundle: everything a GPU host without network needs to run
the fork and our GPU tests, split into upload-sized parts.

The host is assumed to have CPython 3.12 with torch 2.11.0+cu130 and the
packages in ``gpu_host_packages.txt`` (the image of the lent GPU machines).
Both lines install over that torch ("host torch"): v0.26.0 declares it, and
v0.33.0's compiled extensions use only torch's stable C ABI, whose symbols
torch 2.11 defines (``stage_torch`` stages the torch 2.14 that v0.33.0
declares, for runs that want it). The payload (one ``tar.xz``) holds:

- ``site/``: the fork wheel's contents (patched Python tree, dist-info and the
  compiled extensions, stripped), without the big optional binaries unless
  ``--with-optional``: FA2, the MoE kernels, DeepGEMM and the Rust frontend;
- ``wheels/``: the runtime dependency wheels (CPython 3.12, manylinux x86_64)
  that the host lacks, or has at a version the line does not accept (where
  ``gpu_host_packages.txt`` records the host's version); never torch, triton
  or the CUDA libraries (the host's serve);
- ``repo/``: our tests, fixtures and tooling, and the fork's ``tests/`` tree.

The payload is split into ``<name>.tar.xz.part-NNN`` files of at most
``part_size`` bytes, of equal size (``auto``: as large as one upload to the
device machine allows beside this repository's working tree, which travels
with every upload). ``manifest.json`` lists each part's and the payload's
sha256; ``install.sh STAGING TARGET`` checks them, reassembles, unpacks into
TARGET, installs the wheels there and prints the environment to use. Each
part also gets a folder ``upload-N/`` (hard links: the part, manifest.json,
install.sh) to carry in one upload; ``install.sh ... --from upload-N`` adds
it to STAGING and installs once every part is there.

With ``keep_sm`` (``HSFORK_KEEP_SM=90``) the compiled extensions keep only
the GPU code an sm_90 device runs (``fatbin.prune``): smaller, for
Hopper hosts only.
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

from .common import (
    REPO,
    ToolError,
    build_dir,
    dist_dir,
    fork_dir,
    info,
    load_pin,
    sha256_file,
)
from .fatbin import prune
from .fork import fork_version

HOST_PACKAGES = Path(__file__).with_name("gpu_host_packages.txt")
# The device machines take at most this much per call: the working tree
# (tracked and untracked-not-ignored files) plus the carried paths.
UPLOAD_LIMIT = 64 << 20
# kept free in each upload beside the part: the upload folder's manifest.json
# and install.sh, and growth of the working tree between bundling and upload
UPLOAD_MARGIN = 3 << 20
# Never carried: the host's torch, triton and CUDA libraries serve (the
# "host torch" staging); stage_torch.py stages the declared ones.
# The lent hosts' CUDA (torch 2.11.0+cu130, nvcc 13.0, a CUDA 13 driver)
HOST_CUDA_MAJOR = 13
HOST_STACK = (
    "torch",
    "torchaudio",
    "torchvision",
    "triton",
    "nvidia-*",
    "cuda-*",
)
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
    "manylinux_2_18_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_26_x86_64",
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


def host_versions(path: Path | None = None) -> dict[str, str | None]:
    """canonical name -> the host's version where the list records one
    (``name==version``), else None."""
    out: dict[str, str | None] = {}
    for line in (path or HOST_PACKAGES).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        out[canonical(name.strip())] = version.strip() or None
    return out


def host_packages() -> set[str]:
    return set(host_versions())


def in_host_stack(name: str) -> bool:
    return any(fnmatch.fnmatch(canonical(name), pat) for pat in HOST_STACK)


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


def resolve_dependencies(
    requirements: list[str],
    dest: Path,
    host: dict[str, str | None] | None = None,
    report: dict | None = None,
    carry: Collection[str] = (),
    host_cuda: int = HOST_CUDA_MAJOR,
) -> list[Path]:
    """Download into ``dest`` the wheels the requirements need on a cp312
    host, walking dependencies breadth-first. Returns the wheels, one per
    project.

    A project split into CUDA flavors (``X-cu12``, ``X-cu13``) that brings
    the host's flavor (``host_cuda``) does not carry the others: the
    CUTLASS DSL depends on its cu12 libraries unconditionally (92 MB) and
    loads the newest flavor the driver supports, cu13 on these hosts
    (``report["other_cuda_flavors"]``).

    A package preinstalled on the host (``host``, default
    ``gpu_host_packages.txt``) is neither carried nor walked into when the
    list gives no version for it or its version meets every requirement seen
    so far; a recorded version that does not is carried like any other.
    torch, triton and the CUDA libraries (``HOST_STACK``) are never carried:
    where the host's version does not meet a requirement it is listed in
    ``report["host_stack_unmet"]`` (``report["assumed"]`` lists host
    packages of unknown version taken as they are). ``carry`` names projects
    that are carried although their names look like the host stack's
    (``nvidia-cutlass-dsl`` is no CUDA library of torch's), with every
    dependency whose name extends one of them (``nvidia-cutlass-dsl-libs-*``).

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
    host = host_versions() if host is None else host
    report = {} if report is None else report
    unmet: dict[str, str] = {}
    assumed: set[str] = set()
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
            if name == "vllm":
                continue
            specs[name] = specs.get(name, SpecifierSet()) & req.specifier
            carried = any(name == c or name.startswith(c + "-") for c in carry)
            if not carried and (name in host or in_host_stack(name)):
                have_version = host.get(name)
                ok = have_version is None or specs[name].contains(
                    have_version, prereleases=True
                )
                if in_host_stack(name):
                    if not ok or (have_version is None and str(specs[name])):
                        unmet[name] = (
                            f"{name}{specs[name]} (host: {have_version or '?'})"
                        )
                    continue
                if ok and name not in chosen:
                    if have_version is None and str(specs[name]):
                        assumed.add(f"{name}{specs[name]}")
                    continue
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
    # other CUDA flavors stay in ``dest`` (a cache), out of the bundle
    flavored = {n: re.fullmatch(r"(.+)-cu(\d+)", n) for n in chosen}
    other = sorted(
        n
        for n, m in flavored.items()
        if m and int(m[2]) != host_cuda and f"{m[1]}-cu{host_cuda}" in chosen
    )
    for n in other:
        del chosen[n]
    report["other_cuda_flavors"] = other
    report["host_stack_unmet"] = sorted(unmet.values())
    report["assumed"] = sorted(assumed)
    report["carried_over_host"] = sorted(n for n in chosen if n in host)
    return sorted(chosen.values())


# A requirement carried on request brings the ones vLLM pins beside it
# (its requirements/cuda.txt): with the CUTLASS DSL importable, v0.33.0's
# MoE router GEMMs and GDN kernels take their CuTe DSL tiers, which import
# QuACK, and Qwen3-Next failed at its first forward with
# "No module named 'quack'".
COMPANIONS = {"nvidia-cutlass-dsl": ("quack-kernels",)}


def with_companions(requirements: Collection[str], wheel: Path) -> list[str]:
    """``requirements`` and, for each named in ``COMPANIONS``, the companion
    requirements at the pins of the fork wheel's own metadata."""

    def name(req: str) -> str:  # PEP 508: the name leads
        m = re.match(r"\s*([A-Za-z0-9._-]+)", req)
        return canonical(m.group(1) if m else req)

    out = list(requirements)
    named = {name(r) for r in out}
    pins = {name(r): r for r in _wheel_requires(wheel)}
    for asked in sorted(named):
        for comp in COMPANIONS.get(asked, ()):
            if comp not in named and comp in pins:
                out.append(pins[comp].split(";", 1)[0].strip())
                named.add(comp)
    return out


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
    keep_sm: int | None = None,
) -> dict:
    keep = optional_keys(with_optional)
    contents: dict = {"site": 0, "wheels": [], "excluded": [], "stripped": []}
    if keep_sm:
        contents["pruned"] = {}
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
            if keep_sm and zi.filename.endswith(".so"):
                buf = bytearray(data)
                stats = prune(buf, keep_sm)
                if stats.dropped and not stats.skipped:
                    data = bytes(buf)
                    contents["pruned"][zi.filename] = {
                        "kept": stats.kept_bytes,
                        "zeroed": stats.dropped_bytes,
                    }
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
    """Cut ``path`` into the fewest parts of at most ``part_size`` bytes,
    all of about the same size (each upload then has the same room left)."""
    total = path.stat().st_size
    count = max(1, -(-total // part_size))
    size = -(-total // count)
    parts = []
    with open(path, "rb") as fh:
        i = 0
        while block := fh.read(size):
            part = outdir / f"{path.name}.part-{i:03d}"
            part.write_bytes(block)
            parts.append(part)
            i += 1
    return parts


def worktree_size(repo: Path = REPO) -> int:
    """Bytes of what travels with every call to the device machine: tracked
    and untracked-not-ignored files of the repository."""
    proc = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ToolError(f"cannot list the working tree of {repo}")
    total = 0
    for name in proc.stdout.split(b"\0"):
        if name:
            path = repo / os.fsdecode(name)
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
    return total


def upload_part_size(worktree: int | None = None, margin: int = UPLOAD_MARGIN) -> int:
    """The largest part that fits one upload beside the working tree, in
    whole MiB."""
    worktree = worktree_size() if worktree is None else worktree
    room = (UPLOAD_LIMIT - worktree - margin) >> 20 << 20
    if room < 1 << 20:
        raise ToolError(
            f"the working tree ({worktree >> 20} MiB) leaves no room in a "
            f"{UPLOAD_LIMIT >> 20} MiB upload"
        )
    return room


def resolve_part_size(text: str | int) -> int:
    """``auto`` (see upload_part_size) or a size such as ``32M``."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return upload_part_size()
    return parse_size(text)


def payload_manifest(payload: Path, parts: list[Path]) -> dict:
    """The manifest entries the host installers check: the payload's and
    each part's name, size and sha256."""

    def entry(path: Path) -> dict:
        return {"name": path.name, "size": path.stat().st_size,
                "sha256": sha256_file(path)}  # fmt: skip

    return {"payload": entry(payload), "parts": [entry(p) for p in parts]}


def write_upload_dirs(out: Path, parts: list[Path]) -> list[Path]:
    """``out/upload-N/``: part N with manifest.json and install.sh, as hard
    links (copies where links fail): one folder to carry per upload."""
    dirs = []
    for i, part in enumerate(parts, 1):
        d = out / f"upload-{i}"
        d.mkdir()
        for src in (part, out / "manifest.json", out / "install.sh"):
            try:
                os.link(src, d / src.name)
            except OSError:
                shutil.copy2(src, d / src.name)
        dirs.append(d)
    return dirs


def resplit(bundle_dir: Path, part_size: int) -> dict:
    """Cut an existing bundle (the vLLM bundle or the torch stack: both have
    a manifest with ``payload`` and ``parts``) into parts of at most
    ``part_size`` bytes, without packing it again: what fits beside the
    working tree shrinks as the repository grows, and compressing again takes
    many minutes. The parts are checked, joined, checked as a payload, split,
    and the manifest's ``parts`` and ``upload-N/`` folders rewritten; the
    payload, and so what the host installs, stays the same."""
    mpath = bundle_dir / "manifest.json"
    if not mpath.is_file():
        raise ToolError(f"{bundle_dir} has no manifest.json")
    manifest = json.loads(mpath.read_text())
    payload = manifest["payload"]
    with tempfile.TemporaryDirectory(prefix="hsfork-resplit-", dir=bundle_dir) as tmp:
        joined = Path(tmp) / payload["name"]
        with open(joined, "wb") as dst:
            for p in manifest["parts"]:
                path = bundle_dir / p["name"]
                if not path.is_file():
                    raise ToolError(f"missing part {path}")
                if sha256_file(path) != p["sha256"]:
                    raise ToolError(f"sha256 mismatch: {path}")
                with open(path, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        if sha256_file(joined) != payload["sha256"]:
            raise ToolError(f"the joined parts of {bundle_dir} are not its payload")
        for p in manifest["parts"]:
            (bundle_dir / p["name"]).unlink()
        for d in bundle_dir.glob("upload-*"):
            shutil.rmtree(d)
        parts = split(joined, part_size, bundle_dir)
        manifest["parts"] = payload_manifest(joined, parts)["parts"]
        manifest["part_size"] = part_size
    mpath.write_text(json.dumps(manifest, indent=2) + "\n")
    write_upload_dirs(bundle_dir, parts)
    return manifest


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
    keep_sm: int | None = None,
    extra: dict | None = None,
) -> dict:
    """Write parts, manifest.json, install.sh and one ``upload-N/`` folder
    per part into ``out``; return the manifest (``extra`` is merged in)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    name = f"vllm-{version}-bundle"
    with tempfile.TemporaryDirectory(prefix="hsfork-bundle-", dir=out.parent) as tmp:
        tar_path = Path(tmp) / f"{name}.tar"
        info(f"writing payload from {wheel.name} and {len(dep_wheels)} wheel(s)")
        contents = write_payload(
            tar_path, wheel, dep_wheels, repo_files, with_optional, strip, keep_sm
        )
        info(f"compressing ({tar_path.stat().st_size >> 20} MiB, xz -{level})")
        payload = compress(tar_path, level)
        parts = split(payload, part_size, out)
        manifest = {
            "version": version,
            **payload_manifest(payload, parts),
            "part_size": part_size,
            "with_optional": sorted(optional_keys(with_optional)),
            "keep_sm": keep_sm,
            "assumes": {
                "python": "CPython 3.12, x86_64 Linux",
                "preinstalled": "torch 2.11.0+cu130 and the packages in "
                "repo/hsfork/gpu_host_packages.txt",
            },
            "contents": contents,
            **(extra or {}),
        }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.copyfile(INSTALL_SH, out / "install.sh")
    os.chmod(out / "install.sh", 0o755)
    write_upload_dirs(out, parts)
    return manifest


def repo_payload_files() -> dict[str, Path]:
    files = {
        "hsfork": REPO / "hsfork",
        "tests": REPO / "tests",
        "upstream.toml": REPO / "upstream.toml",
        "patches": REPO / "patches",  # every line's series
        "fork-tests": fork_dir() / "tests",
    }
    for extra in ("benchmarks", "examples", "harness"):
        if (REPO / extra).is_dir():
            files[extra] = REPO / extra
    return files


def keep_sm_from_env() -> int | None:
    value = os.environ.get("HSFORK_KEEP_SM", "").strip().removeprefix("sm_")
    if not value:
        return None
    if not value.isdigit():
        raise ToolError(f"HSFORK_KEEP_SM={value!r}: give an architecture, e.g. 90")
    return int(value)


def make_bundle(
    out: str | None = None,
    part_size: str = "auto",
    with_optional: bool | Collection[str] = False,
    wheels: str | None = None,
    keep_sm: int | None = None,
    requirements: Collection[str] = (),
) -> dict:
    """Bundle the selected line (``HSFORK_BASE``) for a host with torch
    2.11: its fork wheel from dist/, the dependency wheels it lacks, our repo.
    ``keep_sm`` (default: ``HSFORK_KEEP_SM``) prunes the GPU code of other
    architectures from the compiled extensions. ``requirements``: more
    runtime requirements to carry with their dependencies, beside
    ``requirements/common.txt`` (e.g. ``nvidia-cutlass-dsl[cu13]==4.8.0``,
    which v0.33.0's KDA kernels import: Kimi-Linear)."""
    pin = load_pin()
    version = fork_version(pin)
    keep_sm = keep_sm if keep_sm is not None else keep_sm_from_env()
    fork_wheels = sorted(dist_dir().glob(f"{pin.name}-{version}-*.whl"))
    if not fork_wheels:
        raise ToolError(
            f"no wheel for {version} in {dist_dir()}: run "
            f"`make wheel BASE={pin.line or 'current'}`"
        )
    out_dir = Path(out) if out else build_dir(pin) / "bundle"
    size = resolve_part_size(part_size)
    worktree = worktree_size()
    if size + worktree > UPLOAD_LIMIT:
        info(
            f"warning: parts of {size >> 20} MiB beside the working tree "
            f"({worktree >> 20} MiB) exceed one {UPLOAD_LIMIT >> 20} MiB upload; "
            "--part-size auto fits them"
        )
    report: dict = {}
    if wheels:
        dep_wheels = sorted(Path(wheels).glob("*.whl"))
    else:
        cache = REPO / ".cache" / "bundle-wheels" / pin.tag
        if cache.exists():
            shutil.rmtree(cache)
        from pip._vendor.packaging.requirements import Requirement

        requirements = with_companions(requirements, fork_wheels[-1])
        dep_wheels = resolve_dependencies(
            runtime_requirements(fork_dir(pin)) + list(requirements),
            cache,
            report=report,
            carry={canonical(Requirement(r).name) for r in requirements},
        )
        info(f"{len(dep_wheels)} dependency wheel(s) the GPU host lacks")
        for line in report.get("host_stack_unmet", []):
            info(f"not carried (the host's serves): {line}")
        for name in report.get("other_cuda_flavors", []):
            info(f"not carried (another CUDA flavor than the host's): {name}")
    manifest = build_bundle(
        out_dir,
        fork_wheels[-1],
        dep_wheels,
        repo_payload_files(),
        version,
        size,
        with_optional,
        keep_sm=keep_sm,
        extra={
            "line": pin.line,
            "declares_torch": pin.torch,
            "requirements": list(requirements),
            "resolution": report,
        },
    )
    for p in manifest["parts"]:
        print(f"{out_dir / p['name']}  {p['size']} bytes")
    print(f"{out_dir / 'manifest.json'}\n{out_dir / 'install.sh'}")
    print(
        f"{len(manifest['parts'])} upload(s) of at most {size >> 20} MiB beside "
        f"the working tree ({worktree >> 20} MiB): carry "
        + ", ".join(
            str((out_dir / f"upload-{i}").relative_to(REPO))
            if out_dir.is_relative_to(REPO)
            else str(out_dir / f"upload-{i}")
            for i in range(1, len(manifest["parts"]) + 1)
        )
    )
    return manifest
