"""Stage the torch/triton stack that a line declares on an air-gapped GPU host.

The lent GPU hosts have torch 2.11.0+cu130 with its CUDA libraries (see
``gpu_host_packages.txt``); v0.33.0 declares torch 2.14.0. ``make
torch-bundle`` (``python -m hsfork torch-bundle``) writes
``build/<tag>/torch-bundle/``: the declared torch, the triton it requires and
the CUDA library wheels the host's versions cannot stand in for, pruned for
one GPU architecture (``--keep-sm``, default 90), packed into one ``tar.xz``
and split into parts that each fit one upload beside the working tree, with
``manifest.json``, ``install.sh`` and one ``upload-N/`` folder per part (the
conventions of ``bundle.py``).

Which wheels travel (``select``): torch's ``Requires-Dist`` (and the
torchvision the line pins, ``upstream.toml``), walked through
the ``cuda-toolkit[...]`` meta package into its components and through the
carried wheels' own requirements, each decided against the host's version
(``HOST_STACK_VERSIONS``: torch 2.11.0's exact pins, as its metadata and
cuda-toolkit 13.0.2's extras state them; the image list records names only):

- torch, triton and torchvision always travel when the host's version does
  not meet the requirement (they are what is staged; torchvision's compiled
  ops are built against one torch);
- a host version that meets the requirement serves;
- cuDNN: torch's own check (``torch/backends/cudnn``) accepts a runtime of
  the same major and a minor no older than the one torch was built with, so
  that is the rule here (host 9.19 < 9.24: it travels);
- another pinned NVIDIA library whose host version differs only below the
  minor (same ``major.minor``, same soname) serves: cuBLAS 13.1.0.3 for
  13.1.1.3 and cuSPARSELt 0.8.0 for 0.8.1 (every symbol torch 2.14.0 and
  cuDNN 9.24 import from them is exported by the host's versions); an older
  minor travels (NCCL 2.28.9 lacks eleven ``nccl*`` functions torch 2.14.0
  calls, such as ``ncclCommGrow``);
- a host package of unrecorded version (filelock, sympy, cuda-bindings...)
  is assumed to meet the requirement.

The manifest records each decision; ``install.sh`` checks the served ones
against the host's installed versions before installing.

Where the libraries are found: torch's libraries carry a ``DT_RPATH``
(searched before ``LD_LIBRARY_PATH``) of ``$ORIGIN/../../nvidia/{cudnn,
nvshmem,nccl,cusparselt,cu13}/lib``. ``install.sh`` installs every wheel with
``pip install --no-index --no-deps --target TARGET``: torch lands in
``TARGET/torch``, the carried cuDNN and NCCL in ``TARGET/nvidia/{cudnn,nccl}``
where those paths resolve, and each ``nvidia/*`` folder of the host's
site-packages that the bundle does not carry (``cu13``, ``cusparselt``,
``nvshmem``) gets a symlink in ``TARGET/nvidia/``, so the host's cuBLAS,
cudart, NVRTC... resolve through the same rpath; no ``LD_LIBRARY_PATH`` is
set. ``TARGET/env.sh`` puts TARGET first on ``PYTHONPATH`` (ahead of the
host's site-packages and its torch 2.11).

Pruning (``repack_wheel``): every ELF file's fatbin keeps only what a
``sm_<keep_sm>`` device loads (``fatbin.prune``); files no such host runs are
left out (``DROP``: triton's Blackwell ptxas and CUPTI, static archives, test
libraries, torch's protoc). Each wheel is rewritten uncompressed (``ZIP_STORED``,
its RECORD updated) so that xz packs across files and the zeroed code.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from .bundle import (
    UPLOAD_LIMIT,
    _pip_target_args,
    canonical,
    host_versions,
    payload_manifest,
    resolve_part_size,
    split,
    worktree_size,
    write_upload_dirs,
)
from .common import REPO, ToolError, build_dir, info, load_pin
from .fatbin import _sections, prune

INSTALL_SH = Path(__file__).with_name("install_torch_stack.sh")

# The host's torch 2.11.0+cu130 pins its CUDA stack; these are the versions
# that torch 2.11.0's Requires-Dist (cuda-toolkit 13.0.2, cudnn, cusparselt,
# nccl, nvshmem) and cuda-toolkit 13.0.2's extras name. install.sh checks the
# served ones on the host itself.
HOST_TORCH = "2.11.0"
HOST_STACK_VERSIONS = {
    "torch": "2.11.0",
    "torchvision": "0.26.0",
    "triton": "3.6.0",
    "cuda-toolkit": "13.0.2",
    "nvidia-cublas": "13.1.0.3",
    "nvidia-cuda-runtime": "13.0.96",
    "nvidia-cuda-nvrtc": "13.0.88",
    "nvidia-cuda-cupti": "13.0.85",
    "nvidia-cufft": "12.0.0.61",
    "nvidia-cufile": "1.15.1.6",
    "nvidia-curand": "10.4.0.35",
    "nvidia-cusolver": "12.0.4.66",
    "nvidia-cusparse": "12.6.3.3",
    "nvidia-nvjitlink": "13.0.88",
    "nvidia-nvtx": "13.0.85",
    "nvidia-cudnn-cu13": "9.19.0.56",
    "nvidia-cusparselt-cu13": "0.8.0",
    "nvidia-nccl-cu13": "2.28.9",
    "nvidia-nvshmem-cu13": "3.4.5",
}
# staged whenever the host's version does not meet the requirement
# (torchvision: its C++ ops are built against one torch; the host's
# torchvision 0.26.0 fails to import under torch 2.14, "operator
# torchvision::nms does not exist", and transformers imports it to build a
# Qwen3.5 model)
STACK = ("torch", "triton", "torchvision")
# metadata-only packages: their components are decided one by one
META = ("cuda-toolkit",)
CUDNN = "nvidia-cudnn-cu13"
MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}

# Files no sm_<keep_sm> host needs: (project, glob, drop only when keep_sm is
# below this architecture (0: always), why).
DROP = (
    ("triton", "triton/backends/nvidia/bin/ptxas-blackwell", 100,
     "ptxas for sm_100 and newer (compiler.get_ptxas: arch >= 100)"),
    ("triton", "triton/backends/nvidia/lib/cupti-blackwell/*", 100,
     "CUPTI of the proton profiler for sm_100 and newer"),
    ("triton", "triton/backends/nvidia/lib/*.a", 0,
     "static archives, never loaded at run time"),
    ("triton", "triton/backends/nvidia/lib/*/*.a", 0,
     "static archives, never loaded at run time"),
    ("triton", "triton/instrumentation/libGPUInstrumentationTestLib.so", 0,
     "triton's own test library"),
    ("triton", "triton/plugins/libTritonPluginsTestLib.so", 0,
     "triton's own test library"),
    ("torch", "torch/bin/protoc*", 0, "the protobuf compiler, a build tool"),
)  # fmt: skip


# ---------------------------------------------------------------------------
# which wheels travel


@dataclass
class Decision:
    name: str
    required: str  # the specifier set, "" for any version
    host: str | None  # the host's version; None: unknown or absent
    carry: bool
    # what install.sh checks on the host: spec, same-minor (fail where
    # unmet), assumed and forced (warn), meta (nothing)
    rule: str
    reason: str
    version: str = ""  # the carried wheel's version
    wheel: str = ""


def host_stack_versions(path: Path | None = None) -> dict[str, str | None]:
    """canonical name -> version for the host's packages: the image list
    (``gpu_host_packages.txt``), with the torch stack's pinned versions."""
    out = host_versions(path)
    for name, version in HOST_STACK_VERSIONS.items():
        if out.get(name) is None:
            out[name] = version
    return out


def _pinned(spec) -> object | None:
    """The version a specifier set pins or starts from (``==X``, ``==X.*``,
    ``~=X``, ``>=X``), else None."""
    from pip._vendor.packaging.version import Version

    for s in spec:
        if s.operator in ("==", "===", "~=", ">="):
            return Version(s.version.removesuffix(".*"))
    return None


def decide(name: str, spec, host: dict[str, str | None]) -> Decision:
    """Whether the host's version of ``name`` serves ``spec`` (a
    SpecifierSet); see the module docstring for the rules."""
    from pip._vendor.packaging.version import Version

    name = canonical(name)
    required = str(spec)
    have = host.get(name)
    if name in META:
        why = "metadata only: its components are decided one by one"
        return Decision(name, required, have, False, "meta", why)
    if name not in host:
        return Decision(name, required, None, True, "", "the host lacks it")
    if have is None:
        if name in STACK:
            return Decision(name, required, None, True, "",
                            "the host's version is not recorded")  # fmt: skip
        return Decision(name, required, None, False, "assumed",
                        "in the host image (version not recorded): assumed to "
                        "meet it (install.sh warns where not)")  # fmt: skip
    if spec.contains(have, prereleases=True):
        return Decision(name, required, have, False, "spec",
                        f"the host's {have} meets it")  # fmt: skip
    want = _pinned(spec)
    hv = Version(have)
    if name in STACK or want is None:
        return Decision(name, required, have, True, "",
                        f"the host has {have}")  # fmt: skip
    if name == CUDNN:
        ok = hv.major == want.major and hv.minor >= want.minor
        why = (
            f"the host's {have}: torch's cuDNN check needs the same major and a "
            f"minor >= {want.major}.{want.minor}"
        )
        return Decision(name, required, have, not ok, "same-minor" if ok else "", why)
    if hv.major == want.major and hv.release[:2] >= want.release[:2]:
        if hv.release[:2] == want.release[:2]:
            why = f"the host's {have}: same {want.major}.{want.minor}, patch level"
        else:
            why = f"the host's {have}: same major, newer minor"
        return Decision(name, required, have, False, "same-minor", why)
    return Decision(name, required, have, True, "",
                    f"the host's {have} is older than {want.major}.{want.minor}: "
                    "it may lack functions the new torch calls")  # fmt: skip


Metadata = Callable[[str], tuple[str, list[str]]]


def select(
    requirements: Iterable[str],
    host: dict[str, str | None],
    metadata: Metadata,
    use_host: Iterable[str] = (),
) -> list[Decision]:
    """Decide every requirement reached from ``requirements``: a meta
    package's components (for the extras asked) and a carried package's own
    requirements are walked into. ``metadata("name<spec>")`` returns the
    version a download would take and its Requires-Dist. ``use_host`` names
    libraries to take from the host even where the rules carry them (rule
    ``forced``: install.sh only warns)."""
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet

    forced = {canonical(n) for n in use_host}
    specs: dict[str, SpecifierSet] = {}
    decisions: dict[str, Decision] = {}
    walked: set[str] = set()
    versions: dict[str, str] = {}  # walked key -> the version metadata gave
    todo = list(requirements)
    while todo:
        line = todo.pop(0)
        req = Requirement(line)
        if req.marker and not req.marker.evaluate(MARKER_ENV):
            continue
        name = canonical(req.name)
        specs[name] = specs.get(name, SpecifierSet()) & req.specifier
        d = decide(name, specs[name], host)
        if d.carry and name in forced and name not in STACK:
            why = f"taken from the host on request (the rules carry it: {d.reason})"
            d = Decision(name, d.required, d.host, False, "forced", why)
        decisions[name] = d
        if not (d.carry or d.rule == "meta"):
            continue
        key = f"{name}{specs[name]}[{','.join(sorted(req.extras))}]"
        if key in walked:
            # reached again (torchvision requires the torch asked for): the
            # same spec, the version its download takes
            if d.carry:
                d.version = versions.get(key, "")
            continue
        walked.add(key)
        version, requires = metadata(f"{name}{specs[name]}")
        versions[key] = version
        if d.carry:
            d.version = version
        for dep in requires:
            r = Requirement(dep)
            if r.marker and not any(
                r.marker.evaluate({**MARKER_ENV, "extra": e})
                for e in (req.extras or {""})
            ):
                continue
            todo.append(str(r).split(";", 1)[0])
    return sorted(decisions.values(), key=lambda d: (not d.carry, d.name))


def pip_metadata(requirement: str) -> tuple[str, list[str]]:
    """The version and Requires-Dist that ``pip download`` would take for a
    cp312 manylinux x86_64 host (pip's metadata-only resolution: no wheel is
    downloaded where the index serves the metadata)."""
    with tempfile.TemporaryDirectory(prefix="hsfork-meta-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable, "-m", "pip", "install", "--quiet", "--dry-run",
            "--no-deps", "--ignore-installed", "--target", str(Path(tmp) / "t"),
            "--report", str(report), *_pip_target_args(), requirement,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolError(f"no metadata for {requirement}:\n{proc.stderr[-2000:]}")
        meta = json.loads(report.read_text())["install"][0]["metadata"]
    return meta["version"], list(meta.get("requires_dist") or [])


def download(decisions: list[Decision], dest: Path) -> list[Path]:
    """The carried wheels (pip keeps what ``dest`` already holds)."""
    from pip._vendor.packaging.utils import parse_wheel_filename

    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for d in decisions:
        if not d.carry:
            continue
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--dest", str(dest), *_pip_target_args(), f"{d.name}=={d.version}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolError(f"downloading {d.name} failed:\n{proc.stderr[-2000:]}")
        found = [
            w
            for w in dest.glob("*.whl")
            if canonical(parse_wheel_filename(w.name)[0]) == d.name
            and str(parse_wheel_filename(w.name)[1]) == d.version
        ]
        if not found:
            raise ToolError(f"pip downloaded no wheel for {d.name}=={d.version}")
        d.wheel = found[0].name
        wheels.append(found[0])
    return wheels


# ---------------------------------------------------------------------------
# pruning


def elf_dynamic(data: bytes | bytearray) -> dict[str, list[str]]:
    """``NEEDED`` and ``RPATH``/``RUNPATH`` of an ELF64 little-endian file
    (``readelf -d``), empty where it has no dynamic section."""
    sec = _sections(data)
    if ".dynamic" not in sec or ".dynstr" not in sec:
        return {}
    (doff, dsize), (soff, _) = sec[".dynamic"], sec[".dynstr"]

    def string(at: int) -> str:
        end = data.find(b"\0", soff + at)
        return bytes(data[soff + at : end]).decode(errors="replace")

    out: dict[str, list[str]] = {"needed": [], "rpath": [], "runpath": []}
    for pos in range(doff, doff + dsize - 15, 16):
        tag, val = struct.unpack_from("<qQ", data, pos)
        if tag == 0:
            break
        key = {1: "needed", 15: "rpath", 29: "runpath"}.get(tag)
        if key:
            out[key] += string(val).split(":") if key != "needed" else [string(val)]
    return out


def drops_for(project: str, keep_sm: int | None) -> list[tuple[str, str]]:
    return [
        (pat, why)
        for proj, pat, below, why in DROP
        if proj == canonical(project) and (not below or (keep_sm or 999) < below)
    ]


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
    return "sha256=" + digest.rstrip(b"=").decode()


def repack_wheel(src: Path, dest: Path, keep_sm: int | None) -> dict:
    """Write ``src`` to ``dest`` uncompressed (ZIP_STORED), without the
    files ``DROP`` names for ``keep_sm`` and with each ELF file's fatbin
    pruned to ``keep_sm``; the RECORD is rewritten. Returns what was done."""
    from pip._vendor.packaging.utils import parse_wheel_filename

    project = canonical(parse_wheel_filename(src.name)[0])
    drops = drops_for(project, keep_sm)
    stats: dict = {"raw": src.stat().st_size, "unpacked": 0, "kept": 0,
                   "dropped_files": {}, "pruned": {}, "rpath": {}}  # fmt: skip
    records = []
    with (
        zipfile.ZipFile(src) as zin,
        zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED, allowZip64=True) as zout,
    ):
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        for zi in zin.infolist():
            if zi.is_dir() or zi.filename == record_name:
                continue
            stats["unpacked"] += zi.file_size
            why = next((w for p, w in drops if fnmatch.fnmatch(zi.filename, p)), None)
            if why:
                stats["dropped_files"][zi.filename] = zi.file_size
                continue
            data = zin.read(zi)
            if data[:4] == b"\x7fELF":
                dyn = elf_dynamic(data)
                if dyn.get("rpath") or dyn.get("runpath"):
                    stats["rpath"][zi.filename] = dyn["rpath"] + dyn["runpath"]
                if keep_sm:
                    buf = bytearray(data)
                    ps = prune(buf, keep_sm)
                    if ps.dropped and not ps.skipped:
                        data = bytes(buf)
                        stats["pruned"][zi.filename] = {
                            "kept": ps.kept_bytes,
                            "zeroed": ps.dropped_bytes,
                        }
            out = zipfile.ZipInfo(zi.filename, date_time=zi.date_time)
            out.external_attr = zi.external_attr
            out.compress_type = zipfile.ZIP_STORED
            zout.writestr(out, data)
            stats["kept"] += len(data)
            records.append(f"{zi.filename},{_record_hash(data)},{len(data)}")
        records.append(f"{record_name},,")
        out = zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0))
        out.external_attr = 0o644 << 16
        zout.writestr(out, "\n".join(records) + "\n")
    stats["zeroed"] = sum(p["zeroed"] for p in stats["pruned"].values())
    stats["stored"] = dest.stat().st_size
    return stats


def compress(tar_path: Path, level: str, threads: int) -> Path:
    """``xz -T<threads> -<level>`` (python's lzma where xz is missing)."""
    out = tar_path.with_name(tar_path.name + ".xz")
    xz = shutil.which("xz")
    if xz:
        subprocess.run(
            [xz, f"-T{threads}", f"-{level}", "-f", "-k", str(tar_path)], check=True
        )
    else:
        import lzma

        preset = int(level[0]) | (lzma.PRESET_EXTREME if "e" in level else 0)
        with open(tar_path, "rb") as src, lzma.open(out, "wb", preset=preset) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


# ---------------------------------------------------------------------------
# the bundle


def build_torch_bundle(
    out: Path,
    wheels: list[Path],
    decisions: list[Decision],
    torch_version: str,
    part_size: int,
    keep_sm: int | None = 90,
    level: str = "6",
    threads: int = 2,
    extra: dict | None = None,
) -> dict:
    """Repack ``wheels``, pack them into one tar.xz, split it into parts of
    at most ``part_size`` bytes; write manifest.json, install.sh and one
    ``upload-N/`` per part into ``out``. Returns the manifest."""
    import time

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    sm = f"sm{keep_sm}" if keep_sm else "allsm"
    name = f"torch-{torch_version}-stack-{sm}"
    wheel_stats = {}
    with tempfile.TemporaryDirectory(prefix="hsfork-torch-", dir=out.parent) as tmp:
        tar_path = Path(tmp) / f"{name}.tar"
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
            for w in wheels:
                info(f"repacking {w.name}")
                repacked = Path(tmp) / w.name
                wheel_stats[w.name] = repack_wheel(w, repacked, keep_sm)
                ti = tar.gettarinfo(str(repacked), arcname=f"wheels/{w.name}")
                ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "", ""
                with open(repacked, "rb") as fh:
                    tar.addfile(ti, fh)
                repacked.unlink()
        tar_size = tar_path.stat().st_size
        info(f"compressing {tar_size >> 20} MiB (xz -T{threads} -{level})")
        t0 = time.monotonic()
        payload = compress(tar_path, level, threads)
        seconds = round(time.monotonic() - t0, 1)
        tar_path.unlink()
        parts = split(payload, part_size, out)
        manifest = {
            "torch": torch_version,
            **payload_manifest(payload, parts),
            "part_size": part_size,
            "keep_sm": keep_sm,
            "carried": [asdict(d) for d in decisions if d.carry],
            "host_serves": [asdict(d) for d in decisions if not d.carry],
            "sizes": {
                "raw_wheels": sum(s["raw"] for s in wheel_stats.values()),
                "unpacked": sum(s["unpacked"] for s in wheel_stats.values()),
                "pruned": sum(s["kept"] for s in wheel_stats.values()),
                "zeroed": sum(s["zeroed"] for s in wheel_stats.values()),
                "tar": tar_size,
                "xz": payload.stat().st_size,
                "xz_level": level,
                "xz_threads": threads,
                "xz_seconds": seconds,
            },
            "wheels": wheel_stats,
            "assumes": {
                "python": "CPython 3.12, x86_64 Linux",
                "host": f"torch {HOST_TORCH}+cu130 and its CUDA wheels "
                "(hsfork/gpu_host_packages.txt)",
                "gpu": f"sm_{keep_sm}" if keep_sm else "any",
            },
            **(extra or {}),
        }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.copyfile(INSTALL_SH, out / "install.sh")
    os.chmod(out / "install.sh", 0o755)
    write_upload_dirs(out, parts)
    return manifest


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def make_torch_bundle(
    out: str | None = None,
    part_size: str = "auto",
    keep_sm: int | None = 90,
    level: str = "6",
    threads: int = 2,
    wheels_dir: str | None = None,
    use_host: Iterable[str] = (),
) -> dict:
    """Stage the torch the selected line declares: decide, download into
    ``.cache/torch-stack/<tag>/`` (or take ``wheels_dir``), repack, pack.
    ``use_host``: libraries to take from the host anyway (see ``select``)."""
    pin = load_pin()
    if not pin.torch:
        raise ToolError(f"the {pin.line or pin.tag} line declares no torch")
    out_dir = Path(out) if out else build_dir(pin) / "torch-bundle"
    size = resolve_part_size(part_size)
    worktree = worktree_size()
    wanted = [f"torch=={pin.torch}"]
    if pin.torchvision:
        wanted.append(f"torchvision=={pin.torchvision}")
    decisions = select(wanted, host_stack_versions(), pip_metadata, use_host)
    for d in decisions:
        verdict = "carry" if d.carry else "host "
        info(f"{verdict} {d.name}{d.required or ''}: {d.reason}")
    cache = REPO / ".cache" / "torch-stack" / pin.tag
    cache = Path(wheels_dir) if wheels_dir else cache
    wheels = download(decisions, cache)
    manifest = build_torch_bundle(
        out_dir, wheels, decisions, pin.torch, size, keep_sm, level, threads,
        extra={"line": pin.line, "vllm": pin.version},
    )  # fmt: skip
    s = manifest["sizes"]
    n = len(manifest["parts"])
    print(
        f"raw wheels {_mib(s['raw_wheels'])}, unpacked {_mib(s['unpacked'])}, "
        f"pruned {_mib(s['pruned'])} ({_mib(s['zeroed'])} of it zeroed), "
        f"xz -{level} {_mib(s['xz'])} in {s['xz_seconds']} s"
    )
    print(
        f"{n} upload(s) of at most {size >> 20} MiB beside the working tree "
        f"({worktree >> 20} MiB of {UPLOAD_LIMIT >> 20} MiB): carry "
        + ", ".join(
            str((out_dir / f"upload-{i}").relative_to(REPO))
            if out_dir.is_relative_to(REPO)
            else str(out_dir / f"upload-{i}")
            for i in range(1, n + 1)
        )
    )
    return manifest


def parse_keep_sm(text: str) -> int | None:
    value = text.strip().lower().removeprefix("sm_").removeprefix("sm")
    if value in ("", "all", "none", "0"):
        return None
    if not re.fullmatch(r"\d+", value):
        raise ToolError(f"--keep-sm {text!r}: give an architecture (90) or 'all'")
    return int(value)
