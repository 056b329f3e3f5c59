# SPDX-License-Identifier: Apache-2.0
"""The declared torch stack for the GPU hosts (hsfork/stage_torch.py): which
wheels travel, how they are repacked, and the host script's join, check and
install on a tiny synthetic payload (no real torch is downloaded or packed)."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hsfork.stage_torch import (
    INSTALL_SH,
    Decision,
    build_torch_bundle,
    decide,
    elf_dynamic,
    host_stack_versions,
    parse_keep_sm,
    repack_wheel,
    select,
)

# torch 2.14.0's Requires-Dist and cuda-toolkit 13.0.3's (abridged: the
# extras torch asks for and one it does not), as their wheels state them
TORCH_REQUIRES = [
    "filelock",
    "typing-extensions>=4.10.0",
    "setuptools>=77.0.3",
    "sympy>=1.13.3",
    "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,"
    'nvjitlink,nvrtc,nvtx]==13.0.3; platform_system == "Linux"',
    'cuda-bindings<14,>=13.0.3; platform_system == "Linux" and python_version < "3.15"',
    'nvidia-cudnn-cu13==9.24.0.43; platform_system == "Linux"',
    'nvidia-cusparselt-cu13==0.8.1; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.30.7; platform_system == "Linux"',
    'nvidia-nvshmem-cu13==3.4.5; platform_system == "Linux"',
    'triton~=3.8.0; platform_system == "Linux" and python_version < "3.15"',
    'optree>=0.13.0; extra == "optree"',
]
_LINUX = "(sys_platform == 'linux' and platform_machine == 'x86_64')"
TOOLKIT_REQUIRES = [
    f"nvidia-cublas==13.1.1.3.*; {_LINUX} and extra == 'cublas'",
    f"nvidia-cuda-runtime==13.0.96.*; {_LINUX} and extra == 'cudart'",
    f"nvidia-cufft==12.0.0.61.*; {_LINUX} and extra == 'cufft'",
    f"nvidia-nvjitlink<14,>=13.0.88; {_LINUX} and extra == 'nvjitlink'",
    f"nvidia-cuda-nvrtc==13.0.88.*; {_LINUX} and extra == 'nvrtc'",
    f"nvidia-npp==13.0.1.2.*; {_LINUX} and extra == 'npp'",
    f"nvidia-cuda-nvcc==13.0.88.*; {_LINUX} and extra == 'all'",
]
METADATA = {
    "torch": ("2.14.0", TORCH_REQUIRES),
    "cuda-toolkit": ("13.0.3", TOOLKIT_REQUIRES),
    "triton": ("3.8.0", ['importlib-metadata; python_version < "3.10"']),
    "nvidia-cudnn-cu13": ("9.24.0.43", ["nvidia-cublas"]),
    "nvidia-nccl-cu13": ("2.30.7", []),
    "torchvision": ("0.29.0", ["numpy", "torch==2.14.0", "pillow!=8.3.*,>=5.3.0"]),
}


def _metadata(requirement: str):
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
    return METADATA[name]


def _spec(text: str):
    from pip._vendor.packaging.specifiers import SpecifierSet

    return SpecifierSet(text)


def test_select_carries_only_what_the_host_lacks():
    decisions = {
        d.name: d for d in select(["torch==2.14.0"], host_stack_versions(), _metadata)
    }
    carried = {n: d.version for n, d in decisions.items() if d.carry}
    assert carried == {
        "torch": "2.14.0",
        "triton": "3.8.0",
        "nvidia-cudnn-cu13": "9.24.0.43",  # host 9.19 < 9.24: torch's check
        "nvidia-nccl-cu13": "2.30.7",  # host 2.28.9: older minor
    }
    # patch-level differences: the host's serve
    assert decisions["nvidia-cublas"].rule == "same-minor"
    assert decisions["nvidia-cublas"].host == "13.1.0.3"
    assert decisions["nvidia-cusparselt-cu13"].rule == "same-minor"
    for name in ("nvidia-nvshmem-cu13", "nvidia-cuda-runtime", "nvidia-nvjitlink"):
        assert decisions[name].rule == "spec" and not decisions[name].carry
    assert decisions["cuda-toolkit"].rule == "meta"
    assert decisions["setuptools"].rule == "assumed"  # version not recorded
    # extras not asked for, and markers that do not hold, are not walked into
    for name in ("nvidia-npp", "nvidia-cuda-nvcc", "optree", "importlib-metadata"):
        assert name not in decisions


def test_the_lines_torchvision_travels_with_its_torch():
    """The host's torchvision 0.26.0 (built for torch 2.11) fails to import
    under torch 2.14 ("operator torchvision::nms does not exist"), and
    transformers imports it: the torchvision the line pins travels."""
    from hsfork.common import load_pin

    pin = load_pin(line="current")
    assert pin.torchvision == "0.29.0"
    decisions = {
        d.name: d
        for d in select(
            [f"torch=={pin.torch}", f"torchvision=={pin.torchvision}"],
            host_stack_versions(),
            _metadata,
        )
    }
    tv = decisions["torchvision"]
    assert tv.carry and tv.version == "0.29.0" and tv.host == "0.26.0"
    # its own requirements are walked: the pinned torch, nothing new
    assert decisions["torch"].carry and decisions["torch"].version == "2.14.0"


def test_use_host_keeps_a_library_home_but_never_torch():
    decisions = {
        d.name: d
        for d in select(
            ["torch==2.14.0"],
            host_stack_versions(),
            _metadata,
            use_host=["nvidia-nccl-cu13", "triton"],
        )
    }
    assert decisions["nvidia-nccl-cu13"].rule == "forced"
    assert not decisions["nvidia-nccl-cu13"].carry
    assert decisions["triton"].carry and decisions["nvidia-cudnn-cu13"].carry


def test_decide_rules():
    host = {
        "nvidia-cudnn-cu13": "9.25.0.1",
        "nvidia-nccl-cu13": "2.32.3",
        "nvidia-cublas": "12.9.1.4",
        "torch": "2.14.0",
        "triton": "3.6.0",
        "pip": None,
    }
    # cuDNN: same major, newer minor serves (torch's own check)
    d = decide("nvidia-cudnn-cu13", _spec("==9.24.0.43"), host)
    assert not d.carry and d.rule == "same-minor"
    assert decide("nvidia-cudnn-cu13", _spec("==10.0.0"), host).carry
    # a newer minor of the same major serves; another major travels
    assert not decide("nvidia-nccl-cu13", _spec("==2.30.7"), host).carry
    assert decide("nvidia-cublas", _spec("==13.1.1.3.*"), host).carry
    # torch and triton travel unless the host's meets the requirement
    assert not decide("torch", _spec("==2.14.0"), host).carry
    assert decide("triton", _spec("~=3.8.0"), host).carry
    # absent from the host: carried; present, version unknown: assumed
    assert decide("nvidia-nvshmem-cu13", _spec("==3.4.5"), host).carry
    assert decide("pip", _spec(">=1"), host).rule == "assumed"


def test_parse_keep_sm():
    assert parse_keep_sm("90") == 90
    assert parse_keep_sm("sm_90") == 90
    assert parse_keep_sm("all") is None


# ---------------------------------------------------------------------------
# repacking


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def _elf_with_fatbin(entries: bytes) -> bytes:
    """A minimal ELF64 file: sections .shstrtab and .nv_fatbin."""
    blob = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(entries)) + entries
    names = b"\0.shstrtab\0.nv_fatbin\0"
    body = names + b"\0" * (-len(names) % 8)
    strtab_off, fat_off = 64, 64 + len(body)
    shoff = fat_off + len(blob)
    head = bytearray(64)
    head[:7] = b"\x7fELF\x02\x01\x01"
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<HHH", head, 0x3A, 64, 3, 1)
    shdrs = bytes(64)
    shdrs += struct.pack("<IIQQQQ", 1, 3, 0, 0, strtab_off, len(names)) + bytes(24)
    shdrs += struct.pack("<IIQQQQ", 11, 1, 0, 0, fat_off, len(blob)) + bytes(24)
    return bytes(head) + body + blob + shdrs


def _wheel(path: Path, files: dict[str, bytes], entry_points: str = "") -> Path:
    name, version = path.name.split("-")[:2]
    di = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for fname, data in files.items():
            z.writestr(fname, data)
        z.writestr(
            f"{di}/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        )
        z.writestr(
            f"{di}/WHEEL",
            "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
        )
        if entry_points:
            z.writestr(f"{di}/entry_points.txt", entry_points)
        z.writestr(f"{di}/RECORD", "")
    return path


def test_repack_prunes_drops_and_rewrites_record(tmp_path):
    sm80, sm90, ptx90, sm100 = b"\x11" * 256, b"\x22" * 256, b"\x33" * 128, b"\x44" * 64
    elf = _elf_with_fatbin(
        _entry(2, 80, sm80) + _entry(2, 90, sm90) + _entry(1, 90, ptx90)
        + _entry(2, 100, sm100)
    )  # fmt: skip
    src = _wheel(
        tmp_path / "triton-3.8.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        {
            "triton/__init__.py": b"__version__ = '3.8.0'\n",
            "triton/_C/libtriton.so": elf,
            "triton/backends/nvidia/bin/ptxas": b"ptxas",
            "triton/backends/nvidia/bin/ptxas-blackwell": b"blackwell",
            "triton/backends/nvidia/lib/cupti/libcupti_static.a": b"archive",
        },
    )
    out = tmp_path / "out.whl"
    stats = repack_wheel(src, out, keep_sm=90)
    assert set(stats["dropped_files"]) == {
        "triton/backends/nvidia/bin/ptxas-blackwell",
        "triton/backends/nvidia/lib/cupti/libcupti_static.a",
    }
    assert stats["pruned"]["triton/_C/libtriton.so"]["zeroed"] == 256 + 64
    with zipfile.ZipFile(out) as z:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        lib = z.read("triton/_C/libtriton.so")
        assert len(lib) == len(elf)
        assert sm90 in lib and ptx90 in lib and sm80 not in lib and sm100 not in lib
        record = z.read("triton-3.8.0.dist-info/RECORD").decode().splitlines()
        assert "triton/backends/nvidia/bin/ptxas-blackwell" not in "".join(record)
        line = next(r for r in record if r.startswith("triton/_C/libtriton.so,"))
        assert line.endswith(f",{len(lib)}")
    # a Blackwell host keeps the Blackwell ptxas; 'all' prunes nothing
    stats = repack_wheel(src, tmp_path / "b.whl", keep_sm=100)
    assert "triton/backends/nvidia/bin/ptxas-blackwell" not in stats["dropped_files"]
    assert repack_wheel(src, tmp_path / "c.whl", keep_sm=None)["pruned"] == {}


def test_elf_dynamic_reads_needed():
    import sysconfig

    libs = sorted(Path(sysconfig.get_config_var("DESTSHARED")).glob("_ssl*.so"))
    if not libs:
        pytest.skip("no _ssl extension module")
    dyn = elf_dynamic(libs[0].read_bytes())
    assert any(n.startswith("libc.so") for n in dyn["needed"])
    assert elf_dynamic(b"not an elf") == {}


# ---------------------------------------------------------------------------
# the host script on a synthetic payload


def _fake_stack(tmp_path: Path) -> list[Path]:
    d = tmp_path / "wheels"
    d.mkdir(parents=True)
    return [
        _wheel(
            d / "torch-2.14.0-py3-none-any.whl",  # installs on any test Python
            {
                "torch/__init__.py": b"__version__ = '2.14.0'\n",
                "torch/lib/libtorch_cuda.so": os.urandom(30_000),
            },
        ),
        _wheel(
            d / "nvidia_cudnn_cu13-9.24.0.43-py3-none-any.whl",
            {"nvidia/cudnn/lib/libcudnn.so.9": b"cudnn"},
        ),
    ]


def _decisions(host_rule_required: str = ">=1") -> list[Decision]:
    return [
        Decision("torch", "==2.14.0", "2.11.0", True, "", "host has 2.11.0", "2.14.0"),
        Decision("nvidia-cudnn-cu13", "==9.24.0.43", "9.19.0.56", True, "", "old"),
        # served by the host: pip stands in for a host library here
        Decision("pip", host_rule_required, "1", False, "spec", "meets"),
        # version not recorded: a miss only warns
        Decision("pytest", ">=999", None, False, "assumed", "assumed"),
        Decision("cuda-toolkit", "==13.0.3", "13.0.2", False, "meta", "meta"),
    ]


@pytest.fixture
def staged(tmp_path):
    out = tmp_path / "torch-bundle"
    manifest = build_torch_bundle(
        out, _fake_stack(tmp_path), _decisions(), "2.14.0", part_size=12 * 1024,
        keep_sm=90, level="1", threads=1,
    )  # fmt: skip
    # a host site-packages with the CUDA folders the bundle does not carry
    site = tmp_path / "host-site"
    (site / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (site / "nvidia" / "cu13" / "lib" / "libcublas.so.13").write_bytes(b"cublas")
    (site / "nvidia" / "cudnn" / "lib").mkdir(parents=True)  # the old one
    return out, manifest, site


def _run(staging: Path, target: Path, site: Path, *extra: str, **env_extra: str):
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(site), **env_extra)
    return subprocess.run(
        ["bash", str(INSTALL_SH), str(staging), str(target), *extra],
        capture_output=True,
        text=True,
        env=env,
    )


def test_manifest_and_upload_folders(staged):
    out, manifest, _ = staged
    parts = manifest["parts"]
    assert len(parts) >= 2
    assert all(p["size"] <= 12 * 1024 for p in parts)
    assert sum(p["size"] for p in parts) == manifest["payload"]["size"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert [d["name"] for d in manifest["carried"]] == ["torch", "nvidia-cudnn-cu13"]
    assert manifest["sizes"]["raw_wheels"] > 0 and manifest["sizes"]["xz"] > 0
    for i, p in enumerate(parts, 1):
        names = sorted(f.name for f in (out / f"upload-{i}").iterdir())
        assert names == sorted([p["name"], "install.sh", "manifest.json"])


def test_uploads_join_install_and_link_the_host_libraries(staged, tmp_path):
    out, manifest, site = staged
    staging, target = tmp_path / "staging", tmp_path / "torch214"
    n = len(manifest["parts"])
    for i in range(1, n):
        proc = _run(staging, target, site, "--from", str(out / f"upload-{i}"))
        assert proc.returncode == 3, proc.stderr
        assert f"{i} of {n} part(s) here; waiting for" in proc.stdout
    assert not target.exists()
    proc = _run(staging, target, site, "--from", str(out / f"upload-{n}"))
    assert proc.returncode == 0, proc.stderr
    assert f"{n} part(s) verified for torch 2.14.0" in proc.stdout
    assert "payload verified" in proc.stdout
    assert "host pip" in proc.stdout and ": ok" in proc.stdout
    assert "warning: pytest" in proc.stdout and "does not meet >=999" in proc.stdout
    assert (target / "torch" / "__init__.py").exists()
    assert (target / "torch-2.14.0.dist-info").is_dir()
    # the carried cuDNN is the bundle's; the host's cu13 is linked in
    cudnn = target / "nvidia" / "cudnn"
    assert not cudnn.is_symlink()
    assert (cudnn / "lib" / "libcudnn.so.9").read_bytes() == b"cudnn"
    cu13 = target / "nvidia" / "cu13"
    assert cu13.is_symlink() and (cu13 / "lib" / "libcublas.so.13").exists()
    env_sh = (target / "env.sh").read_text()
    assert f'PYTHONPATH="{target}' in env_sh
    assert "LD_LIBRARY_PATH" not in env_sh.replace("no LD_LIBRARY_PATH", "")
    check = subprocess.run(
        ["bash", "-c", f"source {target}/env.sh && cd / && {sys.executable} -c "
         "'import torch; print(torch.__version__, torch.__file__)'"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.stdout.split() == ["2.14.0", str(target / "torch" / "__init__.py")]
    assert not list(tmp_path.glob("torch214.install-*"))
    # the same payload again: kept as it is
    proc = _run(staging, target, site)
    assert proc.returncode == 0 and "already holds this payload" in proc.stdout


def test_corrupt_part_and_unmet_host_are_refused(tmp_path, staged):
    out, manifest, site = staged
    target = tmp_path / "target"
    second = out / manifest["parts"][1]["name"]
    data = bytearray(second.read_bytes())
    data[10] ^= 0xFF
    second.write_bytes(bytes(data))
    proc = _run(out, target, site)
    assert proc.returncode == 1
    assert f"sha256 mismatch: {second.name}" in proc.stderr
    assert not target.exists()

    # a host library below what the manifest relies on
    bad = tmp_path / "bad"
    build_torch_bundle(
        bad, _fake_stack(tmp_path / "b"), _decisions(">=999"), "2.14.0",
        part_size=1 << 20, level="1", threads=1,
    )  # fmt: skip
    proc = _run(bad, target, site)
    assert proc.returncode == 1
    assert "the host does not have what the bundle relies on" in proc.stderr
    assert "pip" in proc.stderr and not target.exists()
    proc = _run(bad, target, site, HSFORK_IGNORE_HOST="1")
    assert proc.returncode == 0, proc.stderr
    assert (target / "torch" / "__init__.py").exists()


def test_host_script_python_compiles():
    """The embedded Python (the GPU check included, which runs only on a GPU
    host) at least compiles."""
    text = INSTALL_SH.read_text()
    blocks = re.findall(r"<<'EOF'\n(.*?)\nEOF", text, re.S)
    assert len(blocks) >= 5
    for block in blocks:
        compile(block, "install_torch_stack.sh", "exec")
    assert "torch.cuda.is_available()" in text and "@triton.jit" in text
    # triton's @jit reads its function's source: the GPU check runs from a
    # file, not from stdin
    check = next(b for b in blocks if "@triton.jit" in b)
    head = text[: text.index(check)]
    assert head.rstrip().endswith("cat > \"$CHECK_PY\" <<'EOF'"), head[-200:]
    assert '"$PY" "$CHECK_PY" "$TARGET"' in text


def test_parts_of_an_earlier_build_are_not_taken(staged, tmp_path):
    """--from an upload of another payload (a rebuilt bundle: the same part
    names) clears the staged parts of the earlier one: the new build waits
    for its own parts instead of calling the earlier ones corrupt."""
    out, manifest, site = staged
    old = tmp_path / "old"
    build_torch_bundle(
        old, _fake_stack(tmp_path / "o"), _decisions(), "2.14.0",
        part_size=12 * 1024, keep_sm=90, level="1", threads=1,
    )  # fmt: skip
    staging, target = tmp_path / "staging", tmp_path / "torch214"
    n = len(manifest["parts"])
    old_n = len(json.loads((old / "manifest.json").read_text())["parts"])
    for i in range(1, old_n):
        proc = _run(staging, target, site, "--from", str(old / f"upload-{i}"))
        assert proc.returncode == 3, proc.stderr
    for i in range(n, 0, -1):
        proc = _run(staging, target, site, "--from", str(out / f"upload-{i}"))
        assert proc.returncode == (0 if i == 1 else 3), proc.stdout + proc.stderr
    assert (target / "torch" / "__init__.py").exists()
    assert json.loads((target / "manifest.json").read_text()) == manifest
