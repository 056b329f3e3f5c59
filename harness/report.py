"""Equivalence reports: a JSON list of cells, a markdown table, a PNG heatmap.

A cell is one configuration of the matrix. Required keys (issue 3): model,
runner, cache_mode, drafter, k, batch, graphs, async, status (ok | diverged |
rejected | error), tokens, divergences, ties; optional: chunked, preempt,
dtype, prompts, first_divergence, error, accept, wall_s, sampling, and the
drift oracle's fields (``harness.oracle``: drift_max, drift_threshold,
drift_violations, first_drift, ...). A cell is ``diverged`` when it has
divergences (argmax flips beyond ties) or drift violations (a position's
log-probabilities off the teacher-forced reference beyond the noise floor).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

REQUIRED = (
    "model",
    "runner",
    "cache_mode",
    "drafter",
    "k",
    "batch",
    "graphs",
    "async",
    "status",
    "tokens",
    "divergences",
    "ties",
)
STATUSES = ("ok", "diverged", "inconclusive", "rejected", "error")
ROW_KEYS = ("model", "runner", "cache_mode", "graphs", "async", "chunked", "preempt")
COL_KEYS = ("drafter", "k", "batch")


def validate(cell: dict) -> dict:
    missing = [k for k in REQUIRED if k not in cell]
    if missing:
        raise ValueError(f"cell lacks {missing}: {cell}")
    if cell["status"] not in STATUSES:
        raise ValueError(f"bad status {cell['status']!r}")
    drift = cell.get("drift_violations") or 0
    bad = cell["divergences"] + (drift if cell.get("drift_enforced", True) else 0)
    if cell["status"] == "diverged" and not bad:
        raise ValueError("a diverged cell must count its divergences")
    if cell["status"] == "ok" and bad:
        raise ValueError("an ok cell cannot have divergences")
    return cell


def _drift_suffix(cell: dict) -> str:
    """``, drift worst/threshold`` where the cell has the drift oracle."""
    t = drift_text(cell)
    return "" if t == "n/a" else f", drift {t}"


def drift_text(cell: dict) -> str:
    """``worst/threshold`` of the drift oracle (token logprob; top-k where
    it is the larger share of its threshold), ``n/a`` without it."""
    if not isinstance(cell.get("drift_max"), (int, float)):
        return "n/a"
    tok = f"{cell['drift_max']:.2g}/{cell['drift_threshold']:.2g}"
    if cell.get("drift_topk_max") not in (None, "inf") and cell.get(
        "drift_topk_threshold"
    ):
        top = cell["drift_topk_max"] / cell["drift_topk_threshold"]
        if top > cell["drift_max"] / max(cell["drift_threshold"], 1e-30):
            tok += f" (top-k {cell['drift_topk_max']:.2g}/"
            tok += f"{cell['drift_topk_threshold']:.2g})"
    if cell.get("drift_violations"):
        tok = f"**{tok}: {cell['drift_violations']} over**"
    if cell.get("drift_missing"):
        tok += f", {cell['drift_missing']} without logprobs"
    return tok


def _label(cell: dict, keys: Iterable[str]) -> str:
    parts = []
    for k in keys:
        v = cell.get(k)
        if v is None or v is False:
            continue
        parts.append(
            k if v is True else f"{v}" if k in ("model", "runner") else f"{k}={v}"
        )
    return " ".join(parts)


def markdown(cells: list[dict], title: str) -> str:
    head = (
        "| model | runner | cache | drafter | k | batch | graphs | async | extra "
        "| status | tokens | div | ties | drift/threshold "
        "| first divergence / error |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for c in cells:
        extra = (
            " ".join(k for k in ("chunked", "preempt") if c.get(k))
            + (f" {c['dtype']}" if c.get("dtype") else "")
            + (f" sampled:{c['sampling']}" if c.get("sampling") else "")
        )
        if c["status"] in ("rejected", "error"):
            detail = (c.get("error") or "").replace("|", "/").replace("\n", " ")[:160]
        elif c["status"] == "inconclusive":
            detail = c.get("inconclusive", "")
        elif c.get("first_divergence"):
            d = c["first_divergence"]
            margin = d.get("margin")
            detail = f"prompt {d['prompt']} pos {d['position']} margin " + (
                f"{margin:.3g}" if isinstance(margin, (int, float)) else "n/a"
            )
            if isinstance(c.get("max_margin"), (int, float)):
                detail += f"; largest {c['max_margin']:.3g}"
            if isinstance(c.get("tie_margin"), (int, float)):
                detail += f" (tie < {c['tie_margin']:.3g})"
        elif c.get("first_drift"):
            d = c["first_drift"]
            detail = (f"prompt {d['prompt']} pos {d['position']} drift "
                      f"{d['drift']} top-k {d['topk_drift']}")  # fmt: skip
        else:
            detail = ""
        rows.append(
            f"| {c['model']} | {c['runner']} | {c['cache_mode']} | {c['drafter']} "
            f"| {c['k']} | {c['batch']} | {c['graphs']} | {c['async']} "
            f"| {extra.strip()} | **{c['status']}** | {c['tokens']} "
            f"| {c['divergences']} | {c['ties']} | {drift_text(c)} | {detail} |"
        )
    counts = {s: sum(c["status"] == s for c in cells) for s in STATUSES}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return (
        f"# {title}\n\n{len(cells)} cells: {summary}\n\n"
        + head
        + "\n".join(rows)
        + "\n"
    )


def heatmap(cells: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    rows = sorted({_label(c, ROW_KEYS) for c in cells})
    cols = sorted({_label(c, COL_KEYS) for c in cells})
    code = {"ok": 0, "diverged": 1, "rejected": 2, "error": 3, "inconclusive": 4}
    grid = [[float("nan")] * len(cols) for _ in rows]
    text = [[""] * len(cols) for _ in rows]
    for c in cells:
        r, k = rows.index(_label(c, ROW_KEYS)), cols.index(_label(c, COL_KEYS))
        grid[r][k] = code[c["status"]]
        text[r][k] = (
            (str(c["divergences"]) if c["divergences"] else "drift")
            if c["status"] == "diverged"
            else c["status"][:3]
        )
    fig_w = max(6, 0.9 * len(cols) + 4)
    fig_h = max(3, 0.45 * len(rows) + 2)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    cmap = ListedColormap(["#3a9d5d", "#d64541", "#b0b0b0", "#222222", "#d4a017"])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=4, aspect="auto")
    for r in range(len(rows)):
        for k in range(len(cols)):
            if text[r][k]:
                ax.text(k, r, text[r][k], ha="center", va="center", color="white",
                        fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_title(
        title + "  (green ok, red diverged: count, grey rejected, amber inconclusive)"
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_report(cells: list[dict], outdir: Path, run: str) -> dict[str, Path]:
    for c in cells:
        validate(c)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": outdir / f"{run}.json",
        "md": outdir / f"{run}.md",
        "png": outdir / f"{run}.png",
    }
    paths["json"].write_text(json.dumps(cells, indent=1) + "\n")
    paths["md"].write_text(markdown(cells, f"Equivalence report: {run}"))
    heatmap(cells, paths["png"], run)
    return paths


# ---------------------------------------------------------------------------
# fork vs upstream side by side

SIDE_KEY = ("model", "runner", "drafter", "k", "batch", "cache_mode", "graphs",
            "async", "chunked", "preempt", "kv_cache_dtype", "sampling", "dtype",
            "request", "turns", "engine")  # fmt: skip


def side_key(cell: dict) -> tuple:
    """A cell's SIDE_KEY values, hashable (engine arguments as sorted JSON);
    fields that older reports lack read as their defaults, so that cells
    reported before a field existed keep their key."""
    defaults = {"kv_cache_dtype": "auto", "dtype": "bfloat16"}
    return tuple(
        json.dumps(v, sort_keys=True) if isinstance(v, dict) else v
        for v in (cell.get(k, defaults.get(k)) for k in SIDE_KEY)
    )


_RANK = {"ok": 3, "diverged": 3, "inconclusive": 2, "error": 1, "rejected": 0}


def base_release(cells: Iterable[dict]) -> str:
    """The release the cells ran on ("v0.33.0"), from the first ``vllm``
    version a cell records; "" where none does."""
    for c in cells:
        m = re.match(r"\d+\.\d+\.\d+", str(c.get("vllm") or ""))
        if m:
            return f"v{m[0]}"
    return ""


def side_by_side(files: Iterable[str | Path]) -> str:
    """Markdown table with one line per cell and one column per variant
    (``upstream`` if the file name says so, else ``fork``): a completed
    result (ok/diverged) wins over an error or a rejection of the same cell
    in another file; the source file is named."""
    rows: dict[tuple, dict[str, tuple[dict, str]]] = {}
    for f in files:
        name = Path(f).name
        v = "upstream" if "upstream" in name else "fork"
        for c in json.loads(Path(f).read_text()):
            key = side_key(c)
            old = rows.setdefault(key, {}).get(v)
            if old is None or _RANK[c["status"]] > _RANK[old[0]["status"]]:
                rows[key][v] = (c, name)

    def cell(x) -> str:
        if x is None:
            return "–"
        c, name = x
        s = c["status"]
        if s in ("ok", "diverged"):
            txt = f"**{s}**" if s == "diverged" else s
            return (f"{txt}: {c['divergences']} div, {c['ties']} ties / "
                    f"{c['tokens']} tok{_drift_suffix(c)} "
                    f"<sub>{name}</sub>")  # fmt: skip
        return f"{s} <sub>{name}</sub>"

    base = base_release(c for v in rows.values() for c, _ in v.values())
    lines = [
        "| " + " | ".join(SIDE_KEY) + f" | fork | upstream {base} |",
        "|" + "---|" * (len(SIDE_KEY) + 2),
    ]
    for key, v in rows.items():
        lines.append("| " + " | ".join(map(str, key)) + f" | {cell(v.get('fork'))}"
                     f" | {cell(v.get('upstream'))} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    print(side_by_side(sys.argv[1:]), end="")
