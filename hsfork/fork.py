"""Materialize the fork as a git repo and export its commits as patches.

``sync``: extract the pinned sdist into a temporary folder, commit it as one
import commit tagged with the upstream tag, ``git am`` every patch of
``patches/series`` in order, and only then move the result to ``fork/``.

``export``: ``git format-patch`` every commit since the tag into ``patches/``
with stable names and no volatile headers, so sync followed by export is
byte-identical.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

from .common import (
    Pin,
    ToolError,
    fork_dir,
    info,
    load_pin,
    patches_dir,
    run,
)
from .fetch import fetch_file

# Files of the sdist that its own build regenerates; importing them would make
# every build dirty the tree.
GENERATED = ("vllm.egg-info", "vllm/_version.py")
# Build outputs that must never show up as changes in fork/.
EXCLUDES = (
    "/vllm.egg-info/",
    "/vllm/_version.py",
    "/build/",
    "/dist/",
    "/vllm/vllm-rs",
    "/vllm/_rust_*.so",
    "*.so",
    "__pycache__/",
    ".pytest_cache/",
)
SERIES = "series"
STAMP = "hsfork-synced"  # in fork/.git: the patch hash last synced or exported

# Fixed identity and dates keep the import commit (and so every commit on top
# of it) reproducible.
IMPORT_IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM upstream",
    "GIT_AUTHOR_EMAIL": "upstream@vllm.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "vLLM upstream",
    "GIT_COMMITTER_EMAIL": "upstream@vllm.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
# Settings that change format-patch output; pinned so that user config
# (diff.noprefix, a different abbrev, ...) cannot make export unstable.
GIT_STABLE = [
    "-c", "core.abbrev=12",
    "-c", "diff.noprefix=false",
    "-c", "diff.mnemonicPrefix=false",
    "-c", "diff.renames=true",
    "-c", "diff.algorithm=myers",
    "-c", "format.signature=",
    "-c", "core.autocrlf=false",
    "-c", "core.quotepath=true",
]  # fmt: skip


def git(repo: Path, *args: str, env: dict[str, str] | None = None, check=True):
    full_env = dict(os.environ)
    full_env.setdefault("GIT_CONFIG_NOSYSTEM", "1")
    if env:
        full_env.update(env)
    return run(["git", *GIT_STABLE, *args], cwd=repo, check=check, env=full_env)


def read_series(pdir: Path | None = None) -> list[Path]:
    pdir = pdir or patches_dir()
    series = pdir / SERIES
    if not series.exists():
        return []
    names = [
        line.strip()
        for line in series.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    missing = [n for n in names if not (pdir / n).is_file()]
    if missing:
        raise ToolError(f"{series} names missing patch files: {', '.join(missing)}")
    return [pdir / n for n in names]


def series_digest(patches: list[bytes]) -> str:
    h = hashlib.sha256()
    for p in patches:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()


def local_label(pdir: Path | None = None) -> str:
    """PEP 440 local label naming the patch stack: count and content hash."""
    patches = [p.read_bytes() for p in read_series(pdir or patches_dir())]
    return f"hybridspec.p{len(patches)}.{series_digest(patches)[:10]}"


def fork_version(pin: Pin | None = None, pdir: Path | None = None) -> str:
    pin = pin or load_pin()
    return f"{pin.version}+{local_label(pdir or patches_dir(pin))}"


# ---------------------------------------------------------------------------
# state of fork/


def is_fork(repo: Path) -> bool:
    return (repo / ".git").is_dir()


def dirty_paths(repo: Path) -> list[str]:
    out = git(repo, "status", "--porcelain", "--untracked-files=all").stdout
    return [line for line in out.splitlines() if line.strip()]


def format_patches(repo: Path, tag: str, outdir: Path) -> list[Path]:
    """format-patch every commit after ``tag`` into ``outdir``; return files."""
    outdir.mkdir(parents=True, exist_ok=True)
    out = git(
        repo,
        "format-patch",
        "--zero-commit",  # no commit sha in the From line
        "--no-numbered",  # [PATCH], not [PATCH i/n]: adding one renames none
        "--no-signature",  # no git version trailer
        "--no-cover-letter",
        "--no-binary",  # not expected; keeps the diff textual
        "--stat=80",
        "--full-index",  # no abbreviation that depends on repo size
        "--output-directory",
        str(outdir),
        f"{tag}..HEAD",
    ).stdout
    return [Path(line.strip()) for line in out.splitlines() if line.strip()]


def export_digest(repo: Path, tag: str) -> str:
    with tempfile.TemporaryDirectory(prefix="hsfork-export-") as tmp:
        files = format_patches(repo, tag, Path(tmp))
        return series_digest([f.read_bytes() for f in files])


def _stamp_path(repo: Path) -> Path:
    return repo / ".git" / STAMP


def check_fork_clean(repo: Path, tag: str) -> None:
    """Raise if fork/ holds uncommitted changes or commits not yet exported."""
    dirty = dirty_paths(repo)
    if dirty:
        shown = "\n  ".join(dirty[:20])
        more = f"\n  ... and {len(dirty) - 20} more" if len(dirty) > 20 else ""
        raise ToolError(
            f"{repo} has uncommitted changes; commit them (then `make export`) "
            f"or discard them before syncing:\n  {shown}{more}"
        )
    stamp = _stamp_path(repo)
    synced = stamp.read_text().strip() if stamp.exists() else None
    if export_digest(repo, tag) != synced:
        log = git(repo, "log", "--oneline", f"{tag}..HEAD").stdout.strip()
        raise ToolError(
            f"{repo} holds commits that were never exported to {patches_dir()}; "
            f"run `make export` first (or remove {repo} to drop them):\n"
            f"{log or '(HEAD moved off the synced commits)'}"
        )


# ---------------------------------------------------------------------------
# sync


def _extract_sdist(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        roots = {m.name.split("/", 1)[0] for m in members}
        if len(roots) != 1:
            raise ToolError(f"{sdist}: expected one top-level folder, got {roots}")
        root = roots.pop()
        for m in members:
            rel = m.name[len(root) :].lstrip("/")
            if not rel:
                continue
            m.name = rel
            tar.extract(m, dest, filter="data")


def _import_commit(repo: Path, pin: Pin, sdist_name: str) -> None:
    git(repo, "init", "-q", "-b", "main")
    exclude = repo / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("# hsfork: build outputs\n" + "\n".join(EXCLUDES) + "\n")
    git(repo, "add", "-A")
    # Upstream's .gitignore hides a few real sources of the sdist: force-add
    # everything except what a build regenerates.
    ignored = git(
        repo, "ls-files", "-z", "--others", "--ignored", "--exclude-standard"
    ).stdout.split("\0")
    keep = [
        p
        for p in ignored
        if p
        and not any(p == g or p.startswith(g + "/") for g in GENERATED)
        and not p.endswith(".so")
    ]
    if keep:
        git(repo, "add", "--force", "--", *keep)
    msg = (
        f"Import {pin.name} {pin.version} from {sdist_name}\n\n"
        f"Unmodified contents of the published sdist, except the files its\n"
        f"build regenerates: {', '.join(GENERATED)}.\n"
    )
    git(repo, "commit", "-q", "--no-verify", "-m", msg, env=IMPORT_IDENTITY)
    git(repo, "tag", pin.tag, env=IMPORT_IDENTITY)


def _apply_error(repo: Path, patch: Path, am_output: str) -> str:
    files = re.findall(r"patch failed: ([^:\n]+):\d+", am_output)
    files += re.findall(r"error: ([^:\n]+): does not exist in index", am_output)
    files += re.findall(r"error: ([^:\n]+): already exists in index", am_output)
    where = ", ".join(dict.fromkeys(files)) or "(see git's output below)"
    return (
        f"patch {patch.name} does not apply to {repo.name}/ at file(s): {where}\n"
        f"git am said:\n{am_output.strip()}"
    )


def apply_series(repo: Path, patches: list[Path]) -> None:
    for patch in patches:
        proc = git(
            repo,
            "am",
            "-q",
            "--keep-cr",
            "--keep-non-patch",  # keep "[Bugfix]"-style subject tags
            "--committer-date-is-author-date",
            str(patch),
            check=False,
            env=_committer_env(repo),
        )
        if proc.returncode != 0:
            out = (proc.stdout or "") + (proc.stderr or "")
            git(repo, "am", "--abort", check=False)
            raise ToolError(_apply_error(repo, patch, out))


def _committer_env(repo: Path) -> dict[str, str]:
    """git am needs a committer; fall back to a neutral one if none is set."""
    if git(repo, "config", "user.email", check=False).stdout.strip():
        return {}
    return {
        "GIT_COMMITTER_NAME": "hsfork",
        "GIT_COMMITTER_EMAIL": "hsfork@localhost",
    }


def sync(force: bool = False) -> Path:
    pin = load_pin()
    repo = fork_dir()
    patches = read_series()
    if repo.exists():
        if not is_fork(repo):
            raise ToolError(f"{repo} exists but is not a git repo; remove it first")
        if not force:
            check_fork_clean(repo, pin.tag)
    sdist = fetch_file(pin, pin.file("sdist"))
    repo.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{repo.name}.sync-", dir=repo.parent))
    try:
        info(f"extracting {sdist.name}")
        _extract_sdist(sdist, tmp)
        _import_commit(tmp, pin, sdist.name)
        info(f"applying {len(patches)} patch(es) from {patches_dir()}")
        apply_series(tmp, patches)
        _stamp_path(tmp).write_text(export_digest(tmp, pin.tag) + "\n")
        if repo.exists():
            shutil.rmtree(repo)
        os.replace(tmp, repo)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info(f"{repo} at {pin.tag} + {len(patches)} patch(es)")
    return repo


def has_local_work(repo: Path, tag: str) -> bool:
    try:
        check_fork_clean(repo, tag)
    except ToolError:
        return True
    return False


def ensure_synced(allow_local_work: bool) -> Path:
    """Make fork/ match patches/: sync when missing or stale.

    A fork/ with local work (uncommitted or unexported) is left alone when
    ``allow_local_work`` (tests run on what the developer is editing), and is
    an error otherwise (a wheel must be exactly a patch stack)."""
    pin = load_pin()
    repo = fork_dir()
    if not is_fork(repo):
        return sync()
    if has_local_work(repo, pin.tag):
        if not allow_local_work:
            check_fork_clean(repo, pin.tag)  # raises with the details
        info(f"warning: {repo} has local work not in {patches_dir()}; using it as is")
        return repo
    want = series_digest([p.read_bytes() for p in read_series()])
    if export_digest(repo, pin.tag) != want:
        info(f"{repo} is behind {patches_dir()}: syncing")
        return sync()
    return repo


# ---------------------------------------------------------------------------
# export


def export() -> list[Path]:
    pin = load_pin()
    repo = fork_dir()
    if not is_fork(repo):
        raise ToolError(f"{repo} is not a synced fork; run `make sync` first")
    dirty = dirty_paths(repo)
    if dirty:
        info(f"warning: {len(dirty)} uncommitted change(s) in {repo} not exported")
    pdir = patches_dir()
    pdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hsfork-export-") as tmp:
        files = format_patches(repo, pin.tag, Path(tmp))
        for old in pdir.glob("*.patch"):
            old.unlink()
        out = []
        for f in files:
            dest = pdir / f.name
            shutil.copyfile(f, dest)
            out.append(dest)
    (pdir / SERIES).write_text("".join(f"{p.name}\n" for p in out))
    _stamp_path(repo).write_text(series_digest([p.read_bytes() for p in out]) + "\n")
    info(f"exported {len(out)} patch(es) to {pdir}")
    return out
