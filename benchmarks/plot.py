"""Fork/upstream ratio table and plot from decode-latency JSONs.

    python -m benchmarks.plot IN [IN ...] --out reports/bench --run <name>

IN: JSON files of ``benchmarks.decode_latency`` or folders holding them
(searched recursively). Writes ``<out>/<run>.md`` (tables), ``<out>/<run>.json``
(the ratio rows), ``<out>/<run>.png`` (per-step latency against batch size,
both variants, per mode, and the ratio) and, with ``--copy-raw``, the input
JSONs under ``<out>/<run>/``.

A ratio is fork / upstream of the median per-step latency of full-batch
decode steps, each side averaged over its repeats; both sides come from the
same side-by-side run. Nothing here is a constant: every number is read from
the JSONs.

Its 95 % confidence interval (``ratio_ci``) is scipy's bootstrap of the
ratio of medians over the steps behind them (each side's steps of all its
repeats, resampled independently). It covers the step-to-step noise within
the run only: a shift of a whole run (another process on the host, a
warmer GPU) is not in it, which only repeats (``side_by_side --repeats``,
ABBA) or a second run show. With repeats, ``pair_rows`` adds each ABBA
pair's own ratio and each variant's run-to-run shift (the same code run
again in the lease) to the report.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from collections.abc import Iterable, Iterator
from pathlib import Path

SCHEMA = "hsfork-decode-latency/1"
# report order; decode_latency --label names other rows (sorted after these)
MODES = ("none", "ngram_nomatch", "scripted70", "mtp", "mtp_mrv2")
VARIANTS = ("fork", "upstream")
# modes with a ratio bound: issue 4 (i), (ii) on the V1 runner; issue 5's
# MTP k=3 on Model Runner V2
GATED = ("none", "ngram_nomatch", "mtp_mrv2")
THRESHOLD = 1.01


def json_docs(inputs: Iterable[str | Path]) -> Iterator[tuple[Path, object]]:
    """Every readable JSON document among ``inputs`` (files, or folders
    searched recursively), each file once."""
    seen: set[Path] = set()
    for item in inputs:
        p = Path(item)
        files = sorted(p.rglob("*.json")) if p.is_dir() else [p]
        for f in files:
            rf = f.resolve()
            if rf in seen:
                continue
            seen.add(rf)
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            yield f, doc


def load(inputs: Iterable[str | Path]) -> list[tuple[Path, dict]]:
    """The benchmark documents among ``inputs`` (files or folders)."""
    return [
        (f, doc)
        for f, doc in json_docs(inputs)
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA
    ]


def _mode_key(mode: str) -> int:
    return MODES.index(mode) if mode in MODES else len(MODES)


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def step_samples(result: dict) -> list[float]:
    """The per-step latencies (ms) a result's median is taken over: its
    full-batch decode steps, else all its decode steps
    (``decode_latency.summarize``), from its compact ``steps`` rows
    ``[ms, rows, prefill_rows, ...]``."""
    steps = result.get("steps") or []
    decode = [s for s in steps if s[2] == 0]
    full = [s for s in decode if s[1] == int(result["bs"])]
    return [float(s[0]) for s in (full or decode)]


def ratio_ci(
    fork: list[float], upstream: list[float], confidence: float = 0.95
) -> tuple[float, float] | None:
    """Bootstrap interval of median(fork) / median(upstream); None with
    fewer than 10 steps on a side."""
    if min(len(fork), len(upstream)) < 10:
        return None
    import numpy as np
    from scipy.stats import bootstrap

    def stat(a, b, axis=-1):
        return np.median(a, axis=axis) / np.median(b, axis=axis)

    res = bootstrap(
        (np.asarray(fork), np.asarray(upstream)),
        stat,
        confidence_level=confidence,
        n_resamples=4000,
        method="percentile",
        rng=np.random.default_rng(0),
    )
    ci = res.confidence_interval
    return float(ci.low), float(ci.high)


def ratio_rows(docs: Iterable[dict], threshold: float = THRESHOLD) -> list[dict]:
    """One row per (mode, BS) with both variants' numbers and the ratio."""
    cells: dict[tuple[str, int, str], list[dict]] = {}
    for doc in docs:
        for r in doc.get("results", []):
            if r.get("median_ms") is None:
                continue
            cells.setdefault((doc["mode"], int(r["bs"]), doc["variant"]), []).append(r)
    keys = sorted(
        {(m, bs) for m, bs, _ in cells}, key=lambda k: (_mode_key(k[0]), k[0], k[1])
    )
    rows = []
    for mode, bs in keys:
        row: dict = {"mode": mode, "bs": bs}
        for v in VARIANTS:
            rs = cells.get((mode, bs, v), [])
            row[v] = {
                "repeats": len(rs),
                "median_ms": _mean([r["median_ms"] for r in rs]),
                "mean_ms": _mean([r["mean_ms"] for r in rs]),
                "tokens_per_s": _mean([r.get("tokens_per_s") for r in rs]),
                "acceptance": _mean([r.get("acceptance") for r in rs]),
                "drafts_scheduled": sum(
                    int(r.get("drafts_scheduled") or 0) for r in rs
                ),
                "medians": [r["median_ms"] for r in rs],
            }
        f, u = row["fork"], row["upstream"]
        row["ratio"] = _ratio(f["median_ms"], u["median_ms"])
        row["ratio_ci95"] = ratio_ci(
            [x for r in cells.get((mode, bs, "fork"), []) for x in step_samples(r)],
            [x for r in cells.get((mode, bs, "upstream"), []) for x in step_samples(r)],
        )
        row["ratio_mean"] = _ratio(f["mean_ms"], u["mean_ms"])
        row["tokens_per_s_ratio"] = _ratio(f["tokens_per_s"], u["tokens_per_s"])
        if mode in GATED:
            if row["ratio"] is None:
                verdict = "incomplete"
            elif mode == "ngram_nomatch" and (
                f["drafts_scheduled"] or u["drafts_scheduled"]
            ):
                verdict = "invalid (ngram matched)"
            else:
                verdict = "pass" if row["ratio"] <= threshold else "FAIL"
        else:
            verdict = "report" if row["ratio"] is not None else "incomplete"
        row["verdict"] = verdict
        rows.append(row)
    return rows


def pair_rows(docs: Iterable[dict]) -> list[dict]:
    """Per (mode, BS) with at least two repeats on a side: each ABBA pair's
    own ratio (fork / upstream of the pair's medians), their median and
    range, and each variant's run-to-run shift (its slowest repeat's median
    over its fastest): the same code run again in the same lease, the
    noise a fork cost has to stand out of. The ratio column of
    ``ratio_rows`` averages the repeats first; this keeps them apart."""
    med: dict[tuple[str, int, str], dict[int, float]] = {}
    for doc in docs:
        for r in doc.get("results", []):
            if r.get("median_ms") is not None:
                key = (doc["mode"], int(r["bs"]), doc["variant"])
                med.setdefault(key, {})[int(doc.get("repeat", 0))] = r["median_ms"]
    rows = []
    for mode, bs in sorted(
        {(m, b) for m, b, _ in med}, key=lambda k: (_mode_key(k[0]), k[0], k[1])
    ):
        f, u = med.get((mode, bs, "fork"), {}), med.get((mode, bs, "upstream"), {})
        if max(len(f), len(u)) < 2:
            continue
        pairs = [f[i] / u[i] for i in sorted(set(f) & set(u)) if u[i]]
        rows.append(
            {
                "mode": mode,
                "bs": bs,
                "pair_ratios": pairs,
                "median": statistics.median(pairs) if pairs else None,
                "low": min(pairs, default=None),
                "high": max(pairs, default=None),
                "shift": {
                    v: (max(m.values()) / min(m.values()) if len(m) > 1 else None)
                    for v, m in (("fork", f), ("upstream", u))
                },
            }
        )
    return rows


def _f(x, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def _ci(ci) -> str:
    return "–" if not ci else f"{ci[0]:.3f} – {ci[1]:.3f}"


def _acc(row: dict) -> str:
    a, b = row["fork"]["acceptance"], row["upstream"]["acceptance"]
    if a is None and b is None:
        return "–"
    return f"{_f(a, '{:.1%}')} / {_f(b, '{:.1%}')}"


def markdown(docs: list[dict], rows: list[dict], run: str, threshold: float) -> str:
    lines = [f"# Decode latency, fork vs upstream v0.26.0: `{run}`", ""]
    devices = sorted({str(d.get("device")) for d in docs})
    lines.append(f"- device: {', '.join(devices)}")
    for v in VARIANTS:
        vd = [d for d in docs if d.get("variant") == v]
        if vd:
            d = vd[0]
            lines.append(
                f"- {v}: vllm {d.get('vllm_version')} from `{d.get('vllm_file')}`, "
                f"fork patches present: {d.get('fork_patches')}"
            )
    if docs:
        c = docs[0].get("config", {})
        e = c.get("engine", {})
        lines.append(
            "- engine: Qwen3.5-9B shape, dummy weights, bf16, "
            f"attention {e.get('attention_backend')}, "
            f"enforce_eager {e.get('enforce_eager')}, "
            f"compilation {e.get('compilation_config', 'default')}, "
            f"max_num_seqs {e.get('max_num_seqs')}, "
            f"max_model_len {e.get('max_model_len')}, async scheduling off"
        )
        lines.append(
            f"- per run: {c.get('tokens')} decode tokens, prompts of "
            f"{c.get('prompt_len')} distinct random tokens, "
            f"{c.get('rounds')} measured round(s) after a warm-up"
        )
        seen: set[str] = set()
        for d in sorted(docs, key=lambda d: _mode_key(d["mode"])):
            if d["mode"] in seen:
                continue
            seen.add(d["mode"])
            spec = d.get("config", {}).get("engine", {}).get("speculative_config")
            lines.append(
                f"- {d['mode']}: sampling {d.get('config', {}).get('sampling')}, "
                + (
                    f"speculative_config `{json.dumps(spec, sort_keys=True)}`"
                    if spec
                    else "no speculation"
                )
            )
        started = sorted(str(d.get("started")) for d in docs)
        if started:
            lines.append(f"- started: {started[0]} .. {started[-1]}")
    lines += [
        "",
        "ms/step: median wall time of the full-batch decode steps "
        "(`EngineCore.step` + `post_step`, prefill and mixed steps excluded); "
        "each variant averaged over its repeats. ratio = fork / upstream. "
        f"Bound for {', '.join(GATED)}: ratio <= {threshold}. 95 % CI: "
        "bootstrap of the ratio of medians over the steps (step-to-step "
        "noise within this run; a shift of a whole run is not in it).",
        "",
        "| mode | BS | fork ms/step | upstream ms/step | ratio | ratio 95 % CI "
        "| ratio (mean) | fork tok/s | upstream tok/s | tok/s ratio "
        "| acceptance fork / upstream | drafts fork / upstream | verdict |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        f, u = r["fork"], r["upstream"]
        lines.append(
            f"| {r['mode']} | {r['bs']} | {_f(f['median_ms'])} | {_f(u['median_ms'])} "
            f"| {_f(r['ratio'], '{:.4f}')} | {_ci(r.get('ratio_ci95'))} "
            f"| {_f(r['ratio_mean'], '{:.4f}')} "
            f"| {_f(f['tokens_per_s'], '{:.0f}')} | {_f(u['tokens_per_s'], '{:.0f}')} "
            f"| {_f(r['tokens_per_s_ratio'], '{:.4f}')} | {_acc(r)} "
            f"| {f['drafts_scheduled']} / {u['drafts_scheduled']} | {r['verdict']} |"
        )
    for mode in GATED:
        rs = [r for r in rows if r["mode"] == mode and r["ratio"] is not None]
        if rs:
            worst = max(rs, key=lambda r: r["ratio"])
            ok = all(r["verdict"] == "pass" for r in rs)
            lines.append("")
            lines.append(
                f"**{mode}**: largest ratio {worst['ratio']:.4f} at BS {worst['bs']}; "
                f"{'all' if ok else 'NOT all'} within {threshold}."
            )
    pairs = pair_rows(docs)
    if pairs:
        lines += [
            "",
            "## ABBA pairs",
            "",
            "Each pair's own ratio, and each variant's run-to-run shift "
            "(slowest repeat / fastest, unchanged code in the same lease). "
            "A fork cost shows as pair ratios above 1 by more than the "
            "shifts; the interval above does not include them.",
            "",
            "| mode | BS | pair ratios | median | range | fork shift "
            "| upstream shift |",
            "|---|---:|---|---:|---|---:|---:|",
        ]
        for p in pairs:
            lines.append(
                f"| {p['mode']} | {p['bs']} "
                f"| {', '.join(f'{x:.3f}' for x in p['pair_ratios']) or '–'} "
                f"| {_f(p['median'])} | {_f(p['low'])} – {_f(p['high'])} "
                f"| {_f(p['shift']['fork'])} | {_f(p['shift']['upstream'])} |"
            )
    lines += [
        "",
        "## Runs",
        "",
        "| mode | variant | repeat | status | engine start s | BS | median ms | "
        "mean ms | p10 ms | p90 ms | decode steps (full batch) | prefill steps "
        "| tok/s | acceptance | extra |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    order = sorted(
        docs,
        key=lambda d: (
            _mode_key(d["mode"]),
            d.get("repeat", 0),
            str(d.get("started")),
        ),
    )
    for d in order:
        results = d.get("results") or [{}]
        for r in results:
            extra = []
            if d["mode"] == "ngram_nomatch" and r:
                extra.append(
                    f"drafts {r.get('drafts_scheduled')} "
                    f"(warm-up {r.get('warmup_drafts_scheduled')})"
                )
            if d["mode"] == "scripted70" and r:
                props = r.get("proposer") or [{}]
                extra.append(
                    f"intended {_f(props[0].get('intended_rate'), '{:.1%}')}, "
                    f"ref passes {len(r.get('reference_iterations') or [])}, "
                    f"converged {r.get('reference_converged')}, "
                    f"diverged rows {props[0].get('diverged_rows')}, "
                    f"off-reference rows {props[0].get('mismatched_rows')}"
                )
            if d.get("skipped_batch_sizes") and r is results[-1]:
                extra.append(f"skipped BS {d['skipped_batch_sizes']}")
            if d.get("error") and r is results[-1]:
                extra.append("error: " + d["error"].splitlines()[-1][:160])
            lines.append(
                f"| {d['mode']} | {d['variant']} | {d.get('repeat', 0)} "
                f"| {d.get('status')} | {_f(d.get('engine_start_s'), '{:.0f}')} "
                f"| {r.get('bs', '–')} | {_f(r.get('median_ms'))} "
                f"| {_f(r.get('mean_ms'))} | {_f(r.get('p10_ms'))} "
                f"| {_f(r.get('p90_ms'))} | {r.get('decode_steps', '–')} "
                f"({r.get('full_batch_decode_steps', '–')}) "
                f"| {r.get('prefill_steps', '–')} "
                f"| {_f(r.get('tokens_per_s'), '{:.0f}')} "
                f"| {_f(r.get('acceptance'), '{:.1%}')} | {'; '.join(extra)} |"
            )
    return "\n".join(lines) + "\n"


def plot_png(rows: list[dict], path: Path, threshold: float = THRESHOLD) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - the table is the result; the plot is extra
        return None
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)] or sorted(
        {r["mode"] for r in rows}
    )
    if not modes:
        return None
    fig, axes = plt.subplots(
        2,
        len(modes),
        figsize=(4.6 * len(modes), 6.4),
        squeeze=False,
        gridspec_kw={"height_ratios": [2, 1]},
    )
    for j, mode in enumerate(modes):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["bs"])
        top, bottom = axes[0][j], axes[1][j]
        for v, style in zip(VARIANTS, ("o-", "s--"), strict=True):
            pts = [(r["bs"], r[v]["median_ms"]) for r in rs if r[v]["median_ms"]]
            if pts:
                top.plot(*zip(*pts, strict=True), style, label=v)
        top.set_xscale("log", base=2)
        top.set_title(mode)
        top.set_ylabel("ms / decode step (median)")
        top.grid(True, alpha=0.3)
        top.legend()
        pts = [(r["bs"], r["ratio"]) for r in rs if r["ratio"] is not None]
        if pts:
            bottom.plot(*zip(*pts, strict=True), "o-", color="black")
        bars = [r for r in rs if r["ratio"] is not None and r.get("ratio_ci95")]
        if bars:
            bottom.errorbar(
                [r["bs"] for r in bars],
                [r["ratio"] for r in bars],
                yerr=[
                    [r["ratio"] - r["ratio_ci95"][0] for r in bars],
                    [r["ratio_ci95"][1] - r["ratio"] for r in bars],
                ],
                fmt="none",
                ecolor="black",
                capsize=3,
                label="95 % CI (steps)",
            )
        if mode in GATED:
            bottom.axhline(threshold, color="red", ls=":", label=f"{threshold}")
            bottom.legend()
        bottom.axhline(1.0, color="gray", lw=0.8)
        bottom.set_xscale("log", base=2)
        bottom.set_xlabel("batch size")
        bottom.set_ylabel("fork / upstream")
        bottom.grid(True, alpha=0.3)
        for ax in (top, bottom):
            ax.set_xticks([r["bs"] for r in rs] or [1])
            ax.set_xticklabels([str(r["bs"]) for r in rs] or ["1"])
    fig.suptitle(
        "Qwen3.5-9B shape, per-step decode latency:\nfork vs upstream v0.26.0",
        fontsize="medium",
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    inputs: Iterable[str | Path],
    out: str | Path,
    run: str,
    threshold: float = THRESHOLD,
    copy_raw: bool = False,
) -> dict[str, Path]:
    found = load(inputs)
    docs = [d for _, d in found]
    rows = ratio_rows(docs, threshold)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    paths["md"] = out / f"{run}.md"
    paths["md"].write_text(markdown(docs, rows, run, threshold))
    paths["json"] = out / f"{run}.json"
    doc = {"run": run, "threshold": threshold, "rows": rows}
    pairs = pair_rows(docs)
    if pairs:
        doc["pairs"] = pairs
    paths["json"].write_text(json.dumps(doc, indent=1) + "\n")
    png = plot_png(rows, out / f"{run}.png", threshold)
    if png:
        paths["png"] = png
    if copy_raw:
        raw = out / run
        raw.mkdir(parents=True, exist_ok=True)
        for f, doc in found:
            name = f"{doc['mode']}-{doc['variant']}-r{doc.get('repeat', 0)}.json"
            if f.resolve() != (raw / name).resolve():
                shutil.copyfile(f, raw / name)
        paths["raw"] = raw
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot")
    ap.add_argument("inputs", nargs="+", help="JSON files or folders")
    ap.add_argument("--out", default="reports/bench")
    ap.add_argument("--run", required=True)
    ap.add_argument("--threshold", type=float, default=THRESHOLD)
    ap.add_argument("--copy-raw", action="store_true", help="copy JSONs to OUT/RUN/")
    a = ap.parse_args(argv)
    if not load(a.inputs):
        print("no benchmark JSON found")
        return 1
    paths = write_report(a.inputs, a.out, a.run, a.threshold, a.copy_raw)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
