"""Spec-decode counters scraped from each server's Prometheus ``/metrics``
before and after the load: drafts, draft tokens, accepted tokens (per
position), hence the acceptance rate and the mean acceptance length."""

from __future__ import annotations

import asyncio
import re

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_metrics(text: str) -> dict:
    """Spec-decode counters from Prometheus text (summed over label sets;
    ``_total`` counters), and ``per_pos`` accepted counts by position."""
    out: dict = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    found = False
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            name_labels, value = line.rsplit(None, 1)
            v = float(value)
        except ValueError:
            continue
        name = name_labels.split("{", 1)[0]
        if not name.startswith("vllm:spec_decode"):
            continue
        if name.endswith("_total"):
            name = name[: -len("_total")]
        elif name.endswith(("_created", "_bucket", "_sum", "_count")):
            continue
        if name == PER_POS:
            m = re.search(r'position="(\d+)"', name_labels)
            if m:
                p = int(m.group(1))
                out["per_pos"][p] = out["per_pos"].get(p, 0.0) + v
                found = True
        elif name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] += v
            found = True
    out["found"] = found
    return out


def metrics_delta(before: dict | None, after: dict | None) -> dict | None:
    if not after or not after.get("found"):
        return None
    before = before or {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": {}}
    d = {k: after[k] - before.get(k, 0) for k in ("drafts", "draft_tokens", "accepted")}
    pp = {
        int(p): v - before.get("per_pos", {}).get(p, 0)
        for p, v in after["per_pos"].items()
    }
    d["per_pos"] = {p: pp[p] for p in sorted(pp)}
    drafts = d["drafts"]
    d["acceptance_rate"] = (
        round(d["accepted"] / d["draft_tokens"], 4) if d["draft_tokens"] else None
    )
    d["mean_acceptance_length"] = (
        round(1 + d["accepted"] / drafts, 3) if drafts else None
    )
    d["per_pos_rate"] = (
        [round(d["per_pos"][p] / drafts, 4) for p in d["per_pos"]] if drafts else []
    )
    return d


async def scrape(session, url: str) -> dict | None:
    try:
        async with session.get(url + "/metrics") as r:
            if r.status != 200:
                return None
            return parse_metrics(await r.text())
    except Exception:  # noqa: BLE001 - metrics are informative
        return None


async def scrape_all(servers, timeout: float | None = 20.0) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        got = await asyncio.gather(*(scrape(s, srv.url) for srv in servers))
    return {srv.name: g for srv, g in zip(servers, got, strict=True)}
