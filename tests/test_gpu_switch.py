"""hsfork/gpu_switch.sh: one lease, two lines. The install the GPU scripts
read and the sites made from it are parked, the other install is linked in
its place, and the switch is refused while a background job runs."""

import json
import os
import subprocess
from pathlib import Path

from conftest import REPO, run_until_done

SWITCH = REPO / "hsfork" / "gpu_switch.sh"


def _install(path: Path, version: str) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"version": version}))
    (path / "env.sh").write_text(f"export HSFORK_BUNDLE={path}\n")
    (path / "site").mkdir()
    return path


def _switch(tmp: Path, new: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HS_TARGET": str(tmp / "hybridspec"),
           "HS_SITE_ROOT": str(tmp), "HS_PARKED": str(tmp / "parked"),
           "HS_BG": str(tmp / "bg")}  # fmt: skip
    return run_until_done(
        ["bash", str(SWITCH), str(new)], what="gpu_switch.sh", env=env
    )


def test_switch_parks_the_line_and_links_the_other(tmp_path: Path):
    _install(tmp_path / "hybridspec", "0.26.0+hybridspec.p36.x")
    for site in ("upstream-site", "site-0001"):
        (tmp_path / site).mkdir()
    new = _install(tmp_path / "hybridspec-33", "0.33.0+hybridspec.p28.y")
    proc = _switch(tmp_path, new)
    assert proc.returncode == 0, proc.stderr
    target = tmp_path / "hybridspec"
    assert target.is_symlink() and target.resolve() == new
    parked = tmp_path / "parked" / "line-v0.26.0"
    assert (parked / "hybridspec" / "manifest.json").exists()
    assert (parked / "upstream-site").is_dir() and (parked / "site-0001").is_dir()
    assert not (tmp_path / "upstream-site").exists()
    # the second line makes its sites; switching back parks them and
    # brings the first line's back
    (tmp_path / "upstream-site").mkdir()
    proc = _switch(tmp_path, parked / "hybridspec")
    assert proc.returncode == 0, proc.stderr
    assert target.resolve() == parked / "hybridspec"
    assert (tmp_path / "parked" / "line-v0.33.0" / "upstream-site").is_dir()
    assert new.is_dir()  # a link is removed, not its install
    assert (tmp_path / "upstream-site").is_dir() and (tmp_path / "site-0001").is_dir()


def test_switch_is_refused_while_a_background_job_runs(tmp_path: Path):
    _install(tmp_path / "hybridspec", "0.26.0+hybridspec.p36.x")
    new = _install(tmp_path / "hybridspec-33", "0.33.0+hybridspec.p28.y")
    bg = tmp_path / "bg"
    bg.mkdir()
    job = subprocess.Popen(["sleep", "600"])
    try:
        (bg / "owed.pid").write_text(str(job.pid))
        proc = _switch(tmp_path, new)
    finally:
        job.kill()
        job.wait()
    assert proc.returncode == 4
    assert "background jobs still running: owed" in proc.stderr
    assert not (tmp_path / "hybridspec").is_symlink()
    # once it has ended, the switch goes through
    assert _switch(tmp_path, new).returncode == 0


def test_switch_wants_an_installed_bundle(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    proc = _switch(tmp_path, tmp_path / "empty")
    assert proc.returncode == 2 and "holds no installed bundle" in proc.stderr


def test_a_second_line_runs_from_its_own_home(tmp_path: Path):
    """HS_HOME (harness/upstream_site.sh): a line installed beside the
    default one runs at the same time from its own install. Its env.sh, its
    manifest (how many patches the site carries), its variant sites, its vLLM
    caches and its FlashInfer folder are all its own; nothing points at
    /tmp/hybridspec or the default line's sites under /tmp."""
    home = tmp_path / "hybridspec-33"
    _install(home, "0.33.0+hybridspec.p28.abc")
    (home / "env.sh").write_text(
        f"export HSFORK_BASE=0.33.0 PYTHONPATH={home}/site:{home}/deps\n"
    )
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "series").write_text("")
    script = "\n".join(
        [
            f"R={REPO}; PATCHES={patches}",
            f"source {REPO}/harness/upstream_site.sh",
            'echo "$HS_SITE_ROOT"; echo "$BUNDLE_PATCHES"',
            "_site_dir fork; _site_dir upstream; _site_dir upstream+0001",
            "variant_cache upstream; echo $FLASHINFER_DIR",
            "site_pythonpath upstream",
        ]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HS_")}
    env["HS_HOME"] = str(home)
    out = run_until_done(
        ["bash", "-c", script], what="upstream_site.sh", env=env
    ).stdout.splitlines()
    sites = f"{home}-sites"
    assert out == [
        sites,
        "28",
        f"{home}/site",
        f"{sites}/upstream-site",
        f"{sites}/site-upstream+0001",
        f"{sites}/vllm-cache/upstream",
        f"{home}/flashinfer-off",
        f"{REPO}:{sites}/upstream-site:{home}/deps",
    ]
    assert Path(sites).is_dir()
    # the benchmarks' side-by-side runner takes the same sites
    from benchmarks.side_by_side import parse_args

    os.environ.update(HS_HOME=str(home), HS_SITE_ROOT=sites)
    try:
        a = parse_args(["--modes", "none"])
    finally:
        del os.environ["HS_HOME"], os.environ["HS_SITE_ROOT"]
    assert (a.fork_site, a.upstream_site) == (f"{home}/site", f"{sites}/upstream-site")
