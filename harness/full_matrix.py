"""The whole equivalence matrix in six GPU calls, and its one summary.

``RUNS`` splits the slices of :mod:`harness.equivalence` into six groups
that each fit one 10-minute call (``harness/gpu_full_matrix.sh N`` runs group
``N`` for the fork and unpatched upstream of the bundle's line side by side,
one process per slice and variant):

1. V1 runner, random-weight fixtures (Qwen3.5: GDN, NemotronH: Mamba2):
   every scripted schedule, n-gram k=5/64, BS 64 heterogeneous, align mode
   with prefix hits, chunked prefill, preemption, CUDA graphs;
2. V1 runner, the drafters: MTP on Qwen3.5 and NemotronH (async scheduling,
   graphs, align), the trained fast-apply fixture (n-gram k=64, MTP),
   TurboQuant KV cache, and Qwen3-Next / Granite-4.0-H / Kimi-Linear;
3. Model Runner V2: the fast-apply fixture, TurboQuant, and Qwen3.5
   through its MTP head (scripted and MTP);
4. NemotronH on Model Runner V2 through its MTP head, the draft_model
   method (an attention-only draft model, and a hybrid one that the fork
   refuses), EAGLE-3 and DFlash heads on both runners, DSpark on Model
   Runner V2 and Medusa on V1 (v0.26.0; refused on v0.33.0);
5. the paths production runs: stop token ids, structured output and ``n=2``
   requests, multi-turn conversations and 6-7k-token prompts, a block-FP8
   checkpoint, per-request n-gram draft lengths, and FlashInfer's GDN
   prefill with FA3 or FlashInfer attention;
6. every other hybrid family of the line (``families``: Qwen3.5-MoE,
   Falcon-H1, Zamba2, Jamba, Mamba, Mamba2, LFM2, OLMo-hybrid, ... as the
   line ships them).

Model Runner V2's cells were one call until v0.33.0's first whole matrix: on
a cold host its 12 processes spent 200-320 s on their first cell each
(compilation and start-up at once), and the call's deadline left 41 of its
63 fork cells unstarted. Its two calls now deal every slice (9 to 14 cells
of 25-45 s each) into two processes, so that no process carries more than
7 cells, and each call runs 12 processes.

``python -m harness.full_matrix summarize DIR`` reads every report of the
six calls in ``DIR`` and writes ``FULL.md`` (one line per cell, fork and
upstream side by side; a cell a call's deadline left unstarted is listed as
``not run``) and a heatmap per variant.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from . import oracle
from .compare import judgeable

RUNS: dict[int, tuple[str, ...]] = {
    1: (
        "v1-smoke",
        "v1-chunked",
        "v1-matrix-q-state",
        "v1-matrix-n-state",
        "v1-matrix-q-preempt",
        "v1-matrix-n-preempt",
    ),
    2: (
        "v1-matrix-q-drafters",
        "v1-matrix-n-drafters",
        "fa-v1",
        "tq-v1",
        "v1-more-models",
        "drafters-tq-probe",
    ),
    3: (
        "fa-mrv2:2",
        "tq-mrv2:2",
        "mrv2-matrix-q:2",
    ),
    4: (
        "mrv2-matrix-n:2",
        "draft-model-probe:2",
        "eagle3-probe:2",
        "dflash-probe:2",
        "dspark-probe:2",
        "medusa-probe",
    ),
    5: (
        "requests:2",
        "multi-turn:2",
        "fp8",
        "draft-length",
        "flashinfer:2",
    ),
    6: ("families:4",),
}
"""Run N's entries: a slice, or ``slice:S``, a slice whose cells are dealt
into S processes (``harness.equivalence --shard i/S``), so that a call's
processes carry about the same work."""
VARIANTS = ("fork", "upstream")


def expected_cells() -> list[tuple[str, dict]]:
    """(slice, cell key) of every cell of the runs, in run order."""
    from .equivalence import slice_cells

    return [(s, c.key()) for n in sorted(RUNS) for s in map(slice_of, RUNS[n])
            for c in slice_cells(s)]  # fmt: skip


def slice_of(entry: str) -> str:
    """The slice of a RUNS entry (``slice`` or ``slice:S``)."""
    return entry.partition(":")[0]


def _key(cell: dict) -> tuple:
    from .report import side_key

    return side_key(cell)


def worst_drift(cells) -> dict | None:
    """The cell with the largest drift/threshold ratio: its ratio and key."""
    best = None
    for c in cells:
        m, t = c.get("drift_max"), c.get("drift_threshold")
        if isinstance(m, (int, float)) and isinstance(t, (int, float)) and t > 0:
            r = m / t
            if best is None or r > best["ratio"]:
                keys = ("model", "runner", "drafter", "k", "batch", "sampling")
                best = {"ratio": round(r, 3), "drift": m, "threshold": t,
                        "cell": {k: c.get(k) for k in keys}}  # fmt: skip
    return best


def collect(report_dir: Path) -> dict[str, dict[tuple, tuple[dict, str]]]:
    """variant -> cell key -> (reported cell, file name), from the slice
    reports ``<slice>-<variant>.json`` in ``report_dir``; a cell whose model
    files were missing (``harness.equivalence.missing_input``) is not run."""
    from .equivalence import missing_input

    got: dict[str, dict[tuple, tuple[dict, str]]] = {v: {} for v in VARIANTS}
    for f in sorted(report_dir.glob("*.json")):
        variant = "upstream" if "upstream" in f.name else "fork"
        for c in json.loads(f.read_text()):
            if missing_input(c):  # its model files were not there: not run
                continue
            # one drift rule for reports written before a threshold change,
            # one rule for cells whose margin takes in most positions
            c = judgeable(oracle.rejudge(c))
            got[variant].setdefault(_key(c), (c, f.name))
    return got


def _text(x: tuple[dict, str] | None) -> str:
    if x is None:
        return "not run"
    c, _ = x
    s = c["status"]
    if s in ("ok", "diverged"):
        word = "**diverged**" if s == "diverged" else "ok"
        from .report import _drift_suffix

        return (f"{word}: {c['divergences']} div, {c['ties']} ties / "
                f"{c['tokens']} tok{_drift_suffix(c)}")  # fmt: skip
    return s


def summarize(report_dir: Path, title: str | None = None) -> dict[str, Counter]:
    """Write FULL.md and full-<variant>.png into ``report_dir``; return the
    status counts per variant (``not run`` included)."""
    from .report import SIDE_KEY, base_release, heatmap

    got = collect(report_dir)
    cells = (c for v in VARIANTS for c, _ in got[v].values())
    base = base_release(cells) or "upstream"
    title = title or f"Equivalence matrix, fork vs upstream {base}"
    counts = {v: Counter() for v in VARIANTS}
    lines = [
        "| slice | " + " | ".join(SIDE_KEY) + f" | fork | upstream {base} |",
        "|" + "---|" * (len(SIDE_KEY) + 3),
    ]
    seen = set()
    for slice_name, key in expected_cells():
        k = _key(key)
        if k in seen:  # a cell two slices share is reported once
            continue
        seen.add(k)
        res = {v: got[v].get(k) for v in VARIANTS}
        for v in VARIANTS:
            counts[v][res[v][0]["status"] if res[v] else "not run"] += 1
        lines.append(
            f"| {slice_name} | " + " | ".join(map(str, k)) + " | "
            + " | ".join(_text(res[v]) for v in VARIANTS) + " |"
        )  # fmt: skip
    head = [f"# {title}", ""]
    for v in VARIANTS:
        head.append(
            f"- {v}: "
            + ", ".join(f"{n} {s}" for s, n in sorted(counts[v].items()))
            + f" (of {len(seen)} cells)"
        )
        w = worst_drift(c for c, _ in got[v].values())
        if w:
            head.append(
                f"  - worst drift: {w['drift']:.3g} nats, {w['ratio']:.2f} of its "
                f"threshold ({w['threshold']:.3g}), in {w['cell']}"
            )
    (report_dir / "FULL.md").write_text("\n".join(head + [""] + lines) + "\n")
    for v in VARIANTS:
        cells = [c for c, _ in got[v].values()]
        if cells:
            heatmap(cells, report_dir / f"full-{v}.png", f"{title}: {v}")
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("slices", help="print the slices of run N")
    p.add_argument("run", type=int, choices=sorted(RUNS))
    p = sub.add_parser("summarize", help="write FULL.md and heatmaps")
    p.add_argument("dir")
    p.add_argument("--title", default=None, help="default: names the base")
    a = ap.parse_args(argv)
    if a.cmd == "slices":
        print(" ".join(RUNS[a.run]))
    else:
        counts = summarize(Path(a.dir), a.title)
        print(json.dumps({v: dict(c) for v, c in counts.items()}))


if __name__ == "__main__":
    main()
