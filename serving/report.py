"""The summary ``serving.serve_check`` writes (``serve_check.md``): one row
per server, the requests that differ, start-up facts, lm-eval results,
servers that did not come up, negative controls, the verdict."""

from __future__ import annotations

import json


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        "# serve_check",
        "",
        f"model `{cfg['model']}`, prompts `{cfg['prompts']}`, {cfg['n']} requests, "
        f"concurrency {cfg['concurrency']}, max_tokens {cfg['max_tokens']}, "
        f"greedy; tie margin {cfg['tie_margin']} nats. Reference: "
        f"`{report['reference']}`.",
        "",
        "| server | spec | ready s | client s | out tok | tok/s | errors "
        "| exact match | verdict | match | tie | diverged | error "
        "| accept rate | mean accept len |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report["servers"]:
        cmp_ = report["candidates"].get(s["name"], {})
        summ = cmp_.get("summary", {})
        m = s.get("spec_metrics") or {}
        spec = s["spec"]
        spec_s = (
            "none"
            if spec is None
            else (f"{spec.get('method')} k={spec.get('num_speculative_tokens')}")
        )
        name = s["name"] + (" (control)" if cmp_.get("control") else "")
        lines.append(
            f"| {name} | {spec_s} | {s.get('ready_s')} | {s.get('client_s')} "
            f"| {s.get('output_tokens')} | {s.get('tokens_per_s')} | {s.get('errors')} "
            f"| {s.get('exact_match')} | {summ.get('verdict', '(reference)')} "
            f"| {summ.get('match', '')} | {summ.get('tie', '')} "
            f"| {summ.get('diverged', '')} | {summ.get('error', '')} "
            f"| {m.get('acceptance_rate', '')} "
            f"| {m.get('mean_acceptance_length', '')} |"
        )
    lines.append("")
    for name, c in report["candidates"].items():
        # every divergence and error (up to 20), a few ties
        bad = [r for r in c["rows"] if r["status"] in ("diverged", "error")]
        ties = [r for r in c["rows"] if r["status"] == "tie"]
        shown = bad[:20] + ties[:5]
        if not shown:
            continue
        lines += [f"## {name}: requests that differ from the reference", ""]
        for r in shown:
            detail = {k: v for k, v in r.items() if k not in ("idx", "kind", "status")}
            lines.append(
                f"- #{r['idx']} {r['kind']}: **{r['status']}** "
                + json.dumps(detail)[:400]
            )
        more = len(bad) + len(ties) - len(shown)
        if more > 0:
            lines.append(f"- ... {more} more in serve_check.json")
        lines.append("")
    facts = [(s["name"], s.get("log_facts") or []) for s in report["servers"]]
    if any(f for _, f in facts):
        lines += ["## start-up (from the server logs)", ""]
        for name, f in facts:
            lines += [f"- {name}: " + "; ".join(f)]
        lines.append("")
    if report.get("lm_eval"):
        lines += ["## lm-eval", "", "| run | rc | results |", "|---|---:|---|"]
        for tag, r in report["lm_eval"].items():
            lines.append(f"| {tag} | {r['rc']} | `{json.dumps(r['results'])}` |")
        lines.append("")
    if report.get("failed"):
        lines += ["## servers that did not come up", ""]
        for name, tail in report["failed"].items():
            lines += [f"### {name}", "", "```", tail, "```", ""]
    controls = [
        f"{n}: {c['summary'].get('control_outcome')}"
        for n, c in report["candidates"].items()
        if c.get("control")
    ]
    if controls:
        lines.append(
            "Negative controls (not part of the verdict): " + "; ".join(controls) + "."
        )
        lines.append("")
    lines.append(f"Total {report['total_s']} s. Verdict: **{report['verdict']}**.")
    return "\n".join(lines) + "\n"
