"""Reporting for ``benchmarks.serve_bench``: vLLM's saved result JSONs and
``meta.json`` of one or more output folders merged into rows per (spec,
variant, concurrency), speedups over no speculation, fork / upstream ratios
and the BS=1 weight-read floor, written as a table (``NAME.md``), a JSON
and a plot (``NAME.png``).

    python -m benchmarks.serve_bench summary OUT [OUT ...] --out DIR --name NAME
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .weight_floor import weight_read_floor_ms

SCHEMA = "hsfork-serve-bench/1"


METRICS = (
    "output_throughput",
    "median_tpot_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "median_ttft_ms",
    "mean_ttft_ms",
    "duration",
    "completed",
    "failed",
    "total_output_tokens",
    "total_input_tokens",
    "request_throughput",
    "spec_decode_acceptance_length",
    "spec_decode_acceptance_rate",
)


def load_results(inputs) -> tuple[list[dict], dict]:
    """vLLM's saved results among ``inputs`` (files or folders, searched
    recursively; those with ``suite``/``spec``/``variant`` metadata), and
    the merged ``meta.json`` of the folders."""
    from .plot import json_docs

    runs, meta = [], {"exact_match": {}, "servers": [], "skipped": []}
    for f, doc in json_docs(inputs):
        if not isinstance(doc, dict):
            continue
        if doc.get("schema") == SCHEMA:
            for k in ("exact_match",):
                meta[k].update(doc.get(k) or {})
            for k in ("servers", "skipped"):
                meta[k] += doc.get(k) or []
            for k in ("weights", "bandwidth", "suite", "config", "meta"):
                if doc.get(k) is not None:
                    meta.setdefault(k, doc[k])
        elif (
            "output_throughput" in doc
            and "max_concurrency" in doc
            and all(doc.get(k) for k in ("suite", "spec", "variant"))
        ):
            doc["_file"] = f.name
            runs.append(doc)
    # a server skipped by one call and run by a later one is not skipped
    ran = {(s.get("spec"), s.get("variant")) for s in meta["servers"]}
    meta["skipped"] = [
        s for s in meta["skipped"] if (s.get("spec"), s.get("variant")) not in ran
    ]
    return runs, meta


def _row(doc: dict, meta: dict) -> dict:
    r = {
        "suite": doc["suite"],
        "spec": doc["spec"],
        "variant": doc["variant"],
        "conc": int(doc["max_concurrency"]),
        "num_prompts": doc.get("num_prompts"),
    }
    for k in METRICS:
        r[k] = doc.get(k)
    r["exact_match"] = meta["exact_match"].get(doc["_file"][:-5])
    return r


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def summarize_runs(runs: list[dict], meta: dict) -> dict:
    """Rows per (suite, spec, variant, concurrency) (repeats averaged),
    speedups over ``none`` (tok/s ratio and TPOT ratio, same variant and
    concurrency), fork/upstream ratios, the BS=1 weight-read floor."""
    groups: dict[tuple, list[dict]] = {}
    for doc in runs:
        r = _row(doc, meta)
        groups.setdefault((r["suite"], r["spec"], r["variant"], r["conc"]), []).append(
            r
        )
    rows = []
    for _key, rs in sorted(groups.items(), key=lambda kv: _order(kv[0])):
        row = dict(rs[0])
        row["repeats"] = len(rs)
        for k in METRICS + ("exact_match",):
            vals = [x[k] for x in rs if isinstance(x[k], (int, float))]
            row[k] = sum(vals) / len(vals) if vals else None
        rows.append(row)
    idx = {(r["suite"], r["spec"], r["variant"], r["conc"]): r for r in rows}
    speedups = []
    for r in rows:
        if r["spec"] == "none":
            continue
        base = idx.get((r["suite"], "none", r["variant"], r["conc"]))
        if not base:
            continue
        speedups.append(
            {
                "suite": r["suite"],
                "spec": r["spec"],
                "variant": r["variant"],
                "conc": r["conc"],
                "tput_speedup": _ratio(
                    r["output_throughput"], base["output_throughput"]
                ),
                "tpot_speedup": _ratio(base["median_tpot_ms"], r["median_tpot_ms"]),
                "exact_match": r["exact_match"],
                "acceptance_length": r["spec_decode_acceptance_length"],
            }
        )
    ratios = []
    for r in rows:
        if r["variant"] != "fork":
            continue
        up = idx.get((r["suite"], r["spec"], "upstream", r["conc"]))
        if not up:
            continue
        ratios.append(
            {
                "suite": r["suite"],
                "spec": r["spec"],
                "conc": r["conc"],
                "tput_ratio": _ratio(r["output_throughput"], up["output_throughput"]),
                "tpot_ratio": _ratio(r["median_tpot_ms"], up["median_tpot_ms"]),
                "mean_tpot_ratio": _ratio(r["mean_tpot_ms"], up["mean_tpot_ms"]),
            }
        )
    floor = None
    w, bw = meta.get("weights"), meta.get("bandwidth")
    if w and bw and bw.get("copy_gbps"):
        f_ms = weight_read_floor_ms(w["decode_bytes"], bw["copy_gbps"])
        floor = {
            "decode_bytes": w["decode_bytes"],
            "copy_gbps": bw["copy_gbps"],
            "floor_ms": f_ms,
            "device": bw.get("device"),
            "bs1": {},
        }
        for r in rows:
            if r["spec"] == "none" and r["conc"] == 1 and r["median_tpot_ms"]:
                floor["bs1"][r["variant"]] = {
                    "median_tpot_ms": r["median_tpot_ms"],
                    "over_floor": r["median_tpot_ms"] / f_ms,
                    "floor_share": f_ms / r["median_tpot_ms"],
                }
    return {
        "schema": SCHEMA + "-summary",
        "rows": rows,
        "speedups": speedups,
        "fork_over_upstream": ratios,
        "weight_read_floor": floor,
        "weights": w,
        "bandwidth": bw,
        "servers": [
            {
                k: s.get(k)
                for k in (
                    "name",
                    "status",
                    "ready_s",
                    "client_s",
                    "total_s",
                    "version",
                    "exit_code",
                )
            }
            for s in meta.get("servers", [])
        ],
        "skipped": meta.get("skipped", []),
        "meta": meta.get("meta"),
        "config": meta.get("config"),
    }


SPEC_ORDER = ("none", "ngram", "ngram8", "mtp", "mtp1")


VARIANT_ORDER = ("fork", "upstream")


def _order(key):
    suite, spec, variant, conc = key
    s = SPEC_ORDER.index(spec) if spec in SPEC_ORDER else len(SPEC_ORDER)
    v = VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else 9
    return (suite, s, spec, v, variant, conc)


def _f(x, fmt="{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(summary: dict, title: str) -> str:
    lines = [f"# {title}", ""]
    cfg = summary.get("config") or {}
    if cfg:
        lines += [
            f"`vllm bench serve` (fork's client), {cfg.get('dataset')} prompts, "
            f"concurrency {cfg.get('concurrency')}, prompts per run "
            f"{cfg.get('prompts')}, greedy; one server at a time, fork and "
            "upstream interleaved. TPOT: (latency - TTFT) / (output tokens - 1) "
            "per request, median over requests.",
            "",
        ]
    lines += [
        "| spec | variant | conc | prompts | out tok/s | TPOT med ms | TPOT mean "
        "ms | TPOT p99 ms | ITL med ms | TTFT med ms | accept len | exact | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['spec']} | {r['variant']} | {r['conc']} | {r['num_prompts']} "
            f"| {_f(r['output_throughput'], '{:.1f}')} "
            f"| {_f(r['median_tpot_ms'], '{:.3f}')} "
            f"| {_f(r['mean_tpot_ms'], '{:.3f}')} | {_f(r['p99_tpot_ms'], '{:.3f}')} "
            f"| {_f(r['median_itl_ms'], '{:.3f}')} "
            f"| {_f(r['median_ttft_ms'], '{:.1f}')} "
            f"| {_f(r['spec_decode_acceptance_length'])} "
            f"| {_f(r['exact_match'], '{:.3f}')} | {_f(r['failed'], '{:.0f}')} |"
        )
    lines.append("")
    if summary["speedups"]:
        lines += [
            "## Speculation over no speculation (same variant, same concurrency)",
            "",
            "tok/s: output tokens/s ratio; TPOT: no-spec TPOT / spec TPOT.",
            "",
            "| spec | variant | conc | tok/s speedup | TPOT speedup | accept len "
            "| exact |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for s in summary["speedups"]:
            lines.append(
                f"| {s['spec']} | {s['variant']} | {s['conc']} "
                f"| {_f(s['tput_speedup'], '{:.2f}x')} "
                f"| {_f(s['tpot_speedup'], '{:.2f}x')} "
                f"| {_f(s['acceptance_length'])} "
                f"| {_f(s['exact_match'], '{:.3f}')} |"
            )
        lines.append("")
    if summary["fork_over_upstream"]:
        lines += [
            "## Fork / upstream",
            "",
            "| spec | conc | tok/s ratio | TPOT ratio (median) | TPOT ratio (mean) |",
            "|---|---:|---:|---:|---:|",
        ]
        for q in summary["fork_over_upstream"]:
            lines.append(
                f"| {q['spec']} | {q['conc']} | {_f(q['tput_ratio'], '{:.3f}')} "
                f"| {_f(q['tpot_ratio'], '{:.3f}')} "
                f"| {_f(q['mean_tpot_ratio'], '{:.3f}')} |"
            )
        lines.append("")
    fl = summary.get("weight_read_floor")
    if fl:
        lines += [
            "## BS=1 step time against the weight-read floor",
            "",
            f"Weights a decode step reads: {fl['decode_bytes'] / 1e9:.3f} GB; "
            f"device copy bandwidth {fl['copy_gbps']:.0f} GB/s ({fl['device']}); "
            f"floor {fl['floor_ms']:.3f} ms per step.",
            "",
            "| variant | TPOT med ms (BS 1) | / floor | floor share |",
            "|---|---:|---:|---:|",
        ]
        for v, b in fl["bs1"].items():
            lines.append(
                f"| {v} | {b['median_tpot_ms']:.3f} | {b['over_floor']:.2f}x "
                f"| {b['floor_share']:.1%} |"
            )
        lines.append("")
    if summary.get("servers"):
        lines += [
            "## Servers",
            "",
            "| server | status | ready s | client s | total s | exit |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for s in summary["servers"]:
            lines.append(
                f"| {s['name']} | {s['status']} | {_f(s['ready_s'], '{:.0f}')} "
                f"| {_f(s['client_s'], '{:.0f}')} | {_f(s['total_s'], '{:.0f}')} "
                f"| {s['exit_code']} |"
            )
        lines.append("")
    if summary.get("skipped"):
        lines.append(
            "Skipped for lack of time: "
            + ", ".join(f"{s['spec']}/{s['variant']}" for s in summary["skipped"])
            + "."
        )
        lines.append("")
    return "\n".join(lines)


def plot_png(summary: dict, path: Path, title: str) -> Path | None:
    """Output tok/s and median TPOT against concurrency, every (spec,
    variant), plus speedups over no speculation (or fork/upstream)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - the table is the result; the plot is extra
        return None
    rows = summary["rows"]
    if not rows:
        return None
    specs = sorted({r["spec"] for r in rows}, key=lambda s: _order(("", s, "", 0)))
    variants = sorted(
        {r["variant"] for r in rows}, key=lambda v: _order(("", "", v, 0))
    )
    third = bool(summary["speedups"]) or bool(summary["fork_over_upstream"])
    fig, axes = plt.subplots(1, 3 if third else 2, figsize=(15 if third else 10, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("o-", "s--", "^:", "d-.")
    concs = sorted({r["conc"] for r in rows})
    for i, spec in enumerate(specs):
        for j, v in enumerate(variants):
            rs = sorted(
                (r for r in rows if r["spec"] == spec and r["variant"] == v),
                key=lambda r: r["conc"],
            )
            kw = {"color": colors[i % len(colors)], "label": f"{spec} / {v}"}
            st = styles[j % len(styles)]
            pts = [(r["conc"], r["output_throughput"]) for r in rs]
            pts = [p for p in pts if p[1] is not None]
            if pts:
                axes[0].plot(*zip(*pts, strict=True), st, **kw)
            pts = [(r["conc"], r["median_tpot_ms"]) for r in rs]
            pts = [p for p in pts if p[1] is not None]
            if pts:
                axes[1].plot(*zip(*pts, strict=True), st, **kw)
    fl = summary.get("weight_read_floor")
    if fl:
        axes[1].axhline(fl["floor_ms"], color="red", ls=":", label="weight-read floor")
    axes[0].set_ylabel("output tokens / s")
    axes[1].set_ylabel("TPOT, median (ms)")
    if third:
        ax = axes[2]
        if summary["speedups"]:
            for i, spec in enumerate(specs):
                for j, v in enumerate(variants):
                    pts = sorted(
                        (s["conc"], s["tput_speedup"])
                        for s in summary["speedups"]
                        if s["spec"] == spec
                        and s["variant"] == v
                        and s["tput_speedup"] is not None
                    )
                    if pts:
                        ax.plot(
                            *zip(*pts, strict=True),
                            styles[j % len(styles)],
                            color=colors[i % len(colors)],
                            label=f"{spec} / {v}",
                        )
            ax.set_ylabel("tok/s over no speculation")
        else:
            for i, spec in enumerate(specs):
                pts = sorted(
                    (q["conc"], q["tpot_ratio"])
                    for q in summary["fork_over_upstream"]
                    if q["spec"] == spec and q["tpot_ratio"] is not None
                )
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True),
                        "o-",
                        color=colors[i % len(colors)],
                        label=f"{spec}: TPOT fork / upstream",
                    )
            ax.set_ylabel("fork / upstream (median TPOT)")
        ax.axhline(1.0, color="gray", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs)
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("max concurrency")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_write(inputs, out: str | Path, name: str) -> dict:
    runs, meta = load_results(inputs)
    summary = summarize_runs(runs, meta)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"vllm bench serve: {name}"
    dev = (summary.get("bandwidth") or {}).get("device")
    if dev:
        title += f" ({dev})"
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(summary, title))
    png = plot_png(summary, out / f"{name}.png", title)
    summary["png"] = str(png) if png else None
    return summary


def summary_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench summary")
    ap.add_argument("inputs", nargs="+", help="output folders or result JSONs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="serve-bench")
    a = ap.parse_args(argv)
    s = summary_write(a.inputs, a.out, a.name)
    print((Path(a.out) / f"{a.name}.md").read_text())
    return 0 if s["rows"] else 1
