"""Client load for ``serving.serve_check``: the same requests to every
server at once, a bounded number in flight per server, streamed responses
folded chunk by chunk into one result per request (text, token ids, top
log-probabilities, finish reason, latency)."""

from __future__ import annotations

import asyncio
import json
import re
import time

from .prompts import Request, payload
from .servers import time_left


def _tok_id(token: str) -> int | None:
    m = re.fullmatch(r"token_id:(-?\d+)", token or "")
    return int(m.group(1)) if m else None


def _top_from_completion_lp(lp: dict | None) -> list[list]:
    """Per position, ``[[id, logprob], ...]`` best first."""
    if not lp:
        return []
    rows = []
    for top in lp.get("top_logprobs") or []:
        items = [[_tok_id(t), v] for t, v in (top or {}).items()]
        rows.append(sorted(items, key=lambda x: -x[1]))
    return rows


def _top_from_chat_lp(lp: dict | None) -> list[list]:
    if not lp:
        return []
    rows = []
    for entry in lp.get("content") or []:
        items = [
            [_tok_id(t["token"]), t["logprob"]] for t in entry.get("top_logprobs") or []
        ]
        rows.append(sorted(items, key=lambda x: -x[1]))
    return rows


def new_result() -> dict:
    return {
        "text": "",
        "token_ids": None,
        "prompt_token_ids": None,
        "finish_reason": None,
        "top": [],
        "chunks": 0,
        "usage": None,
        "error": None,
        "latency_s": None,
    }


def absorb(res: dict, obj: dict, chat: bool) -> None:
    """Fold one response object (whole or a stream chunk) into ``res``."""
    if obj.get("prompt_token_ids") is not None:
        res["prompt_token_ids"] = obj["prompt_token_ids"]
    if obj.get("usage"):
        res["usage"] = obj["usage"]
    for ch in obj.get("choices") or []:
        if ch.get("index", 0) != 0:
            continue
        if chat:
            part = (ch.get("delta") or ch.get("message") or {}).get("content")
            top = _top_from_chat_lp(ch.get("logprobs"))
        else:
            part = ch.get("text")
            top = _top_from_completion_lp(ch.get("logprobs"))
        res["text"] += part or ""
        if ch.get("token_ids") is not None:
            res["token_ids"] = (res["token_ids"] or []) + list(ch["token_ids"])
        if ch.get("prompt_token_ids") is not None:
            res["prompt_token_ids"] = ch["prompt_token_ids"]
        res["top"] += top
        if ch.get("finish_reason") is not None:
            res["finish_reason"] = ch["finish_reason"]


async def send(
    session, url: str, req: Request, body: dict, timeout: float | None
) -> dict:
    """One request; the result dict (``error`` set on failure). ``timeout``
    None: no limit."""
    import aiohttp

    res = new_result()
    chat = req.endpoint == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.monotonic()
    try:
        async with session.post(
            url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as r:
            if r.status != 200:
                res["error"] = f"HTTP {r.status}: {(await r.text())[:500]}"
                return res
            if not req.stream:
                absorb(res, await r.json(), chat)
            else:
                buf = b""
                async for data in r.content.iter_any():
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        item = line[5:].strip()
                        if item == b"[DONE]":
                            continue
                        obj = json.loads(item)
                        if "error" in obj and "choices" not in obj:
                            res["error"] = f"stream error: {json.dumps(obj)[:500]}"
                            return res
                        res["chunks"] += 1
                        absorb(res, obj, chat)
    except Exception as e:  # noqa: BLE001 - recorded per request
        res["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        res["latency_s"] = round(time.monotonic() - t0, 3)
    if res["error"] is None and res["finish_reason"] is None:
        res["error"] = "no finish_reason (truncated response)"
    return res


async def run_requests(servers, reqs, model, concurrency, logprobs_for, deadline):
    """``{server name: [result per request]}``, every server at once."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one_server(srv):
            sem = asyncio.Semaphore(concurrency)
            lp = srv.name in logprobs_for
            t0 = time.monotonic()

            async def one(req):
                async with sem:
                    return await send(
                        session,
                        srv.url,
                        req,
                        payload(req, model, lp),
                        time_left(deadline),
                    )

            out = await asyncio.gather(*(one(r) for r in reqs))
            srv.client_s = round(time.monotonic() - t0, 2)
            return out

        results = await asyncio.gather(*(one_server(s) for s in servers))
    return {s.name: r for s, r in zip(servers, results, strict=True)}
