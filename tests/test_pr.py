# SPDX-License-Identifier: Apache-2.0
"""`hsfork pr`: the upstream PR package, on a synthetic series, and the
descriptions of the real series checked for words of our process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, git
from test_patch_messages import PROCESS_WORDS

from hsfork import fork as hf
from hsfork import pr
from hsfork.common import ToolError, line_names, load_pin, patches_dir

SIGNOFF = "Pat Maintainer <pat@maintainers.dev>"
_PROCESS_RES = [(re.compile(p, re.IGNORECASE), why) for p, why in PROCESS_WORDS]


def process_words(text: str) -> list[str]:
    """Every process word of ``text``, with the line it is on."""
    return [
        f"{m.group(0)!r} ({why}): {line.strip()}"
        for line in text.splitlines()
        for rx, why in _PROCESS_RES
        if (m := rx.search(line))
    ]


def _commit(repo: Path, files: dict[str, str], msg: str) -> None:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
        git(repo, "add", path)
    git(repo, "commit", "-q", "-s", "-m", msg)


@pytest.fixture
def series(synth):
    """A synthetic series of four patches exported from a synthetic fork:
    01 and 02 independent, 03 changes a module that 01 creates, 04's test
    does not depend on its fix."""
    repo = hf.sync()
    _commit(
        repo,
        {
            "vllm/helper.py": "def fixed_value():\n    return 1\n",
            "tests/test_helper.py": (
                "from vllm.helper import fixed_value\n\n\n"
                "def test_fixed_value():\n    assert fixed_value() == 1\n"
            ),
        },
        "[Bugfix][Core] Add the helper\n\n"
        "What was wrong: no helper.\n\nUpstream-Status: not-sent",
    )
    _commit(
        repo,
        {
            "vllm/other.py": "X = 2\n",
            "tests/test_other.py": (
                "from vllm.other import X\n\n\ndef test_x():\n    assert X == 2\n"
            ),
        },
        "[Bugfix][Core] Set X to two\n\nWhat was wrong: X was one.\n\n"
        "Testing: tests/test_other.py checks X.\n\n"
        "Bug: https://github.com/vllm-project/vllm/issues/4242\n"
        "Upstream-Status: not-sent",
    )
    _commit(
        repo,
        {
            "vllm/helper.py": "def fixed_value():\n    return 3\n",
            "tests/test_helper.py": (
                "from vllm.helper import fixed_value\n\n\n"
                "def test_fixed_value():\n    assert fixed_value() == 3\n"
            ),
        },
        "[Bugfix][Core] Return three\n\nUpstream-Status: not-sent",
    )
    _commit(
        repo,
        {
            "vllm/core.py": "LINE_0 = 'fixed'\n",
            "tests/test_unrelated.py": "def test_unrelated():\n    assert 1 + 1 == 2\n",
        },
        "[Bugfix][Core] Change core\n\nUpstream-Status: not-sent",
    )
    hf.export()
    return synth


def _manifest_entry(entries, nn):
    return next(e for e in entries if e.nn == nn)


def test_dependency_order_and_signoff(series, tmp_path):
    out = tmp_path / "pr"
    entries = pr.make_package(SIGNOFF, out=out)
    assert [e.nn for e in entries] == ["01", "02", "03", "04"]
    assert _manifest_entry(entries, "01").stacks_on == []
    assert _manifest_entry(entries, "02").stacks_on == []
    assert _manifest_entry(entries, "03").stacks_on == ["01"]
    assert _manifest_entry(entries, "04").stacks_on == []
    repo = out / "vllm"
    tag = load_pin().tag
    for e in entries:
        base = _manifest_entry(entries, e.stacks_on[0]).branch if e.stacks_on else tag
        # one commit on top of what it stacks on
        assert git(repo, "rev-parse", f"{e.branch}~1") == git(repo, "rev-parse", base)
        msg = git(repo, "log", "-1", "--format=%B", e.branch)
        assert f"Signed-off-by: {SIGNOFF}" in msg
        assert "Test Author" not in msg  # the series' placeholder sign-off
        assert "Upstream-Status" not in msg
        author = git(repo, "log", "-1", "--format=%an <%ae>", e.branch).strip()
        assert author == SIGNOFF
    desc = (out / entries[1].description).read_text()
    assert "Fixes #4242" in desc
    assert "What was wrong: X was one." in desc
    assert "pytest tests/test_other.py" in desc
    stacked = (out / entries[2].description).read_text()
    assert f'Depends on "{entries[0].title}"' in stacked
    for e in entries:
        assert process_words((out / e.description).read_text()) == []
    table = pr.list_package(out=out)
    assert all(e.branch in table for e in entries)


@pytest.mark.parametrize(
    "signoff",
    [None, "", "no-email", "Test Author <author@example.com>", "X <x@y.invalid>"],
)
def test_signoff_is_required(series, tmp_path, signoff):
    with pytest.raises(ToolError, match="sign-off"):
        pr.make_package(signoff, out=tmp_path / "pr")
    assert not (tmp_path / "pr").exists()


def test_cli_refuses_without_signoff(series):
    proc = subprocess.run(
        [sys.executable, "-m", "hsfork", "pr"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "sign-off identity is required" in proc.stderr


def test_revert_must_fail(series, tmp_path, monkeypatch):
    """A test that passes without the fix fails the check; tests that
    depend on their fix pass it, and the result lands in the description."""
    monkeypatch.setattr(pr, "PYTEST_PLUGINS", ())
    monkeypatch.setattr(pr, "testbed_python", lambda pin: Path(sys.executable))
    monkeypatch.setattr(pr, "tools_env", lambda tree, out: {})
    out = tmp_path / "pr"
    with pytest.raises(ToolError, match="(?s)checks failed.*pr/04-.*pass without"):
        pr.make_package(SIGNOFF, out=out, check=True)
    checks = {e.name: e for e in (out / "checks").glob("*.json")}
    assert sorted(checks) == ["01.json", "02.json", "03.json", "04.json"]
    entries = pr.make_package(SIGNOFF, out=out)  # reuses the recorded checks
    by_nn = {e.nn: e for e in entries}
    for nn in ("01", "02", "03"):
        tests = by_nn[nn].checks["tests"]
        assert tests["with_fix"]["ok"] and tests["without_fix"]["failed"], tests
        desc = (out / by_nn[nn].description).read_text()
        assert "fail without the fix and pass with it" in desc
    bad = by_nn["04"].checks["tests"]
    assert bad["with_fix"]["ok"] and not bad["without_fix"]["failed"]
    desc = (out / by_nn["04"].description).read_text()
    assert "fail without the fix" not in desc
    # the working tree is left as the tag, nothing reverted is left behind
    assert hf.dirty_paths(out / "vllm") == []


def _real_lines():
    out = []
    for name in line_names():
        pin = load_pin(line=name)
        if pr.read_series(patches_dir(pin)):
            out.append(pin)
    return out


@pytest.mark.parametrize("pin", _real_lines(), ids=lambda p: p.tag)
def test_real_descriptions_speak_to_upstream(pin):
    """Every description of the line's series, in both templates, stacked
    and checked or not, is free of process words; no git work needed."""
    pdir = patches_dir(pin)
    series = pr.load_series(pdir)
    as_of, refs = pr.load_refs(pdir)
    templates = [pr._fallback_template()]
    tpl = hf.fork_dir(pin) / pr.TEMPLATE
    if tpl.exists():
        templates.append(tpl.read_text())
    checked = {
        "lint": {"ruff check": {"status": "pass", "ok": True}},
        "tests": {
            "with_fix": {"ok": True, "summary": "3 passed in 1.00s"},
            "without_fix": {
                "failed": True,
                "summary": "1 failed, 2 passed in 1.00s",
                "failed_ids": ["tests/test_x.py::test_y"],
            },
            "ok": True,
            "where": "a CPU-only machine with TRITON_INTERPRET=1",
        },
    }
    found = []
    by_nn: dict[str, pr.PlanEntry] = {}
    for i, p in enumerate(series):
        entry = pr.PlanEntry(p.nn, p.branch, p.title, p.path.name)
        entry.stacks_on = [series[i - 1].nn] if i else []
        entry.fixes = pr.fixes_of(p, refs)
        entry.related = refs.get(p.subject, {}).get("related", [])
        entry.tests = p.test_files
        by_nn[p.nn] = entry
        for template in templates:
            for checks in (None, checked):
                entry.checks = checks
                text = pr.describe(p, entry, template, pin.tag, as_of, refs, by_nn)
                found += [f"{p.path.name}: {w}" for w in process_words(text)]
    assert found == [], "\n".join(found)


def test_refs_name_patches_of_the_series():
    """Every subject in an upstream-refs.toml is a patch of that line (a
    renamed patch would silently lose its references)."""
    for name in line_names():
        pdir = patches_dir(load_pin(line=name))
        _, refs = pr.load_refs(pdir)
        subjects = {p.subject for p in pr.load_series(pdir)}
        if subjects:
            assert set(refs) <= subjects, set(refs) - subjects


def test_process_word_check_catches_them():
    assert process_words("Tested in our harness matrix, session s5.")
    assert process_words("Fixes #12 on the decode path.") == []


# ---------------------------------------------------------------------------
# mypy: the hook of the config, and errors new vs pre-existing (no real mypy)

_PRECOMMIT = """\
repos:
- repo: local
  hooks:
  - id: mypy-3.10 # TODO: a comment
    entry: python tools/pre_commit/mypy.py "3.10"
    <<: &mypy_common
      language: python
      additional_dependencies: ["mypy==1.20.2", regex, types-torch, pydantic]
  - id: mypy-3.11
    entry: python tools/pre_commit/mypy.py "3.11"
    <<: *mypy_common
    stages: [manual]
"""


def test_mypy_hook_of_a_config():
    yaml = pytest.importorskip("yaml")
    hook = pr.mypy_hook(yaml.safe_load(_PRECOMMIT))
    assert hook["entry"] == 'python tools/pre_commit/mypy.py "3.10"'
    assert hook["additional_dependencies"][0] == "mypy==1.20.2"
    assert pr.mypy_hook({"repos": [{"repo": "local", "hooks": [{"id": "x"}]}]}) is None
    for pin in _real_lines():
        cfg = hf.fork_dir(pin) / ".pre-commit-config.yaml"
        if cfg.exists():
            hook = pr.mypy_hook(yaml.safe_load(cfg.read_text()))
            assert "tools/pre_commit/mypy.py" in hook["entry"], pin.tag
            assert any(
                d.startswith("mypy==") for d in hook["additional_dependencies"]
            ), pin.tag


_BASE_OUT = """\
$ mypy --python-version 3.11
vllm/a.py:10: error: Incompatible types in assignment  [assignment]
vllm/a.py:20: error: Incompatible types in assignment  [assignment]
vllm/a.py:30:5: error: Name "x" already defined on line 3  [no-redef]
vllm/a.py:31: note: See https://mypy.rtfd.io
Found 3 errors in 1 file (checked 1 source file)
"""


def test_new_mypy_errors_ignore_moved_lines():
    """Errors of the parent commit count as pre-existing wherever the patch
    moved them, as often as the parent has them; anything else is new."""
    out = (
        _BASE_OUT.replace(":10:", ":12:")
        .replace(":30:5:", ":33:5:")
        .replace("line 3 ", "line 4 ")
    )
    assert pr.new_mypy_errors(out, _BASE_OUT) == []
    assert len(pr.mypy_errors(out)) == 3
    extra = (
        "vllm/a.py:40: error: Incompatible types in assignment  [assignment]\n"
        "vllm/b.py:1: error: Incompatible types in assignment  [assignment]\n"
    )
    assert pr.new_mypy_errors(out + extra, _BASE_OUT) == extra.splitlines()
    assert len(pr.new_mypy_errors(out, "")) == 3  # no parent output: all new


_FAKE_HOOK = """\
import sys
from pathlib import Path

assert sys.argv[1] == "3.11", sys.argv
bad = 0
for f in sys.argv[2:]:
    for n, line in enumerate(Path(f).read_text().splitlines(), 1):
        if line.startswith("# error:"):
            print(f"{f}:{n}: error:{line[8:]}")
            bad = 1
sys.exit(bad)
"""


def test_mypy_check_fails_for_new_errors_only(tmp_path):
    """The hook runs on the branch and, when that has errors, on the parent
    commit too; the branch is checked out again afterwards."""
    repo = tmp_path / "vllm"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    old = "# error: old one  [misc]\nx = 1\n"
    _commit(repo, {"tools/pre_commit/mypy.py": _FAKE_HOOK, "vllm/a.py": old}, "base")
    git(repo, "checkout", "-q", "-b", "pr/01-x")
    _commit(repo, {"vllm/a.py": "\n" + old, "vllm/b.py": "y = 2\n"}, "moves it")
    bindir = tmp_path / "tools" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python").symlink_to(sys.executable)
    (bindir / "mypy").write_text("#!/bin/sh\necho 'mypy 1.20.2 (compiled: yes)'\n")
    (bindir / "mypy").chmod(0o755)
    tools = {
        "mypy": str(bindir / "mypy"),
        "mypy_entry": 'python tools/pre_commit/mypy.py "3.11"',
    }
    res = pr.lint_branch(repo, tools, "HEAD~1")
    r = res["mypy 1.20.2 (tools/pre_commit/mypy.py 3.11)"]
    assert r["ok"] and (r["errors"], r["preexisting"], r["new"]) == (1, 1, 0), r
    assert "pre-existing" in r["status"]
    assert git(repo, "symbolic-ref", "--short", "HEAD").strip() == "pr/01-x"
    _commit(repo, {"vllm/b.py": "# error: new one  [misc]\n"}, "adds one")
    r = pr.mypy_check(repo, tools, ["vllm/a.py", "vllm/b.py"], "HEAD~1")
    assert not r["ok"] and (r["errors"], r["preexisting"], r["new"]) == (2, 1, 1)
    assert "vllm/b.py:1: error: new one" in r["output"]
    assert git(repo, "symbolic-ref", "--short", "HEAD").strip() == "pr/01-x"


def test_placeholder_author_is_refused_on_its_own():
    """The placeholder check apart from the reserved-domain one (the
    synthetic series' author is refused by both)."""
    author = "Series Author <series@maintainers.dev>"
    p = pr.SeriesPatch(1, Path("0001-x.patch"), "x", author, "", [], [], [], "")
    with pytest.raises(ToolError, match="placeholder author"):
        pr.check_identity(author, [p])
    assert pr.check_identity(SIGNOFF, [p]) == ("Pat Maintainer", "pat@maintainers.dev")
