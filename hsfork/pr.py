"""The upstream PR package of a line: one git branch and one description per
patch of ``patches/<tag>/series``.

``make_package`` clones the fork's import commit (the upstream release tag)
into ``build/<tag>/pr/vllm`` and writes, for every patch in series order, a
branch ``pr/<NN>-<slug>``:

- a patch that applies alone on the tag (``git apply --check``) and uses
  nothing that an earlier patch adds (a file it creates, a function or class
  it defines) branches from the tag;
- any other patch stacks on the earlier patches it needs, nearest first, until
  ``git am`` takes it.

Every commit gets the given sign-off identity as author and ``Signed-off-by``
(the series' placeholder sign-off is replaced; ``Upstream-Status:``, a
trailer of this series only, is dropped). Beside the repository lies
``<NN>-<slug>.md``: the description in the PR template of the tag's own tree
(``.github/PULL_REQUEST_TEMPLATE.md``), filled from the commit message, its
``Bug:``/``Fixes:`` trailers and ``patches/<tag>/upstream-refs.toml``.

``--check`` runs, per branch, upstream's own pre-commit checks on the changed
files (ruff and typos at the versions pinned in the tree's
``.pre-commit-config.yaml``, installed into ``build/<tag>/pr-tools``; its SPDX
header script on new files; vLLM's mypy hook with its pinned dependencies,
failing only for errors that the parent commit does not have) and the tests
the patch touches on the CPU test bed: with the change (must pass) and with
the non-test part of the change reverted (must fail). Results are recorded in
the description and cached per branch tree (and ``CHECKS_VERSION``).

Upstream main cannot be fetched here, so the branches target the release tag
and must be rebased by whoever opens the PR.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .common import (
    REPO,
    Pin,
    ToolError,
    build_dir,
    fork_dir,
    info,
    load_pin,
    patches_dir,
    venv_dir,
)
from .fork import EXCLUDES, git, is_fork, read_series

BRANCH_PREFIX = "pr/"
REFS_FILE = "upstream-refs.toml"
MANIFEST = "prs.json"
TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
# Trailers that track this series only: meaningless to upstream.
LOCAL_TRAILERS = ("Upstream-Status",)
# Trailers naming an upstream issue the patch fixes.
FIXES_TRAILERS = ("Bug", "Fixes")
ISSUE_URL_RE = re.compile(r"github\.com/vllm-project/vllm/(?:issues|pull)/(\d+)")
IDENTITY_RE = re.compile(r"^([^<>]+?) <([^<>@\s]+@[^<>\s]+)>$")
_TRAILER_RE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*): (\S.*)$")
# Labelled paragraphs of the series' messages ("What was wrong:", "How:",
# "Testing:", ...); an unlabelled paragraph continues the one before it.
_LABEL_RE = re.compile(r"^([A-Z][A-Za-z ]{0,30}?)(?: \([^)]*\))?:(?:\s|$)")
_TESTING_LABELS = ("testing", "tests", "test")
# pytest plugins of the CPU test bed (see the Makefile's test-upstream)
PYTEST_PLUGINS = ("hsfork.pytest_cpu_testbed",)


# ---------------------------------------------------------------------------
# the series


@dataclass
class SeriesPatch:
    index: int  # 1-based, in series order
    path: Path
    subject: str  # with its [Tag] prefixes, without [PATCH]
    author: str  # "Name <email>" of the From: header
    body: str  # the message between subject and trailer block
    trailers: list[tuple[str, str]]
    files: list[str]  # every path the diff touches
    added_files: list[str]  # paths the diff creates
    diff: str  # from the first "diff --git" on

    @property
    def nn(self) -> str:
        return f"{self.index:02d}"

    @property
    def slug(self) -> str:
        name = re.sub(r"^\d+-", "", self.path.stem)
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")

    @property
    def branch(self) -> str:
        return f"{BRANCH_PREFIX}{self.nn}-{self.slug}"

    @property
    def title(self) -> str:
        return self.subject

    @property
    def test_files(self) -> list[str]:
        """The test modules the patch adds or changes (upstream layout)."""
        return [
            f
            for f in self.files
            if f.startswith("tests/")
            and Path(f).name.startswith("test_")
            and f.endswith(".py")
            and self._survives(f)
        ]

    @property
    def fix_files(self) -> list[str]:
        """The non-test part of the change."""
        return [f for f in self.files if not f.startswith("tests/")]

    def _survives(self, path: str) -> bool:
        return not re.search(
            rf"^diff --git a/{re.escape(path)} b/\S+\ndeleted file mode",
            self.diff,
            re.M,
        )


def parse_patch(path: Path, index: int) -> SeriesPatch:
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    try:
        end = lines.index("---")
    except ValueError as e:
        raise ToolError(f"{path}: no '---' line after the message") from e
    head_end = lines.index("")
    headers = lines[:head_end]
    subject, author, in_subject = "", "", False
    for line in headers:
        if line.startswith("Subject: "):
            subject, in_subject = line[len("Subject: ") :], True
        elif in_subject and line.startswith((" ", "\t")):
            subject += line
        else:
            in_subject = False
            if line.startswith("From: "):
                author = line[len("From: ") :].strip()
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject).strip()
    msg = lines[head_end + 1 : end]
    while msg and not msg[-1].strip():
        msg.pop()
    # the trailer block: the last paragraph, every line a trailer
    block_start = len(msg)
    while block_start > 0 and msg[block_start - 1].strip():
        block_start -= 1
    block = msg[block_start:]
    trailers: list[tuple[str, str]] = []
    if block and all(_TRAILER_RE.match(x) for x in block):
        for x in block:
            m = _TRAILER_RE.match(x)
            assert m
            trailers.append((m.group(1), m.group(2).strip()))
        msg = msg[:block_start]
    body = "\n".join(msg).strip("\n")
    diff_at = text.find("\ndiff --git ")
    diff = text[diff_at + 1 :] if diff_at >= 0 else ""
    files: list[str] = []
    added: list[str] = []
    for m in re.finditer(r"^diff --git a/(\S+) b/(\S+)\n(new file mode)?", diff, re.M):
        for f in (m.group(1), m.group(2)):
            if f not in files:
                files.append(f)
        if m.group(3):
            added.append(m.group(2))
    return SeriesPatch(index, path, subject, author, body, trailers, files, added, diff)


def load_series(pdir: Path) -> list[SeriesPatch]:
    return [parse_patch(p, i) for i, p in enumerate(read_series(pdir), start=1)]


# ---------------------------------------------------------------------------
# sign-off


def check_identity(signoff: str | None, series: list[SeriesPatch]) -> tuple[str, str]:
    """(name, email) of ``signoff``; refuses none, a malformed one, an address
    in a reserved domain (RFC 2606) and the series' own placeholder author."""
    if not signoff or not signoff.strip():
        raise ToolError(
            "a sign-off identity is required: SIGNOFF='Name <email>' "
            "(make pr) or --signoff 'Name <email>' (the DCO sign-off of "
            "whoever opens the PRs)"
        )
    m = IDENTITY_RE.match(signoff.strip())
    if not m:
        raise ToolError(f"sign-off {signoff!r} is not of the form 'Name <email>'")
    name, email = m.group(1).strip(), m.group(2)
    domain = email.rsplit("@", 1)[1].lower()
    reserved = (".invalid", ".example", ".test", ".localhost")
    if domain.endswith(reserved) or domain in ("example.com", "example.org"):
        raise ToolError(f"sign-off {signoff!r} uses a reserved, non-deliverable domain")
    placeholders = {p.author for p in series}
    if f"{name} <{email}>" in placeholders:
        raise ToolError(
            f"sign-off {signoff!r} is the series' placeholder author; give your own"
        )
    return name, email


def _is_placeholder(identity: str, patch: SeriesPatch) -> bool:
    return identity == patch.author or bool(
        re.search(r"@[^>]*\.invalid>$", identity.strip())
    )


def commit_message(patch: SeriesPatch, identity: str) -> str:
    """The upstream commit message: subject, body, the upstream-facing
    trailers and one ``Signed-off-by: identity`` in place of the
    placeholder."""
    trailers: list[str] = []
    signed = False
    for key, value in patch.trailers:
        if key in LOCAL_TRAILERS:
            continue
        if key == "Signed-off-by" and (
            _is_placeholder(value, patch) or value == identity
        ):
            if signed:
                continue
            value, signed = identity, True
        trailers.append(f"{key}: {value}")
    if not signed:
        trailers.append(f"Signed-off-by: {identity}")
    parts = [patch.subject]
    if patch.body.strip():
        parts.append(patch.body)
    parts.append("\n".join(trailers))
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------
# dependencies


def _file_chunks(diff: str) -> dict[str, str]:
    """path (after the change) -> its part of the diff."""
    out: dict[str, str] = {}
    for chunk in re.split(r"^(?=diff --git )", diff, flags=re.M):
        m = re.match(r"diff --git a/\S+ b/(\S+)", chunk)
        if m:
            out[m.group(1)] = chunk
    return out


def _defined_names(diff: str) -> set[str]:
    added = set(re.findall(r"^\+\s*(?:async\s+)?(?:def|class)\s+(\w+)", diff, re.M))
    removed = set(re.findall(r"^-\s*(?:async\s+)?(?:def|class)\s+(\w+)", diff, re.M))
    return {n for n in added - removed if not n.startswith("__")}


def _added_words(diff: str) -> set[str]:
    words: set[str] = set()
    for line in re.findall(r"^\+(?!\+\+ ).*$", diff, re.M):
        words.update(re.findall(r"[A-Za-z_]\w*", line))
    return words


def _module_names(path: str) -> set[str]:
    if not path.endswith(".py"):
        return set()
    stem = Path(path).stem
    return {stem} if stem != "__init__" else {Path(path).parent.name}


def _importable(path: str) -> bool:
    """Whether other files can use what ``path`` defines: not a test module
    (``test_*.py``, which pytest collects and nothing imports)."""
    return not Path(path).name.startswith("test_")


def uses(later: SeriesPatch, earlier: SeriesPatch, is_new) -> list[str]:
    """Why ``later`` needs ``earlier``: files it changes that ``earlier``
    creates, modules ``earlier`` creates that it names, and functions or
    classes that ``earlier`` adds (absent from the tag: ``is_new(name)``) and
    that ``later``'s added lines use, in the same file or from an importable
    one. Empty when it needs nothing of ``earlier``."""
    why = [f"changes {f}" for f in later.files if f in earlier.added_files]
    later_chunks = _file_chunks(later.diff)
    words = _added_words(later.diff)
    for f in earlier.added_files:
        if f in later.files or not _importable(f):
            continue
        for mod in _module_names(f):
            if mod in words:
                why.append(f"imports {mod}")
    own = _defined_names(later.diff)
    for f, chunk in _file_chunks(earlier.diff).items():
        if _importable(f):
            seen = words
        elif f in later_chunks:
            seen = _added_words(later_chunks[f])
        else:
            continue
        for name in sorted((_defined_names(chunk) - own) & seen):
            if is_new(name):
                why.append(f"uses {name} ({f})")
    return list(dict.fromkeys(why))


@dataclass
class PlanEntry:
    nn: str
    branch: str
    title: str
    patch: str
    deps: list[str] = field(default_factory=list)  # NN of every patch below it
    stacks_on: list[str] = field(default_factory=list)  # NN of its direct needs
    why: dict[str, list[str]] = field(default_factory=dict)
    fixes: list[int] = field(default_factory=list)
    related: list[dict] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)
    description: str = ""
    checks: dict | None = None


# ---------------------------------------------------------------------------
# the repository


def _clone_tag(pin: Pin, repo: Path) -> None:
    """``repo``: a clone of the fork's import commit (tag ``pin.tag``), from
    fork/<tag> when it exists, else imported from the pinned sdist."""
    if repo.exists():
        shutil.rmtree(repo)
    repo.parent.mkdir(parents=True, exist_ok=True)
    src = fork_dir(pin)
    if (
        is_fork(src)
        and git(
            src, "rev-parse", "-q", "--verify", f"refs/tags/{pin.tag}", check=False
        ).returncode
        == 0
    ):
        info(f"cloning {pin.tag} of {src}")
        git(repo.parent, "clone", "-q", "--no-checkout", str(src), repo.name)
        # only the tag matters: no remote to push the fork's own commits to
        git(repo, "remote", "remove", "origin")
        git(repo, "checkout", "-q", "--detach", pin.tag)
    else:
        from .fetch import fetch_file
        from .fork import _extract_sdist, _import_commit

        sdist = fetch_file(pin, pin.file("sdist"))
        info(f"importing {sdist.name}")
        repo.mkdir()
        _extract_sdist(sdist, repo)
        _import_commit(repo, pin, sdist.name)
        git(repo, "checkout", "-q", "--detach", pin.tag)
    exclude = repo / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("# hsfork: build outputs\n" + "\n".join(EXCLUDES) + "\n")
    for b in git(
        repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/"
    ).stdout.split():
        git(repo, "branch", "-q", "-D", b, check=False)
    _link_build_outputs(pin, repo)


def _link_build_outputs(pin: Pin, repo: Path) -> None:
    """The test bed's ignored build outputs (compiled modules, _version.py)
    of fork/<tag>, linked into the clone so that its tests import the same."""
    src = fork_dir(pin) / "vllm"
    if not src.is_dir():
        return
    for f in [*src.glob("*.so"), src / "_version.py"]:
        dest = repo / "vllm" / f.name
        if f.is_file() and not dest.exists():
            dest.symlink_to(f)


def _identity_env(name: str, email: str) -> dict[str, str]:
    return {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
    }


def _am(repo: Path, patch: SeriesPatch, identity: tuple[str, str]) -> bool:
    """Commit ``patch`` on HEAD with ``identity``; False (and HEAD as it
    was) when it does not apply."""
    name, email = identity
    env = _identity_env(name, email)
    proc = git(
        repo,
        "am",
        "-q",
        "--keep-cr",
        "--keep-non-patch",
        str(patch.path),
        check=False,
        env=env,
    )
    if proc.returncode != 0:
        git(repo, "am", "--abort", check=False)
        return False
    msg = commit_message(patch, f"{name} <{email}>")
    with tempfile.NamedTemporaryFile("w", suffix=".msg", delete=False) as fh:
        fh.write(msg)
    try:
        git(
            repo,
            "commit",
            "-q",
            "--amend",
            "--no-verify",
            "--reset-author",
            "--cleanup=verbatim",
            "-F",
            fh.name,
            env=env,
        )
    finally:
        os.unlink(fh.name)
    return True


def _applies_alone(repo: Path, patch: SeriesPatch) -> bool:
    return git(repo, "apply", "--check", str(patch.path), check=False).returncode == 0


def _closure(nn: str, deps: dict[str, set[str]]) -> set[str]:
    out: set[str] = set()
    todo = list(deps[nn])
    while todo:
        d = todo.pop()
        if d not in out:
            out.add(d)
            todo.extend(deps[d])
    return out


def build_branches(
    repo: Path, tag: str, series: list[SeriesPatch], identity: tuple[str, str]
) -> list[PlanEntry]:
    """One branch per patch, stacked as its needs require (see the module
    docstring); HEAD is left detached at ``tag``."""
    by_nn = {p.nn: p for p in series}
    direct: dict[str, set[str]] = {}
    why: dict[str, dict[str, list[str]]] = {}
    new_cache: dict[str, bool] = {}

    def is_new(name: str) -> bool:
        if name not in new_cache:
            found = (
                git(
                    repo,
                    "grep",
                    "-q",
                    "-E",
                    rf"(def|class)\s+{name}\b",
                    tag,
                    "--",
                    "*.py",
                    check=False,
                ).returncode
                == 0
            )
            new_cache[name] = not found
        return new_cache[name]

    entries: list[PlanEntry] = []
    for p in series:
        earlier = [q for q in series if q.index < p.index]
        tried: dict[str, list[str]] = {}
        for q in earlier:
            reasons = uses(p, q, is_new)
            if reasons:
                tried[q.nn] = reasons
        # what else to stack on when it does not apply, nearest first: the
        # patches that touch its files, then the others
        shared = {q.nn: sorted(set(q.files) & set(p.files)) for q in earlier}
        candidates = [q.nn for q in reversed(earlier) if shared[q.nn]]
        candidates += [q.nn for q in reversed(earlier) if not shared[q.nn]]
        candidates = [c for c in candidates if c not in tried]

        def attempt(needs: dict[str, list[str]], p: SeriesPatch = p) -> bool:
            direct[p.nn] = set(needs)
            chain = sorted(_closure(p.nn, direct))
            git(repo, "checkout", "-q", "--detach", tag)
            return bool(chain or _applies_alone(repo, p)) and _make_branch(
                repo, tag, p, chain, by_nn, entries, identity
            )

        added: list[str] = []
        while not attempt(tried):
            if not candidates:
                raise ToolError(
                    f"{p.path.name} does not apply on {tag}, alone or on the "
                    "patches before it"
                )
            nxt = candidates.pop(0)
            added.append(nxt)
            tried[nxt] = (
                [f"changes {', '.join(shared[nxt])} after it"]
                if shared[nxt]
                else ["applies only on it"]
            )
        # keep only the stacking that git am needs
        if len(added) > 1:
            for d in added:
                trial = {k: v for k, v in tried.items() if k != d}
                if attempt(trial):
                    tried = trial
            if not attempt(tried):
                raise ToolError(f"{p.path.name}: stacking is not reproducible")
        # drop direct needs implied by another direct need
        implied = set().union(*(_closure(d, direct) for d in tried)) if tried else set()
        direct[p.nn] = {d for d in tried if d not in implied}
        why[p.nn] = {d: tried[d] for d in sorted(direct[p.nn])}
        entries.append(
            PlanEntry(
                nn=p.nn,
                branch=p.branch,
                title=p.title,
                patch=p.path.name,
                deps=sorted(_closure(p.nn, direct)),
                stacks_on=sorted(direct[p.nn]),
                why=why[p.nn],
                tests=p.test_files,
            )
        )
    git(repo, "checkout", "-q", "--detach", tag)
    return entries


def _make_branch(repo, tag, p, chain, by_nn, entries, identity) -> bool:
    """Branch ``p.branch``: the nearest built branch that holds part of
    ``chain`` (else the tag), the rest of ``chain`` in series order, then
    ``p``. False, with no branch left, when a patch does not apply."""
    built = {e.nn: e for e in entries}
    base, have = tag, set()
    for nn in reversed(chain):
        if nn in built and set(built[nn].deps) <= set(chain):
            base, have = built[nn].branch, set(built[nn].deps) | {nn}
            break
    git(repo, "checkout", "-q", "-B", p.branch, base)
    for nn in chain:
        if nn not in have and not _am(repo, by_nn[nn], identity):
            break
    else:
        if _am(repo, p, identity):
            return True
    git(repo, "checkout", "-q", "--detach", tag)
    git(repo, "branch", "-q", "-D", p.branch)
    return False


# ---------------------------------------------------------------------------
# descriptions


def load_refs(pdir: Path) -> tuple[str, dict[str, dict]]:
    """(as_of, subject -> {fixes, related}) of ``upstream-refs.toml``."""
    path = pdir / REFS_FILE
    if not path.exists():
        return "", {}
    data = tomllib.loads(path.read_text())
    as_of = str(data.pop("as_of", ""))
    return as_of, {k: v for k, v in data.items() if isinstance(v, dict)}


def fixes_of(patch: SeriesPatch, refs: dict) -> list[int]:
    nums: list[int] = []
    for key, value in patch.trailers:
        if key in FIXES_TRAILERS:
            m = ISSUE_URL_RE.search(value) or re.match(r"#?(\d+)$", value.strip())
            if m:
                nums.append(int(m.group(1)))
    nums += [int(n) for n in refs.get(patch.subject, {}).get("fixes", [])]
    return list(dict.fromkeys(nums))


def _paragraphs(body: str) -> list[tuple[str, str]]:
    """(label, paragraph) of a message body; an unlabelled paragraph takes
    the label of the one before it ("" at the start)."""
    out: list[tuple[str, str]] = []
    label = ""
    for para in re.split(r"\n\s*\n", body.strip()):
        if not para.strip():
            continue
        m = _LABEL_RE.match(para)
        if m:
            label = m.group(1).strip().lower()
        out.append((label, para))
    return out


def pytest_ids(patch: SeriesPatch) -> list[str]:
    """pytest node ids of the tests the patch adds: a new test module whole;
    in a changed one its new module-level test functions (``file::test_x``),
    else the whole module."""
    ids: list[str] = []
    chunks = re.split(r"^(?=diff --git )", patch.diff, flags=re.M)
    for f in patch.test_files:
        chunk = next((c for c in chunks if c.startswith(f"diff --git a/{f} ")), "")
        names = re.findall(r"^\+def (test_\w+)", chunk, re.M)
        if f in patch.added_files or not names:
            ids.append(f)
        else:
            ids.extend(f"{f}::{n}" for n in names)
    return ids


def _template_sections(text: str) -> tuple[list[str], list[tuple[str, str]], str]:
    """(comment lines before the first heading, [(heading, body)], the
    rest from the first ``---`` line after the headings)."""
    lines = text.splitlines()
    head: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    tail: list[str] = []
    for i, line in enumerate(lines):
        if line.strip() == "---" and sections:
            tail = lines[i:]
            break
        if line.startswith("## "):
            sections.append((line[3:].strip(), []))
        elif sections:
            sections[-1][1].append(line)
        elif line.strip().startswith("<!--"):
            head.append(line)
    return head, [(h, "\n".join(b)) for h, b in sections], "\n".join(tail)


def _fallback_template() -> str:
    return "## Purpose\n\n## Test Plan\n\n## Test Result\n"


def describe(
    patch: SeriesPatch,
    entry: PlanEntry,
    template: str,
    tag: str,
    as_of: str,
    refs: dict,
    by_nn: dict[str, PlanEntry],
) -> str:
    """The PR description of ``patch`` in ``template``'s sections."""
    paras = _paragraphs(patch.body)
    testing = [p for lab, p in paras if lab.split(" ")[0] in _TESTING_LABELS]
    details = [p for lab, p in paras if lab.split(" ")[0] not in _TESTING_LABELS]
    title = re.sub(r"^(\[[^\]]+\])+\s*", "", patch.subject)
    summary = [f"{title}."]
    if entry.fixes:
        summary.append("\n".join(f"Fixes #{n}" for n in entry.fixes))
    if entry.stacks_on:
        names = ", ".join(f'"{by_nn[d].title}"' for d in entry.stacks_on)
        summary.append(
            f"Depends on {names} (to be merged first): its commits sit below "
            "this one on this branch; review the last commit only."
        )
    if entry.related:
        state_note = f" (states as of {as_of}; check before merging)" if as_of else ""
        summary.append(f"Related upstream work{state_note}:")
        summary.append(
            "\n".join(
                f"- #{r['number']} ({r.get('kind', 'PR')}, {r.get('state', '?')}): "
                f"{r.get('note', '')}".rstrip(": ")
                for r in entry.related
            )
        )
    claims = [f"- {title}."]
    claims += [f"- Fixes #{n}." for n in entry.fixes]
    if entry.tests:
        claims.append(
            "- Adds or extends tests: "
            + ", ".join(f"`{t}`" for t in patch.test_files)
            + "."
        )
    ids = pytest_ids(patch)
    plan: list[str] = []
    if ids:
        plan.append("```bash\npytest " + " \\\n    ".join(ids) + "\n```")
    plan.extend(testing)
    if not plan:
        plan.append("No test is added by this change.")
    result = _result_text(entry, ids)
    content = {
        "summary": "\n\n".join(summary),
        "claims": "\n".join(claims),
        "plan": "\n\n".join(plan),
        "result": result,
        "details": "\n\n".join(details) or title,
    }
    mapping = {
        "overview": ["summary"],
        "purpose": ["summary", "details"],
        "claims": ["claims"],
        "validation": ["plan", "result"],
        "test plan": ["plan"],
        "test result": ["result"],
        "details": ["details"],
    }
    head, sections, tail = _template_sections(template)
    out = [
        *head,
        f"<!-- title: {patch.subject} -->",
        f"<!-- based on the {tag} release tag: rebase onto main before opening -->",
        "",
    ]
    for heading, body in sections:
        keys = mapping.get(heading.lower())
        out.append(f"## {heading}")
        out.append("")
        if keys:
            # a section that holds both plan and result labels them
            labels = {"plan": "**Test plan**", "result": "**Test result**"}
            both = {"plan", "result"} <= set(keys)
            text = "\n\n".join(
                (f"{labels[k]}\n\n" if both and k in labels else "") + content[k]
                for k in keys
                if content[k]
            )
            out.append(text)
        else:
            out.append(body.strip())
        out.append("")
    if tail:
        out.append(tail)
    return "\n".join(out).rstrip() + "\n"


def _result_text(entry: PlanEntry, ids: list[str]) -> str:
    c = entry.checks
    if not c:
        return (
            "Not recorded: run the test plan with this change and with its "
            "non-test part reverted, and paste both results here."
        )
    lines: list[str] = []
    t = c.get("tests") or {}
    if t.get("with_fix"):
        lines.append(
            f"- With this change: `{t['with_fix']['summary']}`"
            f" ({'pass' if t['with_fix']['ok'] else 'FAIL'})."
        )
    if t.get("without_fix"):
        lines.append(
            "- With the non-test part of the change reverted: "
            f"`{t['without_fix']['summary']}`."
        )
        lines.extend(f"  - `{x}`" for x in t["without_fix"].get("failed_ids", []))
    if t.get("with_fix", {}).get("ok") and t.get("without_fix", {}).get("failed"):
        lines.append("- The tests fail without the fix and pass with it.")
    if t.get("where"):
        lines.append(f"- Run on {t['where']}.")
    for name, r in (c.get("lint") or {}).items():
        if not r.get("skipped"):
            lines.append(f"- `{name}`: {r['status']}.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# checks (--check)


def _precommit_rev(tree: Path, repo_url_part: str) -> str | None:
    """The ``rev`` that the tree's ``.pre-commit-config.yaml`` pins for the
    hook repository whose URL contains ``repo_url_part``."""
    cfg = tree / ".pre-commit-config.yaml"
    if not cfg.exists():
        return None
    m = re.search(
        rf"repo: \S*{re.escape(repo_url_part)}\S*\s*\n\s*rev: ['\"]?v?([\w.]+)",
        cfg.read_text(),
    )
    return m.group(1) if m else None


def _install(py: Path, name: str, specs: list[str]) -> str | None:
    """pip-install ``specs`` into the venv of ``py`` unless its stamp file
    says they are there; None when that works, else why not."""
    spec = " ".join(specs)
    stamp = py.parent.parent / f".{name}-version"
    if stamp.exists() and stamp.read_text() == spec:
        return None
    info(f"installing {spec} into {py.parent.parent}")
    proc = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", *specs],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["?"])[-1]
        info(f"{spec} does not install from the index ({why})")
        return f"{spec} did not install from the index"
    stamp.write_text(spec)
    return None


def mypy_hook(config: dict) -> dict | None:
    """vLLM's mypy hook in a loaded ``.pre-commit-config.yaml``: the first
    hook whose id is ``mypy`` (v0.33.0) or ``mypy-<python>`` (v0.26.0 has
    one per Python version and runs the first, the oldest, on commit; its CI
    runs them all)."""
    for repo in config.get("repos") or []:
        for hook in repo.get("hooks") or []:
            if re.fullmatch(r"mypy(-[\d.]+)?", str(hook.get("id", ""))):
                return hook
    return None


def tools_env(tree: Path, out: Path) -> dict[str, str | None]:
    """Paths of ruff, typos and mypy at upstream's pinned versions, in a
    venv under ``out``; a value is None where it cannot be installed (the
    reason is printed and kept under ``<name>_skipped``). Each tool installs
    once (a stamp file holds what was installed).

    mypy is installed as pre-commit installs vLLM's mypy hook (see
    ``mypy_hook``): the hook's ``additional_dependencies`` (mypy pinned, stub
    packages, pydantic for the ``pydantic.mypy`` plugin of ``pyproject.toml``)
    and nothing else, so mypy resolves imports as in upstream's CI, which has
    no torch or transformers beside mypy either (``ignore_missing_imports``
    makes what is missing ``Any``). ``mypy_entry`` is the hook's ``entry``.
    The config is read with PyYAML installed into that venv too: hsfork runs
    on the system python with the standard library only, and the configs use
    YAML anchors and merge keys (v0.26.0's mypy hooks)."""
    venv = out / "pr-tools"
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    found: dict[str, str | None] = {"venv": str(venv)}
    for name, url in (
        ("ruff", "astral-sh/ruff-pre-commit"),
        ("typos", "crate-ci/typos"),
    ):
        version = _precommit_rev(tree, url)
        why = _install(py, name, [f"{name}=={version}" if version else name])
        found[name] = None if why else str(venv / "bin" / name)
        if why:
            found[f"{name}_skipped"] = why
    found["mypy"] = None
    cfg = tree / ".pre-commit-config.yaml"
    why = _install(py, "pyyaml", ["PyYAML"]) if cfg.exists() else "no " + cfg.name
    hook = None
    if not why:
        proc = subprocess.run(
            [
                str(py),
                "-c",
                "import json,sys,yaml; print(json.dumps(yaml.safe_load(sys.stdin)))",
            ],
            input=cfg.read_text(),
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            why = f"{cfg.name} does not load: {proc.stderr.strip()[-300:]}"
        else:
            hook = mypy_hook(json.loads(proc.stdout) or {})
    if hook and hook.get("entry"):
        deps = [str(d) for d in hook.get("additional_dependencies") or []]
        if not any(re.match(r"mypy\b(?![-_])", d) for d in deps):
            deps = ["mypy", *deps]
        why = _install(py, "mypy", deps)
        found["mypy_entry"] = hook["entry"]
    elif not why:
        why = f"the tree's {cfg.name} has no mypy hook"
    if why:
        found["mypy_skipped"] = why
        info(f"mypy check skipped: {why}")
    else:
        found["mypy"] = str(venv / "bin" / "mypy")
    return found


def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> tuple[int, str]:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    return proc.returncode, (proc.stdout or "") + (proc.stderr or "")


_MYPY_ERROR = re.compile(r"^([^\s:]+):\d+:(?:\d+:)? error: (.*)$", re.M)


def mypy_errors(out: str) -> list[tuple[str, str]]:
    """(file, message) of every error line of mypy's output. Line numbers are
    dropped, also inside messages ("... on line 12"): the patch moves lines."""
    return [
        (path, re.sub(r"\bline \d+", "line N", msg.strip()))
        for path, msg in _MYPY_ERROR.findall(out)
    ]


def new_mypy_errors(out: str, base_out: str) -> list[str]:
    """The error lines of ``out`` that ``base_out`` (the same hook on the
    same files at the parent commit) does not have: an error counts as
    pre-existing when the parent has an error with the same file and
    message, as often as the parent has it."""
    left: dict[tuple[str, str], int] = {}
    for key in mypy_errors(base_out):
        left[key] = left.get(key, 0) + 1
    new = []
    for m in _MYPY_ERROR.finditer(out):
        key = mypy_errors(m.group(0))[0]
        if left.get(key):
            left[key] -= 1
        else:
            new.append(m.group(0))
    return new


def mypy_check(repo: Path, tools: dict, files: list[str], base: str) -> dict:
    """vLLM's mypy hook (its ``entry``, ``python`` being the tools venv's, so
    mypy sees the hook's dependencies only, as under pre-commit) on
    ``files`` at HEAD. The check fails only for errors that the patch brings:
    when HEAD has errors, the hook runs again on the same files (those that
    exist there) at ``base``, and errors that ``base`` has too (same file,
    same message) are pre-existing (see ``new_mypy_errors``). mypy's cache
    lies in the tools venv, so the second run is incremental."""
    bindir = Path(tools["mypy"]).parent
    argv = shlex.split(tools["mypy_entry"])
    if argv and argv[0] in ("python", "python3"):
        argv[0] = str(bindir / "python")
    env = dict(os.environ)
    env["PATH"] = str(bindir) + os.pathsep + env.get("PATH", "")
    env["MYPY_CACHE_DIR"] = str(bindir.parent / "mypy-cache")
    version = " ".join(_run([tools["mypy"], "--version"], repo)[1].split()[:2])
    name = f"{version} ({' '.join(argv[1:])})"
    rc, out = _run([*argv, *files], repo, env)
    errors = mypy_errors(out)
    base_out = ""
    if errors:
        here = git(repo, "symbolic-ref", "-q", "--short", "HEAD", check=False)
        back = here.stdout.strip() or git(repo, "rev-parse", "HEAD").stdout.strip()
        git(repo, "checkout", "-q", "-f", "--detach", base)
        try:
            at_base = [f for f in files if (repo / f).exists()]
            if at_base:
                base_out = _run([*argv, *at_base], repo, env)[1]
        finally:
            git(repo, "checkout", "-q", "-f", back)
    new = new_mypy_errors(out, base_out)
    pre = len(errors) - len(new)
    if rc and not errors:
        status, ok = f"FAIL (mypy exited {rc} without error lines)", False
    elif new:
        status, ok = f"FAIL ({len(new)} new error(s), {pre} pre-existing)", False
    elif pre:
        status, ok = f"pass ({pre} pre-existing error(s), none new)", True
    else:
        status, ok = "pass", True
    output = out[-4000:]
    if new:
        output = "new errors:\n" + "\n".join(new) + "\n\nfull output:\n" + output
    return {
        "name": name,
        "status": status,
        "ok": ok,
        "errors": len(errors),
        "preexisting": pre,
        "new": len(new),
        "output": output,
    }


def lint_branch(repo: Path, tools: dict, base: str) -> dict[str, dict]:
    """Upstream's pre-commit checks on the files of the branch's last commit."""
    changed = git(
        repo, "diff", "--name-only", "--diff-filter=d", f"{base}..HEAD"
    ).stdout.split()
    added = git(
        repo, "diff", "--name-only", "--diff-filter=A", f"{base}..HEAD"
    ).stdout.split()
    py = [f for f in changed if f.endswith((".py", ".pyi"))]
    res: dict[str, dict] = {}

    def record(name: str, rc: int, out: str) -> None:
        res[name] = {
            "status": "pass" if rc == 0 else "FAIL",
            "ok": rc == 0,
            "output": out[-4000:],
        }

    ruff = tools.get("ruff")
    if ruff and py:
        version = _run([ruff, "--version"], repo)[1].strip()
        record(f"{version} check", *_run([ruff, "check", *py], repo))
        record(
            f"{version} format --check", *_run([ruff, "format", "--check", *py], repo)
        )
    spdx = repo / "tools" / "pre_commit" / "check_spdx_header.py"
    new_src = [f for f in added if f.endswith((".py", ".rs", ".proto"))]
    if spdx.exists() and new_src:
        rc, out = _run([sys.executable, str(spdx), *new_src], repo)
        record("tools/pre_commit/check_spdx_header.py", rc, out)
        if rc:  # the script adds the missing header: undo that
            git(repo, "checkout", "-q", "--", *new_src)
    typos = tools.get("typos")
    if typos and changed:
        version = _run([typos, "--version"], repo)[1].strip()
        record(
            f"{version} --force-exclude",
            *_run([typos, "--force-exclude", *changed], repo),
        )
    elif not typos:
        why = tools.get("typos_skipped") or "typos is not installed"
        res["typos"] = {
            "status": f"skipped: {why}",
            "ok": True,
            "skipped": True,
            "output": "",
        }
    if tools.get("mypy") and py:
        r = mypy_check(repo, tools, py, base)
        res[r.pop("name")] = r
    elif py:
        why = tools.get("mypy_skipped") or "mypy is not installed"
        res["mypy"] = {
            "status": f"skipped: {why}",
            "ok": True,
            "skipped": True,
            "output": "",
        }
    return res


def _pytest_summary(out: str) -> str:
    for line in reversed(out.strip().splitlines()):
        s = line.strip().strip("=").strip()
        if re.search(r"\b(passed|failed|error|errors|skipped|no tests ran)\b", s):
            return s
    return out.strip().splitlines()[-1] if out.strip() else "(no output)"


def run_tests(repo: Path, venv_python: Path, ids: list[str]) -> dict:
    """The test bed's pytest, from inside ``repo``, as `make test-upstream`
    runs the fork's tests."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(REPO / ".cache" / "hf" / "hub"),
        CUDA_VISIBLE_DEVICES="",
        TRITON_INTERPRET="1",
        VLLM_TARGET_DEVICE="empty",
        PYTHONPATH=os.pathsep.join([str(repo), str(REPO)]),
    )
    cmd = [
        str(venv_python),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        *[a for name in PYTEST_PLUGINS for a in ("-p", name)],
        "-q",
        *ids,
    ]
    rc, out = _run(cmd, repo, env)
    return {
        "rc": rc,
        "ok": rc == 0,
        "failed": rc in (1, 2),
        "summary": _pytest_summary(out),
        "failed_ids": re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M),
        "output": out[-6000:],
    }


def red_green(repo: Path, patch: SeriesPatch, venv_python: Path | None) -> dict:
    """The patch's tests with its change (must pass) and with the non-test
    part of its commit reverted (must fail)."""
    ids = pytest_ids(patch)
    if not ids:
        return {"status": "no tests added"}
    if venv_python is None or not venv_python.exists():
        return {"status": f"skipped: no CPU test bed at {venv_python}"}
    with_fix = run_tests(repo, venv_python, ids)
    res: dict = {
        "ids": ids,
        "with_fix": with_fix,
        "where": "a CPU-only machine with TRITON_INTERPRET=1",
    }
    fix_files = patch.fix_files
    if fix_files:
        diff = git(repo, "diff", "--binary", "HEAD~1", "HEAD", "--", *fix_files).stdout
        proc = subprocess.run(
            ["git", "apply", "-R"], cwd=repo, input=diff, text=True, capture_output=True
        )
        if proc.returncode != 0:
            raise ToolError(f"cannot revert the fix of {patch.branch}: {proc.stderr}")
        try:
            res["without_fix"] = run_tests(repo, venv_python, ids)
        finally:
            git(repo, "checkout", "-q", "-f", "HEAD")
            git(repo, "clean", "-q", "-f", "--", *fix_files)
    res["ok"] = with_fix["ok"] and (not fix_files or res["without_fix"]["failed"])
    return res


# ---------------------------------------------------------------------------
# the package


def out_dir(pin: Pin, out: str | Path | None = None) -> Path:
    return Path(out).resolve() if out else build_dir(pin) / "pr"


def testbed_python(pin: Pin) -> Path:
    """The interpreter of the line's CPU test bed (`make testbed`)."""
    return venv_dir(pin) / "bin" / "python"


# bumped when the checks change, so that results recorded by older checks
# (mypy skipped before 2) are not reused
CHECKS_VERSION = 2


def _cache_key(repo: Path, branch: str) -> str:
    tree = git(repo, "rev-parse", f"{branch}^{{tree}}").stdout.strip()
    return f"{tree} checks-v{CHECKS_VERSION}"


def make_package(
    signoff: str | None,
    out: str | Path | None = None,
    check: bool = False,
    pin: Pin | None = None,
    only: list[str] | None = None,
) -> list[PlanEntry]:
    """Write the branches and descriptions of the line's series; with
    ``check``, run the per-branch checks too (of the PRs numbered in
    ``only``, when given; results of earlier runs are reused while a branch's
    tree is unchanged). Returns the plan; raises
    ToolError when a check fails (after writing everything)."""
    pin = pin or load_pin()
    pdir = patches_dir(pin)
    series = load_series(pdir)
    if not series:
        raise ToolError(f"{pdir}/series is empty: no PR to make")
    identity = check_identity(signoff, series)
    dest = out_dir(pin, out)
    dest.mkdir(parents=True, exist_ok=True)
    repo = dest / "vllm"
    _clone_tag(pin, repo)
    info(f"writing {len(series)} branch(es) in {repo}")
    entries = build_branches(repo, pin.tag, series, identity)
    as_of, refs = load_refs(pdir)
    tpl_path = repo / TEMPLATE
    template = tpl_path.read_text() if tpl_path.exists() else _fallback_template()
    by_nn = {e.nn: e for e in entries}
    patches = {p.nn: p for p in series}
    cache_dir = dest / "checks"
    tools: dict = {}
    venv_python = testbed_python(pin)
    if check:
        cache_dir.mkdir(exist_ok=True)
        tools = tools_env(repo, dest.parent if out is None else dest)
    failed: list[str] = []
    for e in entries:
        p = patches[e.nn]
        e.fixes = fixes_of(p, refs)
        e.related = list(refs.get(p.subject, {}).get("related", []))
        cached = cache_dir / f"{e.nn}.json"
        key = _cache_key(repo, e.branch)
        if cached.exists():
            data = json.loads(cached.read_text())
            if data.get("key") == key:
                e.checks = data["checks"]
        if check and e.checks is None and (not only or e.nn in only):
            info(f"checking {e.branch}")
            git(repo, "checkout", "-q", "-f", e.branch)
            e.checks = {
                "lint": lint_branch(repo, tools, "HEAD~1"),
                "tests": red_green(repo, p, venv_python),
            }
            cached.write_text(json.dumps({"key": key, "checks": e.checks}, indent=1))
        if check and e.checks:
            bad = [n for n, r in e.checks["lint"].items() if not r["ok"]]
            t = e.checks["tests"]
            if "ok" in t and not t["ok"]:
                w, wo = t["with_fix"], t.get("without_fix")
                if not w["ok"]:
                    bad.append(f"tests fail with the fix ({w['summary']})")
                if wo and not wo["failed"]:
                    bad.append(f"tests pass without the fix ({wo['summary']})")
            if bad:
                failed.append(f"{e.branch}: " + "; ".join(bad))
        e.description = f"{e.nn}-{p.slug}.md"
        (dest / e.description).write_text(
            describe(p, e, template, pin.tag, as_of, refs, by_nn)
        )
    git(repo, "checkout", "-q", "-f", "--detach", pin.tag)
    manifest = {
        "tag": pin.tag,
        "series": str(pdir.relative_to(REPO) if pdir.is_relative_to(REPO) else pdir),
        "repo": str(repo),
        "prs": [asdict(e) for e in entries],
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    info(f"{len(entries)} PR(s): branches in {repo}, descriptions in {dest}")
    if failed:
        raise ToolError("checks failed:\n  " + "\n  ".join(failed))
    return entries


def _check_cell(e: dict) -> str:
    c = e.get("checks")
    if not c:
        return "not run"
    t = c.get("tests") or {}
    lint_ok = all(r["ok"] for r in c.get("lint", {}).values())
    if "with_fix" not in t:
        tests = t.get("status", "?")
    elif t.get("ok"):
        tests = "red/green" if t.get("without_fix") else "pass"
    else:
        tests = "FAIL"
    return f"lint {'ok' if lint_ok else 'FAIL'}, tests {tests}"


def table(manifest: dict) -> str:
    """The markdown table of the PRs of a manifest."""
    rows = [
        "| PR | branch | stacks on | fixes | overlaps (as of the notes) | checks |",
        "|---|---|---|---|---|---|",
    ]
    for e in manifest["prs"]:
        rows.append(
            "| {nn} {title} | `{branch}` | {stacks} | {fixes} | {related} "
            "| {checks} |".format(
                nn=e["nn"],
                title=e["title"].replace("|", "\\|"),
                branch=e["branch"],
                stacks=", ".join(e["stacks_on"]) or f"{manifest['tag']}",
                fixes=", ".join(f"#{n}" for n in e["fixes"]) or "-",
                related=", ".join(
                    f"#{r['number']} ({r.get('state', '?')})" for r in e["related"]
                )
                or "-",
                checks=_check_cell(e),
            )
        )
    return "\n".join(rows)


def list_package(out: str | Path | None = None, pin: Pin | None = None) -> str:
    pin = pin or load_pin()
    path = out_dir(pin, out) / MANIFEST
    if not path.exists():
        raise ToolError(
            f"{path} does not exist: run `make pr SIGNOFF='Name <email>'` first"
        )
    return table(json.loads(path.read_text()))
