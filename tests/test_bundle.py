# SPDX-License-Identifier: Apache-2.0
"""The air-gapped GPU bundle: built, split, reassembled, verified, installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hsfork.bundle import build_bundle, is_optional, parse_size, resplit
from hsfork.common import ToolError

VERSION = "0.26.0+hybridspec.p0.test"


def _fake_fork_wheel(path: Path) -> Path:
    rnd = os.urandom(40_000)  # incompressible: forces several parts
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", f"__version__ = {VERSION!r}\nclass LLM: ...\n")
        z.writestr("vllm/_C_stable_libtorch.abi3.so", rnd)
        z.writestr("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", b"optional fa2")
        z.writestr(
            "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so", b"dg"
        )
        z.writestr(
            f"vllm-{VERSION}.dist-info/METADATA", f"Name: vllm\nVersion: {VERSION}\n"
        )
    return path


def _fake_dep_wheel(d: Path, name: str, pth: bool = False) -> Path:
    d.mkdir(exist_ok=True)
    p = d / f"{name}-1.0-py3-none-any.whl"
    di = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        if pth:
            # as nvidia-cutlass-dsl ships its `cutlass` package: a folder
            # that a .pth file puts on sys.path
            z.writestr(f"{name}/dsl_packages/{name}_inner/__init__.py", "VALUE = 7\n")
            z.writestr(
                f"{name}_packages.pth",
                f"import sys, os, {name}; sys.path.insert(0, "
                f"os.path.join({name}.__path__[0], 'dsl_packages'))\n",
            )
        z.writestr(
            f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
        )
        z.writestr(
            f"{di}/WHEEL",
            "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{di}/RECORD", "")
    return p


@pytest.fixture
def bundle(tmp_path):
    wheel = _fake_fork_wheel(tmp_path / f"vllm-{VERSION}-cp38-abi3-linux_x86_64.whl")
    deps = [
        _fake_dep_wheel(tmp_path / "deps", "hsdep_one"),
        _fake_dep_wheel(tmp_path / "deps", "hsdep_two", pth=True),
    ]
    tests = tmp_path / "ourtests"
    tests.mkdir()
    (tests / "test_gpu.py").write_text("def test(): pass\n")
    out = tmp_path / "bundle"
    manifest = build_bundle(
        out, wheel, deps, {"tests": tests}, VERSION, part_size=16 * 1024, level="6"
    )
    return out, manifest, wheel


def _install(staging: Path, target: Path, *extra: str):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(staging / "install.sh"), str(staging), str(target), *extra],
        capture_output=True,
        text=True,
        env=env,
    )


def test_parts_respect_size_and_manifest(bundle):
    out, manifest, _ = bundle
    parts = manifest["parts"]
    assert len(parts) >= 3
    assert all(p["size"] <= 16 * 1024 for p in parts)
    assert sum(p["size"] for p in parts) == manifest["payload"]["size"]
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert (
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" in manifest["contents"]["excluded"]
    )


def test_roundtrip_install(bundle, tmp_path):
    out, manifest, wheel = bundle
    # parts arrive in a staging folder, one upload folder (a part, the
    # manifest, the installer) at a time, as hsfork/gpu_stage.sh copies them
    staging = tmp_path / "staging"
    staging.mkdir()
    uploads = sorted(out.glob("upload-*"))
    assert len(uploads) == len(manifest["parts"])
    for upload in uploads:
        for f in upload.iterdir():
            (staging / f.name).write_bytes(f.read_bytes())
    target = tmp_path / "target"
    proc = _install(staging, target, "--check")
    assert proc.returncode == 0, proc.stderr
    assert f"part(s) verified for vllm {VERSION}" in proc.stdout
    assert "payload verified" in proc.stdout
    assert f"import vllm {VERSION} from {target}" in proc.stdout
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            installed = target / "site" / name
            if is_optional(name):
                assert not installed.exists(), name
            else:
                assert installed.read_bytes() == z.read(name), name
    assert (target / "repo" / "tests" / "test_gpu.py").exists()
    env_sh = (target / "env.sh").read_text()
    assert f"{target}/site:{target}/deps:" in env_sh
    assert f"{target}/deps/hsdep_two/dsl_packages:{target}/repo" in env_sh
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in env_sh
    check = subprocess.run(
        [
            "bash",
            "-c",
            f"source {target}/env.sh && cd / && "
            f"{sys.executable} -c 'import hsdep_one, hsdep_two, hsdep_two_inner; "
            "print(hsdep_one.VALUE, hsdep_two_inner.VALUE)'",
        ],
        capture_output=True,
        text=True,
    )
    # the .pth file's folder is on the path: installed with --target, deps
    # is not a site directory
    assert check.stdout.strip() == "42 7", check.stderr
    assert not list(tmp_path.glob("target.install-*"))  # temp folder cleaned


def test_corrupt_or_missing_part_is_refused(bundle, tmp_path):
    out, manifest, _ = bundle
    target = tmp_path / "target"
    second = out / manifest["parts"][1]["name"]
    data = bytearray(second.read_bytes())
    data[100] ^= 0xFF
    second.write_bytes(bytes(data))
    proc = _install(out, target)
    assert proc.returncode != 0
    assert f"sha256 mismatch: {second.name}" in proc.stderr
    second.unlink()
    proc = _install(out, target)
    assert proc.returncode != 0
    assert f"missing: {second.name}" in proc.stderr
    assert not target.exists()


def test_with_optional_keeps_everything(tmp_path):
    wheel = _fake_fork_wheel(tmp_path / "v.whl")
    m = build_bundle(tmp_path / "b", wheel, [], {}, VERSION, 1 << 20, True, level="1")
    assert m["contents"]["excluded"] == []
    assert len(m["parts"]) == 1


def test_include_keeps_only_the_named_optional_part(tmp_path):
    wheel = _fake_fork_wheel(tmp_path / "v.whl")
    m = build_bundle(
        tmp_path / "b", wheel, [], {}, VERSION, 1 << 20, ["fa2"], level="1"
    )
    assert m["contents"]["excluded"] == [
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so"
    ]
    assert m["with_optional"] == ["fa2"]
    with pytest.raises(ToolError, match="unknown optional part"):
        build_bundle(tmp_path / "c", wheel, [], {}, VERSION, 1 << 20, ["fa3"])


def test_parse_size():
    assert parse_size("60M") == 60 << 20
    assert parse_size("512K") == 512 << 10
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("1000") == 1000


GPU_STAGE = Path(__file__).resolve().parent.parent / "hsfork" / "gpu_stage.sh"


def _stage(upload: Path, staging: Path, target: Path):
    env = dict(os.environ, PYTHON=sys.executable, HS_STAGING=str(staging),
               HS_TARGET=str(target))  # fmt: skip
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(GPU_STAGE), str(upload)], capture_output=True, text=True, env=env
    )


def test_gpu_stage_one_upload_at_a_time(bundle, tmp_path):
    """hsfork/gpu_stage.sh: exit 3 naming the missing parts until the last
    upload, then the install (manifest kept beside it, parts removed); the
    parts of an unfinished earlier build of the same version are not taken
    for the new build's."""
    out, manifest, _ = bundle
    staging, target = tmp_path / "hs-staging", tmp_path / "hybridspec"
    uploads = sorted(out.glob("upload-*"), key=lambda d: int(d.name.split("-")[1]))
    n = len(uploads)
    # an earlier build of the same version, staged but for its last upload
    old = tmp_path / "old"
    old.mkdir()
    wheel = _fake_fork_wheel(old / f"vllm-{VERSION}-cp38-abi3-linux_x86_64.whl")
    build_bundle(old / "b", wheel, [], {}, VERSION, part_size=16 * 1024, level="6")
    old_uploads = sorted((old / "b").glob("upload-*"))
    for d in old_uploads[:-1]:
        assert _stage(d, staging, target).returncode == 3
    # the new build arrives, last upload first
    for i, d in enumerate(reversed(uploads), 1):
        proc = _stage(d, staging, target)
        if i < n:
            assert proc.returncode == 3, proc.stdout + proc.stderr
            assert "[stage] waiting for:" in proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"import vllm {VERSION} from {target}" in proc.stdout
    assert json.loads((target / "manifest.json").read_text()) == manifest
    assert not list(staging.glob("*.part-*"))
    proc = _stage(uploads[0], staging, target)
    assert proc.returncode == 0 and "already holds this bundle" in proc.stdout


def test_resplit_keeps_the_payload_and_stages_over_the_old_split(bundle, tmp_path):
    """hsfork resplit: smaller parts, the same payload; parts of the old split
    left in the staging folder (same names, other bytes) are dropped when the
    new split's first upload arrives, and the install goes through."""
    out, manifest, _ = bundle
    staging, target = tmp_path / "hs-staging", tmp_path / "hybridspec"
    old_uploads = sorted(out.glob("upload-*"), key=lambda d: int(d.name.split("-")[1]))
    # the old split, staged but for its last upload (copies: resplit
    # rewrites the bundle folder)
    for d in old_uploads[:-1]:
        assert _stage(d, staging, target).returncode == 3
    new = resplit(out, 8 * 1024)
    assert new["payload"] == manifest["payload"]
    assert len(new["parts"]) > len(manifest["parts"])
    assert all(p["size"] <= 8 * 1024 for p in new["parts"])
    assert sum(p["size"] for p in new["parts"]) == new["payload"]["size"]
    assert json.loads((out / "manifest.json").read_text()) == new
    uploads = sorted(out.glob("upload-*"), key=lambda d: int(d.name.split("-")[1]))
    assert len(uploads) == len(new["parts"])
    for i, d in enumerate(uploads, 1):
        proc = _stage(d, staging, target)
        assert proc.returncode == (0 if i == len(uploads) else 3), proc.stderr
    assert f"import vllm {VERSION} from {target}" in proc.stdout
    # a corrupt part is refused before anything is rewritten
    first = out / new["parts"][0]["name"]
    first.write_bytes(b"x" + first.read_bytes()[1:])
    with pytest.raises(ToolError, match="sha256 mismatch"):
        resplit(out, 16 * 1024)
    assert json.loads((out / "manifest.json").read_text()) == new


RESOLVE_CHILD = """
import json, subprocess, sys, zipfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from hsfork import bundle

INDEX = {
    "nvidia-cutlass-dsl": ("4.8.0", [
        "nvidia-cutlass-dsl-libs-base==4.8.0",
        "nvidia-cutlass-dsl-libs-cu12==4.8.0",
        'nvidia-cutlass-dsl-libs-cu13==4.8.0; extra == "cu13"',
        "nvidia-cuda-runtime>=13",
        "numpy",
    ]),
    "nvidia-cutlass-dsl-libs-base": ("4.8.0", []),
    "nvidia-cutlass-dsl-libs-cu12": ("4.8.0", []),
    "nvidia-cutlass-dsl-libs-cu13": ("4.8.0", []),
}
asked = []

def wheel(dest, name, version, requires):
    stem = f"{name.replace('-', '_')}-{version}"
    meta = f"Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n"
    meta += "".join(f"Requires-Dist: {r}\\n" for r in requires)
    with zipfile.ZipFile(dest / f"{stem}-py3-none-any.whl", "w") as z:
        z.writestr(f"{stem}.dist-info/METADATA", meta + "\\n")

def fake_pip(cmd, **kwargs):
    # pip download, answered from INDEX
    dest = Path(cmd[cmd.index("--dest") + 1])
    for req in cmd[cmd.index("--platform"):]:
        name = req.split("=")[0].split(">")[0]
        if name in INDEX:
            asked.append(name)
            wheel(dest, name, *INDEX[name])
    return subprocess.CompletedProcess(cmd, 0, "", "")

bundle.subprocess.run = fake_pip
out, tmp = {}, Path(sys.argv[2])
report = {}
host = {"numpy": None}
got = bundle.resolve_dependencies(["nvidia-cutlass-dsl[cu13]==4.8.0"], tmp / "a",
                                  host=host, report=report,
                                  carry={"nvidia-cutlass-dsl"})
out["carried"] = sorted(p.name for p in got)
out["unmet"] = report["host_stack_unmet"]
out["other_flavors"] = report["other_cuda_flavors"]
out["kept_in_cache"] = sorted(p.name.split("-")[0] for p in (tmp / "a").glob("*.whl"))
cu12 = bundle.resolve_dependencies(["nvidia-cutlass-dsl[cu13]==4.8.0"], tmp / "c",
                                   host=host, carry={"nvidia-cutlass-dsl"},
                                   host_cuda=12)
out["for_a_cu12_host"] = sorted(p.name.split("-")[0] for p in cu12)
out["asked"] = list(asked)
asked.clear()
out["without_carry"] = [p.name for p in bundle.resolve_dependencies(
    ["nvidia-cutlass-dsl[cu13]==4.8.0"], tmp / "b", host=host)]
out["asked_without_carry"] = list(asked)
print("RESULT " + json.dumps(out))
"""


def test_an_extra_requirement_is_carried_though_its_name_looks_like_cuda(tmp_path):
    """`bundle --requirement 'nvidia-cutlass-dsl[cu13]==4.8.0'` carries the
    package and the libraries its extra pulls in, though names starting with
    ``nvidia-`` are otherwise left to the host's CUDA stack. (In a child
    process: the resolver imports pip, after which setuptools' distutils
    shim steps aside for the rest of a process.)"""
    from conftest import run_until_done

    script = tmp_path / "resolve.py"
    script.write_text(RESOLVE_CHILD)
    proc = run_until_done(
        [sys.executable, str(script), str(Path(__file__).resolve().parent.parent),
         str(tmp_path)],
        what="the dependency resolver with a fake pip",
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT ") :])
    assert [n.split("-")[0] for n in got["carried"]] == [
        "nvidia_cutlass_dsl",
        "nvidia_cutlass_dsl_libs_base",
        "nvidia_cutlass_dsl_libs_cu13",
    ]
    # its unconditional cu12 libraries: not for a CUDA 13 host (kept in the
    # download cache), carried for a CUDA 12 one
    assert got["other_flavors"] == ["nvidia-cutlass-dsl-libs-cu12"]
    assert "nvidia_cutlass_dsl_libs_cu12" in got["kept_in_cache"]
    assert got["for_a_cu12_host"] == [
        "nvidia_cutlass_dsl",
        "nvidia_cutlass_dsl_libs_base",
        "nvidia_cutlass_dsl_libs_cu12",
    ]
    # a CUDA library it names is still the host's, and reported if unmet
    assert "nvidia-cuda-runtime" not in got["asked"]
    assert got["unmet"] == ["nvidia-cuda-runtime>=13 (host: ?)"]
    # without carry, the package is left to the host stack like a CUDA library
    assert got["without_carry"] == [] and got["asked_without_carry"] == []


def test_the_cutlass_dsl_brings_the_quack_kernels_vllm_pins_beside_it(tmp_path):
    """Carrying the CUTLASS DSL alone made v0.33.0's MoE router take its
    CuTe DSL tier, which imports QuACK: the bundle carries vLLM's own pin of
    quack-kernels with it, and nothing for requirements without companions."""
    from hsfork.bundle import with_companions

    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(
            "vllm-0.33.0.dist-info/METADATA",
            "Name: vllm\nVersion: 0.33.0\n"
            "Requires-Dist: nvidia-cutlass-dsl[cu13]==4.8.0\n"
            "Requires-Dist: quack-kernels==0.6.5\n"
            'Requires-Dist: tokenspeed-mla==2.0.3; platform_system == "Linux"\n',
        )
    assert with_companions(["nvidia-cutlass-dsl[cu13]==4.8.0"], wheel) == [
        "nvidia-cutlass-dsl[cu13]==4.8.0",
        "quack-kernels==0.6.5",
    ]
    # a companion named already keeps the caller's pin
    assert with_companions(
        ["nvidia_cutlass_dsl==4.8.0", "quack-kernels==0.6.4"], wheel
    ) == ["nvidia_cutlass_dsl==4.8.0", "quack-kernels==0.6.4"]
    assert with_companions(["flashinfer-python==0.7.2.post1"], wheel) == [
        "flashinfer-python==0.7.2.post1"
    ]


def test_flashinfer_toggle_hides_the_package_from_vllm_lookup(tmp_path):
    """`flashinfer_toggle.sh off` moves the package and its dist-info out of
    the bundle's dependency folder, so that find_spec (how vLLM asks) no
    longer finds it; `on` brings both back; each is a no-op when repeated."""
    script = Path(__file__).resolve().parent.parent / "hsfork" / "flashinfer_toggle.sh"
    deps = tmp_path / "deps"
    (deps / "flashinfer").mkdir(parents=True)
    (deps / "flashinfer" / "__init__.py").write_text("")
    (deps / "flashinfer_python-0.7.2.post1.dist-info").mkdir()
    (deps / "other").mkdir()

    def toggle(mode):
        p = subprocess.run(
            ["bash", str(script), mode, str(deps)], capture_output=True, text=True
        )
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    def found():
        code = "import importlib.util as u; print(u.find_spec('flashinfer') is None)"
        p = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(deps)},
        )
        return p.stdout.strip() == "False"

    assert found()
    assert toggle("off") == toggle("off") == "flashinfer: off"
    assert not found()
    assert sorted(x.name for x in deps.iterdir()) == ["other"]
    assert toggle("on").startswith("flashinfer: on")
    assert toggle("on").startswith("flashinfer: on")
    assert found()
    assert (deps / "flashinfer_python-0.7.2.post1.dist-info").is_dir()
