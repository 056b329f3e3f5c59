"""The README's support table (model family × drafter), generated from the
newest whole-matrix report of a line, so that it cannot drift from the
evidence.

``python -m harness support-table [DIR] [--line v0.26.0] [--readme README.md]
[--check]`` reads the slice reports ``<slice>-<variant>.json`` in ``DIR``
(default: the newest ``reports/equivalence/<line>/full-matrix-*`` folder, by
the date in its name) through :func:`harness.full_matrix.collect` and prints
a markdown table: one row per target family (the cells' ``model``), one
column per drafter kind (the cells' ``drafter``), and in each entry the fork's
cells per runner and cache mode: how many were identical (``ok``), diverged,
errored or refused at config time (``rejected``), or ``not run`` where the
matrix has no such cell. Errors and refusals carry a footnote, the reason cut
from the cell's error text, one footnote per distinct reason. Cells at
``tensor_parallel_size`` > 1 go in a column of their own per TP size, by
drafter; one that diverged against a reference at another TP (the eager
TP=1 one) counts as "judged against TP=1", not as diverged, with a
footnote saying why: such a verdict is the base's TP difference, not
speculation's. Upstream's totals go in one line below the table.

More folders after the first (``DIR MORE...``: slices run after the whole
matrix, such as the families, tensor-parallel or sampled slices) add their
cells; a cell a later folder also ran takes the later result. The caption
names every folder.

With ``--readme``, the table replaces the region of that file between

    <!-- support-table BEGIN line=<line> dir=<report folder>[,<more>...] -->
    <!-- support-table END -->

(the marker's ``dir`` is rewritten to the folders used); with ``--check``
the file is left alone and the exit status is 1 where the region is not the
generator's output for the folders the marker names.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

from .full_matrix import collect

REPO = Path(__file__).resolve().parent.parent

# the cells' ``model`` -> a readable family name (unknown names pass through)
FAMILIES: dict[str, str] = {
    "qwen3_5": "Qwen3.5 (GDN), random weights",
    "fastapply": "Qwen3.5 fast-apply fixture, trained",
    "qwen3_5_d128": "Qwen3.5 (GDN heads of 128), random weights",
    "nemotron_h": "NemotronH (Mamba2)",
    "qwen3_next": "Qwen3-Next (GDN, MoE)",
    "granitemoehybrid": "Granite-4.0-H (Mamba2)",
    "kimi_linear": "Kimi-Linear (KDA)",
    "qwen3_5_moe": "Qwen3.5-MoE (GDN)",
    "falcon_h1": "Falcon-H1 (Mamba2)",
    "zamba2": "Zamba2 (Mamba2)",
    "mamba2": "Mamba2",
    "jamba": "Jamba (Mamba)",
    "mamba": "Mamba",
    "lfm2": "LFM2 (short conv)",
    "lfm2_moe": "LFM2-MoE (short conv)",
    "olmo_hybrid": "OLMo-hybrid (GDN)",
    "plamo2": "Plamo2 (Mamba2-style)",
    "bailing_moe_linear": "Bailing-MoE-linear (lightning attention)",
}
# the cells' ``drafter`` -> a drafter kind (``scripted:<schedule>`` -> scripted)
DRAFTERS: dict[str, str] = {
    "ngram": "n-gram",
    "ngram_gpu": "GPU n-gram",
    "suffix": "suffix decoding",
    "mtp": "MTP",
    "eagle3": "EAGLE-3",
    "eagle": "EAGLE-1",
    "dflash": "DFlash",
    "dspark": "DSpark",
    "medusa": "Medusa",
    "draft_model:dense": "draft model (attention-only)",
    "draft_model": "draft model (hybrid)",
    "scripted": "scripted drafts (test drafter)",
    # the target alone under a cell's engine (compilation, FP8): the share
    # of a drift that is not speculation's
    "none": "no drafter (control)",
}
RUNNERS: dict[str, str] = {"v1": "V1", "mrv2": "MRV2", "default": "default"}
RUNNER_TEXT = {"v1": "V1", "mrv2": "MRV2 = Model Runner V2",
               "default": "default = the line's default runner"}  # fmt: skip
CACHE_MODES = ("none", "align", "all")
# status -> word; the order in which an entry lists them
WORDS = {"ok": "identical", "diverged": "diverged",
         "inconclusive": "inconclusive", "tp1": "judged against TP=1",
         "control": "target drift (no drafter)",
         "error": "errored", "rejected": "refused"}  # fmt: skip
# statuses a total names only where a cell has them
OPTIONAL = ("inconclusive", "tp1", "control")
SUPER = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")
BEGIN = re.compile(r"<!-- support-table BEGIN line=(\S+) dir=(\S+) -->\n")
END = "<!-- support-table END -->"


def _ordered(seen: set[str], known) -> list[str]:
    """``seen`` in the order of ``known``, names it lacks after them, sorted."""
    return [k for k in known if k in seen] + sorted(seen - set(known))


def family(model: str) -> str:
    return FAMILIES.get(model, model)


def drafter_kind(drafter: str) -> str:
    return "scripted" if drafter.startswith("scripted:") else drafter


def tp_of(cell: dict) -> int:
    """A cell's tensor_parallel_size (1 where its engine takes none)."""
    return int((cell.get("engine") or {}).get("tensor_parallel_size") or 1)


def status(cell: dict) -> str:
    """A cell's status as the table counts it: a cell at TP > 1 that
    diverged against a reference at another TP (the eager TP=1 one) is
    "tp1", not "diverged": a compiled target at TP=2 differs from TP=1
    without speculation, so such a verdict is the base's, not
    speculation's (``TP1_REFERENCE``). A drafter "none" control that
    diverged by drift alone (no token differs) is "control": the target
    under the engine of the cells it controls drifts from the eager
    reference by itself (``CONTROL_DRIFT``), which the oracle then takes as
    those cells' floor; it says nothing about speculation."""
    if cell["status"] == "diverged" and tp_of(cell) > 1:
        if (cell.get("reference_tp") or 1) != tp_of(cell):
            return "tp1"
    elif (
        cell["status"] == "diverged"
        and cell.get("drafter") == "none"
        and not cell.get("divergences")
    ):
        return "control"
    return cell["status"]


# the footnote of a TP > 1 cell that diverged against the eager TP=1
# reference: cells of the tp2 slices run before their speculative cells got
# the same-TP reference, and the drafter "none" controls, which keep TP=1
# (harness.equivalence.reference_parallel)
TP1_REFERENCE = (
    "judged against the eager non-speculative target at TP=1; a compiled "
    "target at TP > 1 can differ from it without speculation (the drafter "
    '"none" cells), so this is not yet a verdict on speculation'
)


# the footnote of an inconclusive cell (harness.compare.judgeable)
INCONCLUSIVE = (
    "inconclusive: more than a quarter of its positions fall within the tie "
    "margin, which the non-speculative runs' own distance from the "
    "teacher-forced reference sets; neither identical nor diverged can be "
    "told there"
)


# the footnotes of a cell diverged by drift alone (no token differs): a
# speculative one judged without its control floor (harness.oracle; the
# oracle runs it for such cells since), and a drafter "none" control
DRIFT_ONLY = (
    "drift only: no token differs from the non-speculative reference, and "
    "one or more top-k log-probabilities are over the drift bar; judged "
    "before the oracle ran such a cell's own engine without the drafter "
    "(its control floor), which tells the target's drift under that "
    "engine from speculation's"
)
CONTROL_DRIFT = (
    "the target without a drafter under the engine of the cells it "
    "controls (compilation, FP8), against the eager reference: no token "
    "differs, and its drift is not speculation's"
)


def reason(cell: dict) -> str:
    """A one-sentence reason from a refused or failed cell's error text:
    pydantic's ``Value error, ...`` message, else the last ``XError: ...``
    line's message; cut at a dumped collection and after the first
    sentence, at most 200 characters."""
    text = str(cell.get("error") or cell.get("reason") or "").strip()
    m = re.search(r"Value error, (.*?)(?: \[type=|$)", text, re.S)
    # pydantic's other errors name the field, then say what it takes
    # (a method a line lacks: "method\n  Input should be 'ngram', ...")
    other = re.search(
        r"validation error for \w+\n(\w+)\n\s+(.*?) "
        r"\[type=\w+, input_value=('[^']*'|\S+?),",
        text,
        re.S,
    )
    if m:
        msg = m.group(1)
    elif other:
        msg = f"{other.group(1)} {other.group(3)}: {other.group(2)}"
    else:
        found = re.findall(r"^\s*[\w.]*(?:Error|Exception)\w*: (.+)$", text, re.M)
        msg = found[-1] if found else (text.splitlines() or ["no reason given"])[0]
    msg = " ".join(msg.split())
    msg = re.split(r":? [{\[]", msg, maxsplit=1)[0]
    msg = re.split(r"(?<=[.!?])\s", msg, maxsplit=1)[0].rstrip(".:")
    if len(msg) > 200:
        msg = msg[:199].rsplit(" ", 1)[0] + "…"
    return msg.replace("|", "/") or "no reason given"


def newest(line: str, root: Path = REPO) -> Path:
    """The newest whole-matrix report folder of ``line``."""
    dirs = sorted(
        (root / "reports" / "equivalence" / line).glob("full-matrix-*"),
        key=lambda p: (_date(p.name), p.name),
    )
    if not dirs:
        raise SystemExit(f"no reports/equivalence/{line}/full-matrix-* folder")
    return dirs[-1]


def _date(name: str) -> str:
    m = re.search(r"\d{4}-\d{2}-\d{2}", name)
    return m.group(0) if m else ""


def _line_of(report_dir: Path) -> str:
    for part in reversed(report_dir.resolve().parts):
        if re.fullmatch(r"v\d+\.\d+\.\d+\S*", part):
            return part
    return "?"


def _rel(path: Path, base: Path) -> str:
    return Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()


def _ran(report_dir: Path) -> set[str]:
    """The slices ``report_dir`` has a fork report of."""
    return {f.name.partition("-fork")[0] for f in report_dir.glob("*-fork*.json")}


def _wanted(report_dir: Path, also: Sequence[Path] = ()) -> dict:
    """Cell key -> (slice, cell) of every cell the folders' slices hold:
    the first folder's slices are the whole matrix's
    (``harness.full_matrix.RUNS``), a later folder's whatever slices it ran
    (as the line builds them now)."""
    from .equivalence import slice_cells
    from .full_matrix import _key, expected_cells

    ran = _ran(report_dir)
    wanted = {_key(c): (s, c) for s, c in expected_cells() if s in ran}
    for d in also:
        for s in sorted(_ran(d)):
            try:
                cells = slice_cells(s)
            except ValueError:  # not a slice of this harness
                continue
            wanted.update({_key(c.key()): (s, c.key()) for c in cells})
    return wanted


def not_run(got: dict, report_dir: Path, also: Sequence[Path] = ()) -> list:
    """(slice, cell) of each fork cell the folders' slices hold that no
    report gives a result: left by a call's deadline, or by model files
    that were not on the host (``harness.equivalence.missing_input``).
    Only the slices a folder has a fork report of count: a slice added to
    the matrix after the run was never asked for."""
    wanted = _wanted(report_dir, also)
    return [wanted[k] for k in sorted(set(wanted) - set(got["fork"]), key=str)]


def stale(got: dict, report_dir: Path, also: Sequence[Path] = ()) -> list:
    """(slice, cell) of each speculative fork cell whose newest verdict
    predates an oracle rule that judges it otherwise now, and that a slice
    still holds: diverged by drift alone before the control floor
    (``DRIFT_ONLY``), or at TP > 1 against the eager TP=1 reference
    (``TP1_REFERENCE``). Rerun, such a cell gets a verdict on
    speculation."""
    wanted = _wanted(report_dir, also)
    out = []
    for k, (c, _) in got["fork"].items():
        if k not in wanted or c["drafter"] == "none":
            continue
        if _before_control_floor(c) or status(c) == "tp1":
            out.append(wanted[k])
    return sorted(out, key=str)


def _before_control_floor(cell: dict) -> bool:
    """A cell diverged by drift alone (no token differs) that the oracle
    judged without a control floor (``DRIFT_ONLY`` for a speculative one)."""
    return (
        cell["status"] == "diverged"
        and not cell.get("divergences")
        and not any(x in cell for x in ("drift_control_floor_why",
                                        "drift_control_floor_error"))
    )  # fmt: skip


def _unstarted(got: dict, report_dir: Path, also: Sequence[Path] = ()) -> str:
    """ ", or one of the N cells ..." where the matrix's calls left fork cells
    without a result (``not_run``), else ""."""
    n = len(not_run(got, report_dir, also))
    which = "the one cell" if n == 1 else f"one of the {n} cells"
    return (f", or {which} a run left without a result (a "
            "call's deadline, or model files missing on the host)"
            if n else "")  # fmt: skip


def not_run_lines(
    report_dir: Path, line: str, also: Sequence[Path] = (), with_stale: bool = False
) -> list:
    """One JSON line per fork cell ``not_run`` finds, with its slice: what a
    GPU run still owes the table (``--not-run``); with ``with_stale``, then
    the cells ``stale`` finds too, with a "why" field (``--owed``)."""
    import json

    from . import compat

    more = [Path(d) for d in also]
    with mock.patch.dict(os.environ, {compat.VERSION_ENV: line}):
        got, _ = gather(report_dir, more)
        cells = [(s, c, None) for s, c in not_run(got, report_dir, more)]
        if with_stale:
            cells += [(s, c, "stale") for s, c in stale(got, report_dir, more)]
    return [
        json.dumps({"slice": s, **c, **({"why": why} if why else {})})
        for s, c, why in cells
    ]


def _slice_keys(name: str) -> set | None:
    """The cell keys slice ``name`` holds now; None if no slice has that
    name."""
    from .equivalence import slice_cells
    from .full_matrix import _key

    try:
        return {_key(c.key()) for c in slice_cells(name)}
    except ValueError:  # not a slice of this harness
        return None


def retire(got: dict) -> int:
    """Drop the errored and refused cells that their slice no longer holds
    (the slice was redefined after they ran, e.g. its model changed so that
    a kernel accepts it, or its KV pool changed so that the engine starts);
    return how many. A cell that ran to a verdict on its tokens is never
    dropped: a divergence stays in the table until the same cell passes."""
    keys: dict[str, set | None] = {}
    n = 0
    for variant, cells in got.items():
        for key, (c, fname) in list(cells.items()):
            if c.get("status") not in ("error", "rejected"):
                continue
            name = re.split(r"-(?:fork|upstream)", fname)[0]
            if name not in keys:
                keys[name] = _slice_keys(name)
            if keys[name] is not None and key not in keys[name]:
                del cells[key]
                n += variant == "fork"
    return n


def gather(report_dir: Path, also: Sequence[Path] = ()) -> tuple[dict, int]:
    """``harness.full_matrix.collect`` of ``report_dir`` and then of each
    folder of ``also`` in turn: a cell a later folder also ran takes its
    result there. Errored and refused cells their slice no longer holds are
    dropped (``retire``); returns the cells and how many fork cells were
    dropped."""
    got = collect(Path(report_dir))
    for d in also:
        for variant, cells in collect(Path(d)).items():
            got[variant].update(cells)
    return got, retire(got)


def table(
    report_dir: Path,
    line: str | None = None,
    base: Path | None = None,
    also: Sequence[Path] = (),
) -> str:
    """The support table of the reports in ``report_dir`` and the folders of
    ``also`` (markdown, ending in a newline); links are relative to ``base``
    (default: the repo). The slices are read as the harness builds them for
    ``line`` (``harness.compat``), whatever vLLM this process has."""
    report_dir = Path(report_dir)
    line = line or _line_of(report_dir)
    from . import compat

    with mock.patch.dict(os.environ, {compat.VERSION_ENV: line}):
        return _table(report_dir, line, base, also)


def _table(report_dir: Path, line: str, base: Path | None, also: Sequence[Path]) -> str:
    also = [Path(d) for d in also]
    base = REPO if base is None else Path(base)
    got, retired = gather(report_dir, also)
    fork = [c for c, _ in got["fork"].values()]
    upstream = [c for c, _ in got["upstream"].values()]
    if not fork:
        raise SystemExit(f"{report_dir}: no fork cells")
    models = _ordered({c["model"] for c in fork}, FAMILIES)
    # tensor-parallel cells go in a column of their own, one per TP size
    drafters = _ordered(
        {drafter_kind(c["drafter"]) for c in fork if tp_of(c) == 1}, DRAFTERS
    )
    tps = sorted({tp_of(c) for c in fork} - {1})
    runners = _ordered({c["runner"] for c in fork}, RUNNERS)
    modes = _ordered({c["cache_mode"] for c in fork}, CACHE_MODES)

    notes: dict[str, int] = {}  # reason -> footnote number, in order of use

    def mark(c: dict) -> str:
        if status(c) == "tp1":
            why = TP1_REFERENCE
        elif status(c) == "control":
            why = CONTROL_DRIFT
        elif c["status"] in ("error", "rejected"):
            why = reason(c)
        elif c["status"] == "inconclusive":
            why = INCONCLUSIVE
        elif c["status"] == "diverged" and not c.get("divergences"):
            if _before_control_floor(c):
                why = DRIFT_ONLY
            else:
                return ""
        else:
            return ""
        return str(notes.setdefault(why, len(notes) + 1)).translate(SUPER)

    def counts(cells: list[dict]) -> str:
        n = Counter((status(c), mark(c)) for c in cells)
        order = list(WORDS)
        return ", ".join(
            f"{k} {'**diverged**' if s == 'diverged' else WORDS[s]}{fn}"
            for (s, fn), k in sorted(n.items(), key=lambda x: (order.index(x[0][0]),
                                                               x[0][1]))
        )  # fmt: skip

    def entry(cells: list[dict]) -> str:
        if not cells:
            return "not run"
        parts = []
        for r in runners:
            rc = [c for c in cells if c["runner"] == r]
            name = RUNNERS.get(r, r)
            if not rc:
                parts.append(f"{name}: not run")
                continue
            per = []
            for m in modes:
                mc = [c for c in rc if c["cache_mode"] == m]
                per.append(f"{m} " + (counts(mc) if mc else "not run"))
            parts.append(f"{name}: " + "; ".join(per))
        return "<br>".join(parts)

    rows = []
    for m in models:
        mc = [c for c in fork if c["model"] == m]
        label = family(m)
        kv = {c.get("kv_cache_dtype") or "auto" for c in mc} - {"auto"}
        if kv:
            label += ", incl. " + (
                "TurboQuant KV cache"
                if all(k.startswith("turboquant") for k in kv)
                else "KV cache " + "/".join(sorted(kv))
            )
        cols = [
            entry([c for c in mc if tp_of(c) == 1 and drafter_kind(c["drafter"]) == d])
            for d in drafters
        ]
        for tp in tps:
            tc = [c for c in mc if tp_of(c) == tp]
            kinds = _ordered({drafter_kind(c["drafter"]) for c in tc}, DRAFTERS)
            cols.append(
                "<br>".join(
                    f"*{DRAFTERS.get(d, d)}*: "
                    + entry([c for c in tc if drafter_kind(c["drafter"]) == d])
                    for d in kinds
                )
                or "not run"
            )
        rows.append(f"| {label} | " + " | ".join(cols) + " |")

    def totals(cells: list[dict]) -> str:
        n = Counter(status(c) for c in cells)
        return ", ".join(f"{n[s]} {WORDS[s]}" for s in WORDS
                         if n[s] or s not in OPTIONAL)  # fmt: skip

    link = report_dir / "README.md"
    link = link if link.exists() else report_dir
    meta = ", ".join(
        x
        for x in (
            f"line {line}",
            next((g.upper() for g in re.findall(r"[a-z]\d{2,4}", report_dir.name)), ""),
            _date(report_dir.name),
        )
        if x
    )
    more = ""
    if also:
        links = []
        for d in also:
            r = d / "README.md"
            name = d.name if d.parent.name == line else f"{d.parent.name}/{d.name}"
            links.append(f"[`{name}`]({_rel(r if r.exists() else d, base)})")
        more = (
            " and the slices run after it in "
            + ", ".join(links)
            + " (a cell run again takes its newest result)"
        )
    caption = (
        f"Generated by `python -m harness support-table` from "
        f"[`{report_dir.name}`]({_rel(link, base)}) ({meta}){more}: the fork's "
        f"{len(fork)} cells ({totals(fork)}), counted per model runner ("
        + ", ".join(RUNNER_TEXT.get(r, r) for r in runners)
        + ") and mamba cache mode ("
        + " / ".join(modes)
        + ")"
        + ("; tensor-parallel cells in the TP column, by drafter" if tps else "")
        + "; refused = rejected at config time; not run = no such cell in the "
        "matrix" + _unstarted(got, report_dir, also) + "."
        + (f" Left out: {retired} errored or refused cells of slices redefined "
           "since they ran (the slice no longer holds them)."
           if retired else "")
    )  # fmt: skip
    heads = [DRAFTERS.get(d, d) for d in drafters]
    heads += [f"TP={tp} (tensor parallel), any drafter" for tp in tps]
    head = "| target | " + " | ".join(heads) + " |"
    out = [caption, "", head, "|" + "---|" * (len(heads) + 1), *rows, ""]
    if upstream:
        ups = _ordered({c["model"] for c in upstream}, FAMILIES)
        errors = [
            f"{family(m)} {n} of {len(mc)}"
            for m in ups
            for mc in [[c for c in upstream if c["model"] == m]]
            for n in [sum(c["status"] == "error" for c in mc)]
            if n
        ]
        out.append(
            f"Upstream {line} in the same matrix ({len(upstream)} cells): "
            f"{totals(upstream)}"
            + ("; errored per target: " + "; ".join(errors) if errors else "")
            + "."
        )
        out.append("")
    if notes:
        out.append(
            "Reasons of the errors and refusals, cut from the cells' error text"
            + (", and of the TP cells' verdicts:" if TP1_REFERENCE in notes else ":")
        )
        out.append("")
        out += [f"- {str(i).translate(SUPER)} {r}." for r, i in notes.items()]
        out.append("")
    return "\n".join(out)


def regions(text: str) -> list[tuple[re.Match, int]]:
    """(BEGIN marker match, index of its END marker) of each region."""
    out = []
    for m in BEGIN.finditer(text):
        end = text.find(END, m.end())
        if end < 0:
            raise SystemExit(f"support-table BEGIN line={m.group(1)} without END")
        out.append((m, end))
    return out


def marker_dirs(m: re.Match) -> list[str]:
    """The folders a BEGIN marker names (``dir=A[,B...]``), as written."""
    return m.group(2).split(",")


def _as_list(report_dir) -> list:
    return list(report_dir) if isinstance(report_dir, (list, tuple)) else [report_dir]


def rewrite(text: str, line: str, report_dir, base: Path, root: Path = REPO) -> str:
    """``text`` with the region of ``line`` rebuilt from ``report_dir`` (the
    folder its marker names where None)."""
    for m, end in regions(text):
        if m.group(1) != line:
            continue
        if report_dir is None:
            d, *also = (root / x for x in marker_dirs(m))
        else:
            d, *also = (Path(x) for x in _as_list(report_dir))
        names = ",".join(_rel(x, root) for x in (d, *also))
        marker = f"<!-- support-table BEGIN line={line} dir={names} -->\n"
        return text[: m.start()] + marker + table(d, line, base, also) + text[end:]
    raise SystemExit(f"no support-table region for line {line}")


def default_dirs(text: str, line: str, root: Path = REPO) -> list[Path]:
    """Without folders given: the line's newest whole matrix, then the
    folders of later slices ``text``'s marker names that are not older than
    it (by the date in their path)."""
    first = newest(line, root)
    later = [
        root / d
        for m, _ in regions(text)
        if m.group(1) == line
        for d in marker_dirs(m)[1:]
        if _date(d) >= _date(first.name)
    ]
    return [first, *later]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="*", help="report folder (default: the line's "
                    "newest reports/equivalence/<line>/full-matrix-*), then "
                    "folders of slices run after it")  # fmt: skip
    ap.add_argument("--line", default=None, help="vLLM line (default: from DIR, "
                    "else v0.26.0)")  # fmt: skip
    ap.add_argument("--readme", help="rewrite this file's marked region")
    ap.add_argument("--check", action="store_true", help="with --readme: exit "
                    "1 if the region (without --line: any region) is not the "
                    "generator's output for the folders its marker names; change "
                    "nothing")  # fmt: skip
    ap.add_argument("--not-run", action="store_true", help="print the fork "
                    "cells the folders (or, with --readme, its marker's) leave "
                    "without a result, one JSON line each, with its slice")  # fmt: skip
    ap.add_argument("--owed", action="store_true", help="--not-run, and the "
                    "speculative cells whose verdict predates a rule that "
                    "judges them otherwise now (\"why\": \"stale\")")  # fmt: skip
    a = ap.parse_args(argv)
    line = a.line or (_line_of(Path(a.dir[0])) if a.dir else "v0.26.0")
    if a.not_run or a.owed:
        if a.dir:
            dirs = [Path(x) for x in a.dir]
        elif a.readme:
            root = Path(a.readme).parent
            dirs = [root / x for m, _ in regions(Path(a.readme).read_text())
                    if m.group(1) == line for x in marker_dirs(m)]  # fmt: skip
        else:
            dirs = [newest(line)]
        if not dirs:
            raise SystemExit(f"no support-table region for line {line}")
        for x in not_run_lines(dirs[0], line, dirs[1:], with_stale=a.owed):
            print(x)
        return 0
    if not a.readme:
        d, *also = [Path(x) for x in a.dir] or [newest(line)]
        sys.stdout.write(table(d, line, Path.cwd(), also))
        return 0
    readme = Path(a.readme)
    old = readme.read_text()
    if a.check:
        # without --line and folders: every line's region
        lines = [line]
        if not a.line and not a.dir:
            lines = [m.group(1) for m, _ in regions(old)]
        out_of_date = 0
        for x in lines:
            new = rewrite(old, x, [Path(d) for d in a.dir] or None, readme.parent)
            if new != old:
                sys.stderr.write(f"{readme}: the support table of {x} is stale; "
                                 f"run python -m harness support-table --line {x} "
                                 f"--readme {readme}\n")  # fmt: skip
                out_of_date = 1
        return out_of_date
    dirs = [Path(x) for x in a.dir] or default_dirs(old, line)
    new = rewrite(old, line, dirs, readme.parent)
    readme.write_text(new)
    print(f"{readme}: support table of {line} from " + ", ".join(map(str, dirs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
