# SPDX-License-Identifier: Apache-2.0
"""The commit messages of the exported patch series speak to upstream.

Every ``patches/<line>/*.patch`` is a ``git format-patch`` file whose message
(the part before the first line that is exactly ``---``) is what an upstream
vLLM reviewer reads. This test fails, naming the patch and the offending line,
when a message

- uses words of our own process (see ``PROCESS_WORDS``),
- has no ``Signed-off-by:`` line, or
- has no well-formed ``Upstream-Status: <value>`` trailer (exactly one, on one
  line, in the trailer block before ``Signed-off-by:``), or a malformed
  ``Bug:`` trailer.

A line whose series is still empty (no ``*.patch`` files) passes vacuously.
``HS_PATCH_MESSAGES_ROOT`` points the test at another ``patches`` directory
(used to show that it rejects older messages). No vLLM import; runs in
milliseconds.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PATCHES = Path(os.environ.get("HS_PATCH_MESSAGES_ROOT", REPO / "patches"))

# Words and phrases that describe how *we* work (our harness, our runs, our
# device machinery), not the bug, the fix or its test. Upstream reviewers
# cannot see or reproduce any of it, so none of it belongs in a commit message.
# Each entry: (regex, why). Matched case-insensitively against the subject and
# body; mail headers and Signed-off-by lines are not checked (the author
# identity stays as it is).
PROCESS_WORDS: list[tuple[str, str]] = [
    (r"\bharness(?:es)?\b", "our equivalence harness"),
    (r"\bmatrix\b", "our test matrix"),
    (r"\bcells?\b", "cells of our matrix"),
    (r"\bGPU calls?\b|\bone call\b", "a GPU call of our device tool"),
    (r"\bleases?\b", "a device lease"),
    # "streaming-input session" is a vLLM feature (resumable requests), not ours.
    (r"(?<!streaming-input )(?<!streaming input )\bsessions?\b", "a work session"),
    (r"vllm-hybrid-spec|\bhybridspec\b", "the project's name"),
    (r"\breports/", "a path into our reports"),
    (r"\b[sp]\d{1,3}\b", "a run label such as s5 or p18"),
    (r"\brun \d+\b", "a run number"),
    (r"\bour\b", "an 'our' claim (our runs, our fork, ...)"),
    (
        r"\bwe (?:ran|run|measured|saw|observed|tested|got|found|reproduced"
        r"|benchmarked)\b",
        "a 'we' claim about our runs",
    ),
    (r"\binterleaved pairs?\b|\bpooled\b", "statistics of our benchmark runs"),
    (r"\b20\d\d-\d\d-\d\d\b", "a date"),
]
_PROCESS_RES = [(re.compile(p, re.IGNORECASE), why) for p, why in PROCESS_WORDS]

# DEP-3 style status keywords; the value may go on, e.g.
# "fixed-upstream v0.28.0 (PR #51812)" or "submitted (PR #12345)".
UPSTREAM_STATUS_KEYWORDS = (
    "not-sent",
    "not-needed",
    "pending",
    "submitted",
    "accepted",
    "backport",
    "fixed-upstream",
    "superseded",
    "denied",
    "rejected",
    "inappropriate",
)
_UPSTREAM_STATUS_RE = re.compile(r"^Upstream-Status: (\S(?:.*\S)?)$")
_BUG_RE = re.compile(r"^Bug: https://github\.com/vllm-project/vllm/issues/\d+$")
_TRAILER_RE = re.compile(r"^[A-Za-z][A-Za-z0-9-]*: \S")


def _patch_files() -> list[Path]:
    return sorted(PATCHES.glob("*/*.patch"))


def _message(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(checked lines, all message lines) of a format-patch file, 1-based.

    Checked lines: the Subject (with its folded continuation) and the body,
    without mail headers and Signed-off-by lines."""
    lines = text.splitlines()
    end = lines.index("---") if "---" in lines else len(lines)
    msg = list(enumerate(lines[:end], start=1))
    checked: list[tuple[int, str]] = []
    in_headers, in_subject = True, False
    for no, line in msg:
        if in_headers:
            if line == "":
                in_headers = False
            elif line.startswith("Subject: "):
                in_subject = True
                checked.append((no, line[len("Subject: ") :]))
            elif in_subject and line.startswith((" ", "\t")):
                checked.append((no, line))
            else:
                in_subject = False
            continue
        if line.startswith("Signed-off-by:"):
            continue
        checked.append((no, line))
    return checked, msg


def problems(path: Path) -> list[str]:
    """Everything wrong with one patch's message, one string per finding."""
    text = path.read_text(encoding="utf-8", errors="replace")
    checked, msg = _message(text)
    out: list[str] = []
    name = f"{path.parent.name}/{path.name}"
    for no, line in checked:
        for rx, why in _PROCESS_RES:
            m = rx.search(line)
            if m:
                out.append(
                    f"{name}:{no}: process word {m.group(0)!r} ({why}): {line.strip()}"
                )

    body = [(no, line) for no, line in msg]
    # The trailer block: the last paragraph of the message.
    while body and body[-1][1].strip() == "":
        body.pop()
    block: list[tuple[int, str]] = []
    for no, line in reversed(body):
        if line.strip() == "":
            break
        block.insert(0, (no, line))

    if not any(line.startswith("Signed-off-by: ") for _, line in block):
        out.append(f"{name}: no 'Signed-off-by:' line in the trailer block")

    status = [(no, line) for no, line in msg if line.startswith("Upstream-Status")]
    if not status:
        out.append(f"{name}: no 'Upstream-Status: <value>' trailer")
    elif len(status) > 1:
        out.append(f"{name}:{status[1][0]}: more than one Upstream-Status line")
    for no, line in status:
        m = _UPSTREAM_STATUS_RE.match(line)
        if not m:
            out.append(f"{name}:{no}: malformed Upstream-Status trailer: {line!r}")
            continue
        keyword = m.group(1).split()[0].lower()
        if keyword not in UPSTREAM_STATUS_KEYWORDS:
            out.append(
                f"{name}:{no}: Upstream-Status {keyword!r} is not one of "
                f"{', '.join(UPSTREAM_STATUS_KEYWORDS)}: {line!r}"
            )
        if (no, line) not in block:
            out.append(f"{name}:{no}: Upstream-Status is not in the trailer block")

    for no, line in msg:
        if line.startswith("Bug:") and not _BUG_RE.match(line):
            out.append(
                f"{name}:{no}: malformed Bug trailer (want a vllm issue URL): {line!r}"
            )

    for no, line in block:
        if not _TRAILER_RE.match(line):
            out.append(f"{name}:{no}: not a trailer in the trailer block: {line!r}")
    return out


@pytest.mark.parametrize(
    "patch", _patch_files(), ids=lambda p: f"{p.parent.name}/{p.name[:4]}"
)
def test_patch_message_speaks_to_upstream(patch: Path):
    found = problems(patch)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "patch", _patch_files(), ids=lambda p: f"{p.parent.name}/{p.name[:4]}"
)
def test_patch_author_is_who_signs_it_off(patch: Path):
    """The From: identity (a fork's local git default can leak in when a
    commit is made there) is the identity of the Signed-off-by trailer."""
    text = patch.read_text()
    head = text[: text.index("\nSubject: ")]
    author = re.search(r"^From: (.+(?:\n .+)*)$", head, re.M)
    signed = re.findall(r"^Signed-off-by: (.+)$", text, re.M)
    assert author and signed
    assert " ".join(author.group(1).split()) == signed[-1].strip(), patch.name


def test_checker_flags_process_words_and_missing_trailers(tmp_path: Path):
    """The checker itself: a bad message is caught, a good one passes."""
    good = (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: vllm-hybrid-spec developers <dev@vllm-hybrid-spec.invalid>\n"
        "Date: Sat, 21 Nov 2026 01:09:55 +0000\n"
        "Subject: [PATCH] [Bugfix] Resume streaming-input sessions\n"
        " of hybrid models\n"
        "\n"
        "What was wrong: ... Tested on an H100.\n"
        "\n"
        "Bug: https://github.com/vllm-project/vllm/issues/39273\n"
        "Upstream-Status: fixed-upstream v0.28.0 (PR #51812)\n"
        "Signed-off-by: vllm-hybrid-spec developers <dev@vllm-hybrid-spec.invalid>\n"
        "---\n"
        " a | 1 +\n"
    )
    ok = tmp_path / "v0.0.0" / "0001-good.patch"
    ok.parent.mkdir()
    ok.write_text(good)
    assert problems(ok) == []

    bad = good.replace("Tested on an H100.", "The harness matrix, session s5, passes.")
    bad = bad.replace("Upstream-Status: fixed-upstream v0.28.0 (PR #51812)\n", "")
    bad = bad.replace("Signed-off-by: vllm-hybrid-spec developers", "Acked-by: x")
    p = tmp_path / "v0.0.0" / "0002-bad.patch"
    p.write_text(bad)
    found = "\n".join(problems(p))
    for word in ("'harness'", "'matrix'", "'session'", "'s5'"):
        assert word in found
    assert "no 'Upstream-Status" in found
    assert "no 'Signed-off-by:'" in found
    assert "0002-bad.patch:7:" in found

    p.write_text(good.replace("Upstream-Status: fixed", "Upstream-Status:fixed"))
    assert any("malformed Upstream-Status" in f for f in problems(p))


def test_empty_series_passes_vacuously(tmp_path: Path):
    (tmp_path / "v9.9.9").mkdir()
    (tmp_path / "v9.9.9" / "series").write_text("")
    assert sorted(tmp_path.glob("*/*.patch")) == []
