"""Compare the fork wheel with the pinned upstream wheel.

Returns a list of problems (empty when the wheel is right):
- every compiled extension (``*.so``) and the ``vllm-rs`` binary of upstream's
  wheel is in ours with identical bytes;
- every file of the package that the patch series touches has the patched
  content (deleted ones are absent), everything else is byte-identical to
  upstream except the generated ``_version.py``;
- the version is ``<upstream version>+<patch stack label>``;
- the dependency metadata equals upstream's.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from .fork import git

METADATA_KEYS = ("Requires-Dist", "Requires-Python", "Provides-Extra")
GENERATED_IN_WHEEL = {"vllm/_version.py"}


def _is_binary(name: str) -> bool:
    return name.endswith(".so") or ".so." in name or name == "vllm/vllm-rs"


def _dist_info(z: zipfile.ZipFile, leaf: str) -> str:
    names = [n for n in z.namelist() if n.endswith(f".dist-info/{leaf}")]
    if len(names) != 1:
        raise ValueError(f"{z.filename}: expected one {leaf}, found {names}")
    return z.read(names[0]).decode()


def metadata_fields(text: str) -> dict[str, list[str]]:
    fields: dict[str, list[str]] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            fields.setdefault(key, []).append(value)
    return fields


def touched_files(repo: Path, tag: str) -> tuple[set[str], set[str]]:
    """(changed or added, deleted) paths of the commits after ``tag``."""
    out = git(repo, "diff", "--name-status", "--no-renames", tag, "HEAD").stdout
    changed, deleted = set(), set()
    for line in out.splitlines():
        status, path = line.split("\t", 1)
        (deleted if status.startswith("D") else changed).add(path)
    return changed, deleted


def check_wheel(
    wheel: Path, upstream: Path, repo: Path, tag: str, version: str
) -> list[str]:
    problems: list[str] = []
    ours = zipfile.ZipFile(wheel)
    theirs = zipfile.ZipFile(upstream)
    our_names = {n for n in ours.namelist() if ".dist-info/" not in n}
    their_names = {n for n in theirs.namelist() if ".dist-info/" not in n}

    for name in sorted(n for n in their_names if _is_binary(n)):
        if name not in our_names:
            problems.append(f"compiled file missing: {name}")
        elif ours.read(name) != theirs.read(name):
            problems.append(f"compiled file differs from upstream: {name}")

    changed, deleted = touched_files(repo, tag)
    for path in sorted(changed):
        if not path.startswith("vllm/"):
            continue  # tests, docs, tooling: not part of the package
        want = git(repo, "show", f"HEAD:{path}").stdout.encode()
        if path not in our_names:
            problems.append(f"patched file missing from wheel: {path}")
        elif ours.read(path) != want:
            problems.append(f"patched file has unpatched content: {path}")
    for path in sorted(deleted):
        if path in our_names:
            problems.append(f"file deleted by the patches is in the wheel: {path}")

    untouched = (their_names - changed - deleted) - GENERATED_IN_WHEEL
    for name in sorted(untouched - our_names):
        problems.append(f"upstream file missing: {name}")
    for name in sorted(our_names - their_names - changed - GENERATED_IN_WHEEL):
        problems.append(f"file not in upstream nor in the patches: {name}")
    for name in sorted(
        (untouched & our_names) - {n for n in their_names if _is_binary(n)}
    ):
        if ours.read(name) != theirs.read(name):
            problems.append(
                f"file differs from upstream but no patch touches it: {name}"
            )

    meta = metadata_fields(_dist_info(ours, "METADATA"))
    umeta = metadata_fields(_dist_info(theirs, "METADATA"))
    if meta.get("Version") != [version]:
        problems.append(f"version {meta.get('Version')} != {version}")
    for key in METADATA_KEYS:
        if meta.get(key) != umeta.get(key):
            problems.append(f"{key} differs from upstream")
    if _dist_info(ours, "entry_points.txt") != _dist_info(theirs, "entry_points.txt"):
        problems.append("entry_points.txt differs from upstream")
    tag_line = [
        line
        for line in _dist_info(ours, "WHEEL").splitlines()
        if line.startswith("Tag:")
    ]
    if tag_line != ["Tag: cp38-abi3-linux_x86_64"]:
        problems.append(f"wheel tag {tag_line}")
    return problems
