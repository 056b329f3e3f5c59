"""Several configurations of one vLLM install, side by side: a table and a
plot of decode step time and tokens/s per batch size, and each
configuration's tokens/s over a baseline's.

    python -m benchmarks.configs_report OUT/tq --baseline tq_eager \\
        --out reports/bench/RUN --run tq-mtp-9b

The inputs are ``benchmarks.decode_latency`` JSONs (files or folders); a
configuration is a JSON's ``mode`` (its ``--label``). Repeats of a label are
averaged. ``benchmarks/gpu_runs.sh tq`` makes the TurboQuant set: ``tq_fix``
(full CUDA graphs), ``tq_downgrade`` (TurboQuant's graph support lowered to
single-token decodes), ``tq_eager``.

Two throughputs per row. ``tok/s`` is the closed batch's: every decode step
of the measured runs, which submit BS requests at once and wait for the
last. Under speculation with per-request acceptance (a replayed trace) the
requests that accept more finish first, and the batch's tail runs with a
few rows: a closed batch is as slow as its slowest request. ``full-batch
tok/s`` counts only the decode steps that held all BS requests (no prefill
row): what a server that keeps BS requests in flight, refilling the batch
as requests finish, would emit per second with this mix of requests. The
per-step records (``steps``: [ms, rows, prefill rows, drafts, accepted,
tokens]) hold what both need; neither vLLM's metrics nor ``vllm bench``
split a run by how full its steps were.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.plot import load


def rows(docs: list[dict], baseline: str | None) -> list[dict]:
    """One row per (label, variant, BS): median ms/step, tokens/s, and the
    tokens/s ratio over ``baseline`` of the same variant at the same BS (None
    where either is missing). Where the JSONs hold several variants (fork and
    upstream of one side-by-side run), a row's config is ``label/variant``."""
    cells: dict[tuple[str, str, int], list[dict]] = {}
    for d in docs:
        for r in d.get("results", []):
            key = (d["mode"], str(d.get("variant", "")), int(r["bs"]))
            cells.setdefault(key, []).append(r)
    several = len({v for _, v, _ in cells}) > 1

    def mean(rs: list[dict], key: str) -> float | None:
        return _mean([r.get(key) for r in rs])

    out = []
    for (label, variant, bs), rs in sorted(cells.items()):
        out.append(
            {
                "config": f"{label}/{variant}" if several else label,
                "label": label,
                "variant": variant,
                "bs": bs,
                "runs": len(rs),
                "median_ms": mean(rs, "median_ms"),
                "tokens_per_s": mean(rs, "tokens_per_s"),
                "tokens_per_step": mean(rs, "tokens_per_step"),
                "acceptance": mean(rs, "acceptance"),
                "wall_s": mean(rs, "wall_s"),
                "peak_rows": max(
                    (n for n in map(peak_rows, rs) if n is not None), default=None
                ),
                "full_batch_tokens_per_s": _mean(
                    [full_batch_tokens_per_s(r, bs) for r in rs]
                ),
            }
        )
    base = {(r["variant"], r["bs"]): r for r in out if r["label"] == baseline}
    for r in out:
        b = base.get((r["variant"], r["bs"]), {})
        bt, bw = b.get("tokens_per_s"), b.get("wall_s")
        r["speedup_vs_baseline"] = (
            r["tokens_per_s"] / bt if bt and r["tokens_per_s"] is not None else None
        )
        # the same requests and tokens on both sides: the batch's wall time
        r["e2e_speedup_vs_baseline"] = bw / r["wall_s"] if bw and r["wall_s"] else None
        bf, rf = b.get("full_batch_tokens_per_s"), r["full_batch_tokens_per_s"]
        r["full_batch_speedup_vs_baseline"] = rf / bf if bf and rf is not None else None
    return out


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def full_batch_tokens_per_s(result: dict, bs: int) -> float | None:
    """Tokens emitted per second by the decode steps that held all ``bs``
    requests and no prefill row (``steps``: decode_latency's per-step
    records [ms, rows, prefill rows, drafts, accepted, tokens]); None
    without such steps or without the records."""
    full = [
        s
        for s in result.get("steps") or []
        if len(s) >= 6 and int(s[1]) == bs and not s[2] and s[0] > 0
    ]
    ms = sum(float(s[0]) for s in full)
    return sum(float(s[5]) for s in full) * 1e3 / ms if full else None


def peak_rows(result: dict) -> int | None:
    """The most requests any step scheduled (``steps``: decode_latency's
    per-step records, rows second): below the batch size where the engine
    could not hold the whole batch at once."""
    steps = result.get("steps") or []
    return max((int(s[1]) for s in steps), default=None)


def _f(x, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(rs: list[dict], docs: list[dict], baseline: str | None, run: str) -> str:
    d0 = docs[0] if docs else {}
    eng = d0.get("config", {}).get("engine", {})
    lines = [
        f"# Decode step time by configuration: `{run}`",
        "",
        f"- device: {d0.get('device')}; vLLM {d0.get('vllm_version')} "
        f"(fork patches present: {d0.get('fork_patches')})",
        f"- engine: kv_cache_dtype {eng.get('kv_cache_dtype', 'auto')}, "
        f"speculative_config `{json.dumps(eng.get('speculative_config'))}`, "
        f"max_num_seqs {eng.get('max_num_seqs')}",
    ]
    if any(d.get("config", {}).get("refill") for d in docs):
        lines.append(
            "- refilled runs (`--refill`): BS requests in flight, a finished "
            "one's slot going to the next; their tok/s is every token over "
            "every step until the last request is admitted"
        )
    for d in docs:
        tq = d.get("turboquant") or {}
        eager = d["config"]["engine"].get("enforce_eager")
        lines.append(
            f"- `{d['mode']}`: enforce_eager {eager}"
            + (
                f", TurboQuant cudagraph support {tq.get('cudagraph_support')}, "
                f"prefill {tq.get('prefill')}"
                if tq
                else ""
            )
            + f", status {d.get('status')}"
        )
    lines += [
        "",
        "ms/step: median wall time of full-batch decode steps (of all decode "
        "steps where no step held the full batch); tok/s: tokens emitted by "
        "decode steps over their time; peak rows: the most requests one step "
        "scheduled; wall: the batch's measured runs from submission to the last "
        "token; full-batch tok/s: tokens emitted by the decode steps that held "
        "all BS requests over their time (a server keeping BS requests in "
        "flight; the closed batch's tok/s waits for its slowest request)"
        + (
            f"; speedup: tok/s over `{baseline}` of the same variant at the same "
            f"BS; e2e: `{baseline}`'s wall time over this one's; full-batch: "
            f"full-batch tok/s over `{baseline}`'s."
            if baseline
            else "."
        ),
        "",
        "| config | BS | ms/step | tok/s | tokens/step | acceptance | peak rows "
        "| wall s | speedup | e2e | full-batch tok/s | full-batch speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rs:
        lines.append(
            f"| {r['config']} | {r['bs']} | {_f(r['median_ms'])} "
            f"| {_f(r['tokens_per_s'], '{:.0f}')} "
            f"| {_f(r['tokens_per_step'], '{:.2f}')} "
            f"| {_f(r['acceptance'], '{:.3f}')} "
            f"| {_f(r['peak_rows'], '{}')} | {_f(r['wall_s'], '{:.2f}')} "
            f"| {_f(r['speedup_vs_baseline'], '{:.2f}x')} "
            f"| {_f(r['e2e_speedup_vs_baseline'], '{:.2f}x')} "
            f"| {_f(r['full_batch_tokens_per_s'], '{:.0f}')} "
            f"| {_f(r['full_batch_speedup_vs_baseline'], '{:.2f}x')} |"
        )
    return "\n".join(lines) + "\n"


def plot(rs: list[dict], path: Path, run: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    e2e = any(r.get("e2e_speedup_vs_baseline") is not None for r in rs)
    titles = ["ms per decode step", "tokens/s"] + (["e2e speedup"] if e2e else [])
    fig, axes = plt.subplots(1, len(titles), figsize=(5 * len(titles), 4))
    for label in sorted({r["config"] for r in rs}):
        pts = [r for r in rs if r["config"] == label]
        bs = [r["bs"] for r in pts]
        axes[0].plot(bs, [r["median_ms"] for r in pts], marker="o", label=label)
        axes[1].plot(bs, [r["tokens_per_s"] for r in pts], marker="o", label=label)
        if e2e:
            axes[2].plot(
                bs,
                [r.get("e2e_speedup_vs_baseline") for r in pts],
                marker="o",
                label=label,
            )
    if e2e:
        axes[2].axhline(1.0, color="k", lw=0.8)
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(run)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(inputs, out: str | Path, run: str, baseline: str | None) -> dict:
    docs = [d for _, d in load(inputs)]
    if not docs:
        raise SystemExit("no decode_latency JSONs among the inputs")
    rs = rows(docs, baseline)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{run}.md").write_text(markdown(rs, docs, baseline, run))
    (out / f"{run}.json").write_text(json.dumps({"run": run, "rows": rs}, indent=1))
    plotted = plot(rs, out / f"{run}.png", run)
    return {"rows": rs, "png": plotted}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.configs_report")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--run", default="configs")
    ap.add_argument("--baseline", default=None, help="label the speedups are over")
    a = ap.parse_args(argv)
    write(a.inputs, a.out, a.run, a.baseline)
    print((Path(a.out) / f"{a.run}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
