# SPDX-License-Identifier: Apache-2.0
"""make sync / make export on a synthetic upstream, and on the real series."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import REPO, git

from hsfork import fork as hf
from hsfork.common import (
    ToolError,
    fork_dir,
    line_names,
    load_pin,
    patches_dir,
    selected_line,
)


def _commit_change(repo: Path, path: str, text: str, msg: str) -> None:
    target = repo / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    git(repo, "add", path)
    git(repo, "commit", "-q", "-s", "-m", msg)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_sync_imports_sdist_tags_and_stays_clean(synth):
    repo = hf.sync()
    assert git(repo, "tag").split() == ["v0.26.0"]
    assert git(repo, "rev-list", "--count", "HEAD") == "1\n"
    tracked = set(git(repo, "ls-files").split())
    # a real source hidden by upstream's .gitignore is imported ...
    assert "benchmarks/data.json" in tracked
    # ... what the build regenerates is not
    assert "vllm/_version.py" not in tracked
    assert not any(p.startswith("vllm.egg-info") for p in tracked)
    assert hf.dirty_paths(repo) == []
    # the import commit is reproducible
    first = git(repo, "rev-parse", "HEAD")
    shutil.rmtree(repo)
    assert git(hf.sync(), "rev-parse", "HEAD") == first


def test_sync_then_export_is_byte_identical(synth):
    repo = hf.sync()
    _commit_change(repo, "vllm/core.py", "LINE_0 = 'patched'\n", "Fix core\n\nWhy.")
    _commit_change(repo, "vllm/new.py", "Y = 2\n", "[Bugfix][Core] Add new module")
    hf.export()
    first = _snapshot(synth.patch_dir)
    assert first["series"] == (
        b"0001-Fix-core.patch\n0002-Bugfix-Core-Add-new-module.patch\n"
    )
    assert first["0001-Fix-core.patch"].startswith(b"From " + b"0" * 40)
    assert b"Signed-off-by: Test Author" in first["0001-Fix-core.patch"]
    # a fresh clone of our repo has no fork/: sync from patches, export again
    shutil.rmtree(repo)
    hf.sync()
    # upstream-style subject tags survive git am
    assert git(repo, "log", "-1", "--format=%s") == "[Bugfix][Core] Add new module\n"
    hf.export()
    assert _snapshot(synth.patch_dir) == first
    # and sync on an in-sync fork/ rebuilds it without complaint
    hf.sync()
    hf.export()
    assert _snapshot(synth.patch_dir) == first


def test_sync_refuses_uncommitted_changes(synth):
    repo = hf.sync()
    (repo / "vllm" / "other.py").write_text("X = 2\n")
    with pytest.raises(ToolError, match="(?s)uncommitted changes.*vllm/other.py"):
        hf.sync()
    assert (repo / "vllm" / "other.py").read_text() == "X = 2\n"
    (repo / "vllm" / "untracked.py").write_text("")
    git(repo, "checkout", "vllm/other.py")
    with pytest.raises(ToolError, match="(?s)uncommitted changes.*untracked.py"):
        hf.sync()


def test_sync_refuses_unexported_commits(synth):
    repo = hf.sync()
    _commit_change(repo, "vllm/other.py", "X = 3\n", "Work in progress")
    with pytest.raises(ToolError, match="(?s)never exported.*Work in progress"):
        hf.sync()
    assert (repo / "vllm" / "other.py").read_text() == "X = 3\n"
    hf.export()
    hf.sync()  # exported now: allowed, and the commit comes back from patches/
    assert (repo / "vllm" / "other.py").read_text() == "X = 3\n"


def test_sync_picks_up_new_patches_when_fork_is_clean(synth):
    repo = hf.sync()
    _commit_change(repo, "vllm/other.py", "X = 4\n", "Change other")
    hf.export()
    saved = _snapshot(synth.patch_dir)
    shutil.rmtree(repo)
    (synth.patch_dir / "series").write_text("")  # an older checkout of patches/
    hf.sync()
    assert (repo / "vllm" / "other.py").read_text() == "X = 1\n"
    for name, data in saved.items():  # `git pull` brings the patch back
        (synth.patch_dir / name).write_bytes(data)
    hf.sync()
    assert (repo / "vllm" / "other.py").read_text() == "X = 4\n"


def test_broken_patch_names_patch_and_file(synth):
    repo = hf.sync()
    _commit_change(repo, "vllm/core.py", "LINE_0 = 'a'\n", "Good patch")
    _commit_change(repo, "vllm/other.py", "X = 5\n", "Patch to break")
    hf.export()
    before = git(repo, "rev-parse", "HEAD")
    broken = synth.patch_dir / "0002-Patch-to-break.patch"
    broken.write_text(broken.read_text().replace("-X = 1", "-X = 100"))
    with pytest.raises(ToolError) as err:
        hf.sync()
    msg = str(err.value)
    assert "0002-Patch-to-break.patch" in msg
    assert "vllm/other.py" in msg
    # the existing fork/ is untouched and nothing half-built is left behind
    assert git(repo, "rev-parse", "HEAD") == before
    leftovers = [p.name for p in synth.root.iterdir() if p.name.startswith(".fork")]
    assert leftovers == []


def test_series_naming_a_missing_patch_is_an_error(synth):
    (synth.patch_dir / "series").write_text("0001-gone.patch\n")
    with pytest.raises(ToolError, match="missing patch files: 0001-gone.patch"):
        hf.sync()


def test_local_label_identifies_the_stack(synth):
    empty = hf.local_label()
    assert empty.startswith("hybridspec.p0.")
    repo = hf.sync()
    _commit_change(repo, "vllm/other.py", "X = 6\n", "One")
    hf.export()
    one = hf.local_label()
    assert one.startswith("hybridspec.p1.") and one != empty
    assert hf.fork_version() == f"0.26.0+{one}"


@pytest.mark.parametrize("line", ["stable", "current"])
def test_real_series_sync_export_roundtrip(tmp_path, monkeypatch, line):
    """Each line's committed series applies to its pinned sdist and exports
    back byte-identically (what `make sync && make export` must keep clean)."""
    pin = load_pin(REPO / "upstream.toml", line=line)
    from hsfork.fetch import fetch_file

    sdist = fetch_file(pin, pin.file("sdist"), REPO / ".cache" / "upstream")
    committed = patches_dir(pin)
    monkeypatch.setenv("HSFORK_BASE", line)
    monkeypatch.setenv("HSFORK_CACHE", str(sdist.parent))
    monkeypatch.setenv("HSFORK_FORK", str(tmp_path / "fork"))
    exported = tmp_path / "patches"
    shutil.copytree(committed, exported, ignore=shutil.ignore_patterns("*.txt"))
    monkeypatch.setenv("HSFORK_PATCHES", str(exported))
    hf.sync()
    hf.export()
    series = {
        k: v for k, v in _snapshot(committed).items() if k != "upstream-tests.txt"
    }
    assert _snapshot(exported) == series


def test_lines_select_their_own_paths(monkeypatch):
    """Every line has its own series, fork and test bed; HSFORK_BASE takes a
    line name or a version, and an unknown one is refused with the list."""
    lines = line_names(REPO / "upstream.toml")
    assert set(lines) == {"stable", "current"}
    pins = {name: load_pin(REPO / "upstream.toml", line=name) for name in lines}
    assert len({patches_dir(p) for p in pins.values()}) == 2
    assert len({fork_dir(p) for p in pins.values()}) == 2
    for name, pin in pins.items():
        assert patches_dir(pin) == REPO / "patches" / pin.tag
        assert (patches_dir(pin) / "series").is_file()
        monkeypatch.setenv("HSFORK_BASE", pin.tag)
        assert selected_line(REPO / "upstream.toml") == name
    monkeypatch.setenv("HSFORK_BASE", "0.0.1")
    with pytest.raises(ToolError, match="stable .v0.26.0"):
        selected_line(REPO / "upstream.toml")


def test_ensure_synced_follows_patches_but_keeps_local_work(synth):
    repo = hf.sync()
    _commit_change(repo, "vllm/other.py", "X = 7\n", "Seven")
    hf.export()
    saved = _snapshot(synth.patch_dir)
    # patches/ moves back (e.g. a checkout of an older commit): fork/ follows
    for name in saved:
        (synth.patch_dir / name).unlink()
    (synth.patch_dir / "series").write_text("")
    hf.ensure_synced(allow_local_work=False)
    assert (repo / "vllm" / "other.py").read_text() == "X = 1\n"
    # local work: kept for tests, refused for a wheel
    (repo / "vllm" / "other.py").write_text("X = 8\n")
    assert hf.ensure_synced(allow_local_work=True) == repo
    assert (repo / "vllm" / "other.py").read_text() == "X = 8\n"
    with pytest.raises(ToolError, match="uncommitted changes"):
        hf.ensure_synced(allow_local_work=False)


def test_testbed_reinstalls_a_fork_whose_version_file_is_upstreams(tmp_path):
    """A fork materialized again has upstream's vllm/_version.py: the test
    bed must install it again, or its vLLM reports another version than the
    install's metadata."""
    from hsfork.testbed import version_file_holds

    (tmp_path / "vllm").mkdir()
    f = tmp_path / "vllm" / "_version.py"
    assert not version_file_holds(tmp_path, "0.33.0+hybridspec.p1.abc")
    f.write_text("__version__ = version = '0.33.0'\n")
    assert not version_file_holds(tmp_path, "0.33.0+hybridspec.p1.abc")
    f.write_text("__version__ = version = '0.33.0+hybridspec.p1.abc'\n")
    assert version_file_holds(tmp_path, "0.33.0+hybridspec.p1.abc")
