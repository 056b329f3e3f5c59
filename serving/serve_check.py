"""``vllm serve`` end to end: speculative servers against a non-speculative
reference, over the OpenAI-compatible API, in one bounded call.

    python -m serving.serve_check --model DIR --out OUT --prompts fastapply \\
        --server ref=none --server ngram=ngram --server mtp=mtp --deadline 540

What it does, in order, within ``--deadline`` seconds (a watchdog kills
everything it started and exits at the deadline plus a grace; ``--deadline
0``: no deadline, each step waits for its condition, as dry runs on a busy
CPU host want):

1. launches one ``vllm serve DIR`` per ``--server NAME=SPEC`` (the first is
   the reference; SPEC is ``none``, a preset of ``PRESETS`` or a JSON
   speculative config), side by side on one GPU on distinct ports, each in
   its own process group (``--gpu-mem`` and ``--kv-bytes`` split the GPU;
   the fixed KV size avoids memory profiling that the neighbours would
   disturb), with the engine flags of ``--engine-args``; logs under
   ``OUT/logs``. ``--attach NAME=URL`` uses a running server instead;
2. waits for every ``/health``;
3. sends the same ``--n`` requests to every server, ``--concurrency`` in
   flight per server (all servers at once): greedy (temperature 0),
   bounded ``max_tokens``, heterogeneous prompts (``--prompts``), over
   ``/v1/completions`` and ``/v1/chat/completions``, streaming (chunks
   concatenated) and not, in a fixed rotation. Every request asks for the
   token ids (vLLM's ``return_token_ids``); the reference's also ask for
   the top-2 log-probabilities (``--logprobs ref``);
4. scrapes each server's ``/metrics`` before and after: the spec-decode
   counters (``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``,
   ``_num_accepted_tokens``, per position) give the acceptance rate and the
   mean acceptance length ``1 + accepted / drafts``;
5. compares each candidate with the reference per request: text, token ids
   and finish reason. A differing request is judged token by token,
   margin-aware as ``harness.compare`` does: the reference server scores
   ``prompt + candidate tokens`` teacher-forced (``prompt_logprobs``); a
   position where the candidate's token is below the reference's top choice
   by less than ``--tie-margin`` (bf16 noise) is a *tie*, by more a
   *divergence*. Without that (``--no-rescore``) only the first difference
   is judged, from the reference's own top-2;
6. optionally runs lm-eval against every server (``--lm-eval TASK_DIR``,
   see ``serving/lm_eval_task``);
7. writes ``OUT/serve_check.json`` (every response, every judgement, the
   metrics) and ``OUT/serve_check.md`` (the summary), prints the summary,
   and stops the servers (SIGTERM to each group, SIGKILL after a grace).

Verdict per candidate: ``PASS`` when every request is identical to the
reference, ``PASS-TIES`` when the only differences are ties, ``FAIL`` when
a request diverged, failed or is missing, or returned the same tokens with
another text. ``--control NAME`` marks a negative control (e.g. the same
server on upstream v0.26.0 through ``--server-cmd``): expected to fail,
reported, not part of the verdict. Exit status 0 when every candidate that
is not a control passes (ties included), 1 otherwise, 2 on a usage error,
3 when the reference did not come up, 124 when the watchdog fired.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PRESETS: dict[str, dict | None] = {
    "none": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 64,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 10,
    },
    "ngram8": {
        "method": "ngram",
        "num_speculative_tokens": 8,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 10,
    },
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
    "mtp1": {"method": "mtp", "num_speculative_tokens": 1},
}
# what a Qwen3.5 checkpoint needs on the GPU hosts (harness.equivalence's
# engine_kwargs, as command-line flags)
QWEN35_ENGINE_ARGS = (
    "--gdn-prefill-backend triton --language-model-only "
    '--limit-mm-per-prompt \'{"image": 0, "video": 0}\''
)
TIE_MARGIN = 0.05  # nats; harness.compare.TIE_MARGIN["bfloat16"]
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class CheckError(RuntimeError):
    """A usage or setup error, printed without a traceback."""


def time_left(deadline: float, floor: float = 1.0) -> float | None:
    """Seconds to a ``time.monotonic()`` deadline (at least ``floor``), or
    None (wait without a limit) when there is no deadline (``math.inf``)."""
    if math.isinf(deadline):
        return None
    return max(floor, deadline - time.monotonic())


def parse_spec(text: str) -> dict | None:
    text = text.strip()
    if text in PRESETS:
        return PRESETS[text]
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckError(
            f"speculative config {text!r}: not a preset "
            f"({', '.join(PRESETS)}) nor JSON: {e}"
        ) from None
    if spec is not None and not isinstance(spec, dict):
        raise CheckError(f"speculative config {text!r} is not a JSON object")
    return spec


# ---------------------------------------------------------------------------
# requests


@dataclass
class Request:
    idx: int
    endpoint: str  # "completions" | "chat"
    stream: bool
    max_tokens: int
    prompt: str | None = None  # completions
    messages: list | None = None  # chat
    stop: list[str] | None = None
    expected: str | None = None  # known answer (fast-apply), text

    @property
    def kind(self) -> str:
        return f"{self.endpoint}-{'stream' if self.stream else 'full'}"


def _rotation(i: int) -> tuple[str, bool]:
    """completions/chat x non-streaming/streaming, in turn."""
    return ("completions", "chat")[i % 2], bool((i // 2) % 2)


def fastapply_requests(n: int, seed: int = 0, max_tokens: int = 128) -> list[Request]:
    """Held-out fast-apply prompts (``harness.fastapply.make_eval_set``) as
    text (``serving.make_model.prompt_text``); chat requests carry the same
    text as their one user message (the fixture's chat template maps it to
    the same ids). ``expected``: the answer's text."""
    from harness import fastapply as fa

    from .make_model import prompt_text

    out = []
    for i, (p, ans) in enumerate(fa.make_eval_set(n, seed)):
        endpoint, stream = _rotation(i)
        text = prompt_text(p)
        out.append(
            Request(
                idx=i,
                endpoint=endpoint,
                stream=stream,
                max_tokens=max_tokens,
                prompt=text if endpoint == "completions" else None,
                messages=[{"role": "user", "content": text}]
                if endpoint == "chat"
                else None,
                expected=prompt_text(ans[:-1]),
            )
        )
    return out


_SYSTEMS = (
    "You are a careful assistant. Answer briefly.",
    "You are a code reviewer. Point out problems in the code you are given.",
    "You rewrite text in plain English.",
)
_ASKS = (
    "Explain what this code does:\n\n",
    "Rename the variables in this code to something clearer:\n\n",
    "Summarise the following text:\n\n",
    "Continue this:\n\n",
)


def text_requests(n: int, seed: int = 0, max_tokens: int = 128) -> list[Request]:
    """Heterogeneous prompts for a general model: code (``harness.fastapply``'s
    code generator, rendered by ``serving.tokenizer``) and English-like prose
    of varied lengths, chat requests with a system prompt (three shared
    ones: prefix-cache hits) and some multi-turn, ``max_tokens`` varied in
    ``[max_tokens / 4, max_tokens]``, a stop string on some."""
    from . import tokenizer as tk

    words = tk.lexicon(seed + 101)
    cum = tk._zipf_cum_weights(len(words))
    rng = random.Random(f"serve-check-{seed}")
    out = []
    for i in range(n):
        endpoint, stream = _rotation(i)
        docs = [
            (tk.code_document if rng.random() < 0.5 else tk.prose_document)(
                rng, words, cum
            )
            for _ in range(rng.choice((1, 1, 2, 4)))
        ]
        body = "".join(docs)
        mt = rng.randint(max(1, max_tokens // 4), max_tokens)
        stop = ["\n\n"] if i % 8 == 7 else None
        if endpoint == "completions":
            req = Request(i, endpoint, stream, mt, prompt=body, stop=stop)
        else:
            msgs = [
                {"role": "system", "content": _SYSTEMS[i % len(_SYSTEMS)]},
                {"role": "user", "content": rng.choice(_ASKS) + body},
            ]
            if i % 5 == 3:
                msgs += [
                    {
                        "role": "assistant",
                        "content": tk.prose_document(rng, words, cum),
                    },
                    {"role": "user", "content": "And in one sentence?"},
                ]
            req = Request(i, endpoint, stream, mt, messages=msgs, stop=stop)
        out.append(req)
    return out


def build_requests(kind: str, n: int, seed: int, max_tokens: int) -> list[Request]:
    if kind == "fastapply":
        return fastapply_requests(n, seed, max_tokens)
    if kind == "text":
        return text_requests(n, seed, max_tokens)
    raise CheckError(f"unknown prompt set {kind!r} (fastapply, text)")


def payload(req: Request, model: str, logprobs: bool) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": req.stream,
        "return_token_ids": True,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.stop:
        body["stop"] = req.stop
    if req.endpoint == "completions":
        body["prompt"] = req.prompt
        if logprobs:
            body["logprobs"] = 2
    else:
        body["messages"] = req.messages
        if logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = 2
    if logprobs:
        body["return_tokens_as_token_ids"] = True
    return body


# ---------------------------------------------------------------------------
# responses


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


# ---------------------------------------------------------------------------
# metrics


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


# ---------------------------------------------------------------------------
# comparison


def first_diff(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def judge_first(ref: dict, cand: dict, pos: int, margin: float) -> dict:
    """The first token difference judged from the reference's own top-2."""
    top = ref["top"][pos] if pos < len(ref["top"]) else None
    ids = cand["token_ids"] or []
    cand_tok = ids[pos] if pos < len(ids) else None
    if not top or len(top) < 2:
        return {"pos": pos, "gap": None, "tie": False, "cand_token": cand_tok}
    gap = top[0][1] - top[1][1]
    tie = gap < margin and cand_tok is not None and cand_tok == top[1][0]
    return {
        "pos": pos,
        "gap": round(gap, 4),
        "tie": tie,
        "cand_token": cand_tok,
        "ref_token": top[0][0],
        "ref_second": top[1][0],
    }


def compare(reqs, ref_res, cand_res, margin: float) -> list[dict]:
    """Per request: ``status`` match | differs (to be judged) | error."""
    rows = []
    for req, r, c in zip(reqs, ref_res, cand_res, strict=True):
        row = {"idx": req.idx, "kind": req.kind}
        if r["error"] or c["error"]:
            row.update(status="error", ref_error=r["error"], cand_error=c["error"])
            rows.append(row)
            continue
        ids_known = r["token_ids"] is not None and c["token_ids"] is not None
        same_ids = (r["token_ids"] == c["token_ids"]) if ids_known else None
        same_text = r["text"] == c["text"]
        same_finish = r["finish_reason"] == c["finish_reason"]
        row.update(
            same_text=same_text,
            same_ids=same_ids,
            same_finish=same_finish,
            ref_tokens=len(r["token_ids"] or []),
            cand_tokens=len(c["token_ids"] or []),
        )
        if same_text and same_ids is not False and same_finish:
            row["status"] = "match"
        elif same_ids:
            # the same tokens, another text or finish: detokenization,
            # streaming or stop handling differs, no numerics can explain it
            row["status"] = "diverged"
            row["reason"] = "same token ids, different text or finish reason"
            row["first_char"] = first_diff(r["text"], c["text"])
        else:
            row["status"] = "differs"
            row["first_char"] = first_diff(r["text"], c["text"])
            if ids_known:
                pos = first_diff(r["token_ids"], c["token_ids"])
                row["first_token"] = pos
                if pos is not None and pos < min(
                    len(r["token_ids"]), len(c["token_ids"])
                ):
                    row["first"] = judge_first(r, c, pos, margin)
        rows.append(row)
    return rows


async def rescore(url, model, rows, ref_res, cand_res, margin, deadline) -> None:
    """Judge every differing request token by token: the reference server
    scores prompt + candidate tokens teacher-forced; sets ``ties``,
    ``divergences`` and ``status`` (tie | diverged) in the rows."""
    import aiohttp

    todo = [
        row
        for row in rows
        if row["status"] == "differs"
        and ref_res[row["idx_pos"]]["prompt_token_ids"] is not None
        and cand_res[row["idx_pos"]]["token_ids"] is not None
    ]

    async def one(session, row):
        prompt = list(ref_res[row["idx_pos"]]["prompt_token_ids"])
        cand = list(cand_res[row["idx_pos"]]["token_ids"])
        body = {
            "model": model,
            "prompt": prompt + cand,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 1,
        }
        try:
            async with session.post(
                url + "/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=time_left(deadline)),
            ) as r:
                if r.status != 200:
                    row["rescore_error"] = f"HTTP {r.status}: {(await r.text())[:300]}"
                    return
                data = await r.json()
        except Exception as e:  # noqa: BLE001 - recorded
            row["rescore_error"] = f"{type(e).__name__}: {e}"[:300]
            return
        plp = data["choices"][0].get("prompt_logprobs") or []
        ties, divs = [], []
        for j, tok in enumerate(cand):
            k = len(prompt) + j
            entry = plp[k] if k < len(plp) else None
            if not entry:
                continue
            lps = {int(t): v["logprob"] for t, v in entry.items()}
            best = max(lps.values())
            got = lps.get(tok)
            if got is None:
                divs.append({"pos": j, "gap": None})
                continue
            gap = best - got
            if gap > 0:
                (ties if gap < margin else divs).append(
                    {"pos": j, "gap": round(gap, 4)}
                )
        row["ties"], row["divergences"] = ties, divs
        row["status"] = "diverged" if divs else "tie"
        row["judged"] = "teacher-forced"
        if not ties and not divs:
            # every candidate token is the reference's choice, yet the
            # sequences differ: one stopped early or ran on
            row["status"] = "diverged"
            row["reason"] = "greedy-consistent tokens, different length or stop"

    if todo:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(one(session, row) for row in todo))


def finalize(rows: list[dict]) -> None:
    """Rows not judged teacher-forced: judge from the first difference."""
    for row in rows:
        if row["status"] != "differs":
            continue
        first = row.get("first")
        row["judged"] = "first-difference"
        row["status"] = "tie" if first and first.get("tie") else "diverged"


def summarize(rows, n_expected: int) -> dict:
    counts = {
        s: sum(r["status"] == s for r in rows)
        for s in ("match", "tie", "diverged", "error")
    }
    missing = n_expected - len(rows)
    if counts["diverged"] or counts["error"] or missing or not rows:
        verdict = "FAIL"
    elif counts["tie"]:
        verdict = "PASS-TIES"
    else:
        verdict = "PASS"
    by_kind: dict = {}
    for r in rows:
        k = by_kind.setdefault(r["kind"], {"n": 0, "match": 0})
        k["n"] += 1
        k["match"] += r["status"] == "match"
    return {"verdict": verdict, **counts, "missing": missing, "by_kind": by_kind}


def exact_match(reqs, results) -> float | None:
    pairs = [
        (q.expected, r)
        for q, r in zip(reqs, results, strict=True)
        if q.expected is not None
    ]
    if not pairs:
        return None
    ok = sum(r["error"] is None and r["text"].strip() == e.strip() for e, r in pairs)
    return round(ok / len(pairs), 4)


# ---------------------------------------------------------------------------
# servers


@dataclass
class ServerSpec:
    name: str
    spec: dict | None
    url: str = ""
    port: int = 0
    extra: list[str] = field(default_factory=list)
    cmd: str | None = None  # overrides --vllm-cmd for this server
    control: bool = False  # expected to fail (a negative control)
    attached: bool = False
    proc: subprocess.Popen | None = None
    log: str = ""
    started: float = 0.0
    ready_s: float | None = None
    client_s: float | None = None
    exit_code: int | None = None
    version: str | None = None


def free_port(start: int) -> int:
    port = start
    while port < start + 1000:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                port += 1
    raise CheckError(f"no free port from {start}")


def server_command(a, srv: ServerSpec) -> list[str]:
    cmd = shlex.split(srv.cmd or a.vllm_cmd) + [
        "serve",
        a.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(srv.port),
        "--served-model-name",
        a.served_name,
        "--seed",
        "0",
        "--max-model-len",
        str(a.max_model_len),
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--gpu-memory-utilization",
        str(a.gpu_mem),
    ]
    if a.kv_bytes:
        cmd += ["--kv-cache-memory-bytes", str(int(float(a.kv_bytes)))]
    cmd += shlex.split(a.engine_args or "")
    cmd += srv.extra
    if srv.spec is not None:
        cmd += ["--speculative-config", json.dumps(srv.spec)]
    return cmd


def launch(a, srv: ServerSpec, logs: Path) -> None:
    srv.port = free_port(a.port)
    a.port = srv.port + 1
    srv.url = f"http://127.0.0.1:{srv.port}"
    srv.log = str(logs / f"{srv.name}.log")
    cmd = server_command(a, srv)
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if a.cache_root:
        # one compile cache per server: servers that start together would
        # otherwise compile the same graphs into the same directory
        env["VLLM_CACHE_ROOT"] = str(Path(a.cache_root) / srv.name)
    with open(srv.log, "w") as fh:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        srv.proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    srv.started = time.monotonic()


def stop(servers, grace: float = 20.0) -> None:
    """SIGTERM to each launched server's process group, SIGKILL after
    ``grace`` seconds."""
    live = [s for s in servers if s.proc is not None and s.proc.poll() is None]
    for s in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(s.proc.pid, signal.SIGTERM)
    end = time.monotonic() + grace
    for s in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(timeout=max(0.1, end - time.monotonic()))
    for s in servers:
        if s.proc is None:
            continue
        # the group may hold children (the engine core) after the leader left
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(s.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(timeout=5)
        s.exit_code = s.proc.returncode


def log_tail(path: str, n: int = 30) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keep = [ln for ln in lines if not re.search(r"\] (GET|POST) |Uvicorn|HTTP/1.1", ln)]
    return "\n".join(keep[-n:])


_FACTS = re.compile(
    r"GPU KV cache size: .*|Maximum concurrency for .*|"
    r"Loading weights took .*|Model loading took .*|"
    r"init engine .* took .*|Available KV cache memory: .*"
)


def log_facts(path: str) -> list[str]:
    """Start-up facts from a vLLM server log (KV cache size, maximum
    concurrency, load and init times)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return [m.group(0).strip() for m in _FACTS.finditer(text)][:12]


async def wait_ready(servers, deadline: float, log=print) -> list[str]:
    """Poll ``/health`` until every server answers 200; the names of those
    that died or were not ready by ``deadline`` (``math.inf``: wait until
    each is healthy or has exited)."""
    import aiohttp

    pending = {s.name: s for s in servers}
    failed: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as sess:
        while pending and time.monotonic() < deadline:
            for name, s in list(pending.items()):
                if s.proc is not None and s.proc.poll() is not None:
                    log(f"[serve_check] {name} exited with {s.proc.returncode}")
                    failed.append(name)
                    del pending[name]
                    continue
                try:
                    async with sess.get(s.url + "/health") as r:
                        if r.status == 200:
                            s.ready_s = round(time.monotonic() - s.started, 1)
                            log(f"[serve_check] {name} ready after {s.ready_s} s")
                            with contextlib.suppress(Exception):
                                async with sess.get(s.url + "/version") as v:
                                    s.version = (await v.json()).get("version")
                            del pending[name]
                except Exception:  # noqa: BLE001 - not up yet
                    pass
            if pending:
                await asyncio.sleep(0.25)
    for name in pending:
        log(f"[serve_check] {name} not ready by the deadline")
        failed.append(name)
    return failed


# ---------------------------------------------------------------------------
# lm-eval


def lm_eval_command(a, srv: ServerSpec, out_dir: Path, chat: bool) -> list[str]:
    model = "local-chat-completions" if chat else "local-completions"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    margs = (
        f"model={a.served_name},base_url={srv.url}{path},"
        f"tokenizer_backend=None,num_concurrent={a.lm_eval_concurrency},"
        "max_retries=1,timeout=120"
    )
    cmd = shlex.split(a.lm_eval_cmd) + [
        "run",
        "--model",
        model,
        "--tasks",
        a.lm_eval_task,
        "--include_path",
        str(Path(a.lm_eval).resolve()),
        "--model_args",
        margs,
        "--output_path",
        str(out_dir),
        "--log_samples",
    ]
    if chat:
        cmd.append("--apply_chat_template")
    if a.lm_eval_limit:
        cmd += ["--limit", str(a.lm_eval_limit)]
    return cmd


def read_lm_eval(out_dir: Path, task: str) -> dict | None:
    files = sorted(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    res = json.loads(files[-1].read_text()).get("results", {}).get(task)
    return {k: v for k, v in (res or {}).items() if k != "alias"} or None


def run_lm_eval(a, servers, out: Path, deadline: float, log=print) -> dict:
    """lm-eval (completions and chat) against every server, all at once."""
    procs = []
    for srv in servers:
        for chat in (False, True):
            tag = f"{srv.name}-{'chat' if chat else 'completions'}"
            d = out / "lm_eval" / tag
            d.mkdir(parents=True, exist_ok=True)
            cmd = lm_eval_command(a, srv, d, chat)
            fh = open(out / "logs" / f"lm_eval-{tag}.log", "w")  # noqa: SIM115
            fh.write("$ " + shlex.join(cmd) + "\n")
            fh.flush()
            p = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
            procs.append((tag, p, fh, d))
    results = {}
    for tag, p, fh, d in procs:
        try:
            p.wait(timeout=time_left(deadline))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        fh.close()
        r = read_lm_eval(d, a.lm_eval_task)
        results[tag] = {"rc": p.returncode, "results": r}
        if r is None:
            results[tag]["log_tail"] = log_tail(fh.name, 15)
        log(f"[serve_check] lm-eval {tag}: rc={p.returncode} {json.dumps(r)}")
    return results


# ---------------------------------------------------------------------------
# report


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


# ---------------------------------------------------------------------------
# main


def add_server_args(
    ap: argparse.ArgumentParser,
    *,
    port: int,
    cache_root: str,
    gpu_mem: float,
    engine_args: str,
) -> None:
    """The `vllm serve` settings server_command and launch read (shared
    with benchmarks/serve_bench.py), with the caller's defaults."""
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument(
        "--cache-root",
        default=cache_root,
        help="VLLM_CACHE_ROOT per server under this ('' to share the default)",
    )
    ap.add_argument("--served-name", default="model")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--gpu-mem",
        type=float,
        default=gpu_mem,
        help="--gpu-memory-utilization of each server (checked at start)",
    )
    ap.add_argument(
        "--kv-bytes",
        default="4e9",
        help="--kv-cache-memory-bytes of each server ('' to profile)",
    )
    ap.add_argument(
        "--engine-args",
        default=engine_args,
        help="vllm serve flags for every server",
    )


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python -m serving.serve_check",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="model directory for vllm serve")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/serve_check")
    ap.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="a server: SPEC none | "
        + " | ".join(p for p in PRESETS if p != "none")
        + " | JSON; the first is the reference (default: ref=none ngram=ngram)",
    )
    ap.add_argument(
        "--server-args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="extra vllm serve arguments for one server",
    )
    ap.add_argument(
        "--server-cmd",
        action="append",
        default=[],
        metavar="NAME=CMD",
        help="the command (taking `serve MODEL ...`) for one server, e.g. "
        "another vLLM install: 'env PYTHONPATH=... python3 -m "
        "vllm.entrypoints.cli.main'",
    )
    ap.add_argument(
        "--control",
        action="append",
        default=[],
        metavar="NAME",
        help="a negative control: a candidate expected to FAIL (e.g. upstream "
        "v0.26.0); its verdict does not decide the exit status",
    )
    ap.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="use a running server for NAME instead of launching one",
    )
    ap.add_argument("--prompts", default="fastapply", choices=["fastapply", "text"])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="prompt set seed")
    ap.add_argument(
        "--deadline",
        type=float,
        default=540.0,
        help="seconds for everything; the watchdog fires 20 s later (0: no "
        "deadline and no watchdog; every step waits for its condition)",
    )
    ap.add_argument(
        "--client-budget",
        type=float,
        default=120.0,
        help="seconds kept for the requests after the servers are up (with a deadline)",
    )
    ap.add_argument(
        "--vllm-cmd",
        default=None,
        help="command that takes `serve MODEL ...` (default: vllm on "
        "PATH, else python -m vllm.entrypoints.cli.main)",
    )
    add_server_args(
        ap,
        port=8100,
        cache_root="/tmp/serve-check-cache",
        gpu_mem=0.1,
        engine_args=QWEN35_ENGINE_ARGS,
    )
    ap.add_argument(
        "--stagger", type=float, default=2.0, help="seconds between server launches"
    )
    ap.add_argument("--logprobs", choices=["ref", "all", "none"], default="ref")
    ap.add_argument("--tie-margin", type=float, default=TIE_MARGIN)
    ap.add_argument("--no-rescore", action="store_true")
    ap.add_argument(
        "--lm-eval",
        default=None,
        metavar="TASK_DIR",
        help="run lm-eval (completions and chat) on every server",
    )
    ap.add_argument("--lm-eval-task", default="fastapply")
    ap.add_argument(
        "--lm-eval-cmd", default=f"{shlex.quote(sys.executable)} -m lm_eval"
    )
    ap.add_argument("--lm-eval-limit", type=int, default=0)
    ap.add_argument("--lm-eval-concurrency", type=int, default=16)
    a = ap.parse_args(argv)
    if not a.server:
        a.server = ["ref=none", "ngram=ngram"]
    if a.vllm_cmd is None:
        exe = shutil.which("vllm")
        a.vllm_cmd = (
            shlex.quote(exe)
            if exe
            else f"{shlex.quote(sys.executable)} -m vllm.entrypoints.cli.main"
        )
    return a


def _pairs(items, what) -> dict[str, str]:
    out = {}
    for it in items:
        if "=" not in it:
            raise CheckError(f"{what} {it!r}: expected NAME=VALUE")
        k, v = it.split("=", 1)
        out[k.strip()] = v
    return out


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    try:
        a = parse_args(argv)
        specs = _pairs(a.server, "--server")
        if len(specs) < 2:
            raise CheckError("need a reference and at least one candidate (--server)")
        servers = [ServerSpec(name, parse_spec(s)) for name, s in specs.items()]
        by_name = {s.name: s for s in servers}
        for name, extra in _pairs(a.server_args, "--server-args").items():
            if name not in by_name:
                raise CheckError(f"--server-args for unknown server {name!r}")
            by_name[name].extra = shlex.split(extra)
        for name, cmd in _pairs(a.server_cmd, "--server-cmd").items():
            if name not in by_name:
                raise CheckError(f"--server-cmd for unknown server {name!r}")
            by_name[name].cmd = cmd
        for name in a.control:
            if name not in by_name or name == servers[0].name:
                raise CheckError(f"--control {name!r}: not a candidate server")
            by_name[name].control = True
        for name, url in _pairs(a.attach, "--attach").items():
            if name not in by_name:
                raise CheckError(f"--attach for unknown server {name!r}")
            by_name[name].url, by_name[name].attached = url.rstrip("/"), True
        reqs = build_requests(a.prompts, a.n, a.seed, a.max_tokens)
    except CheckError as e:
        print(f"serve_check: error: {e}", file=sys.stderr)
        return 2
    deadline = t_start + a.deadline if a.deadline > 0 else math.inf
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    # the watchdog: whatever hangs, the servers go and the process ends
    report: dict = {}

    def fire():
        log("[serve_check] watchdog: deadline passed, stopping the servers")
        stop(servers, grace=5)
        with contextlib.suppress(Exception):
            report["verdict"] = "TIMEOUT"
            report["total_s"] = round(time.monotonic() - t_start, 1)
            (out / "serve_check.json").write_text(json.dumps(report, indent=1))
            (out / "serve_check.md").write_text(
                f"# serve_check\n\nVerdict: **TIMEOUT** after {report['total_s']} s "
                "(the watchdog stopped the servers; logs under logs/).\n"
            )
        os._exit(124)

    dog = None
    if not math.isinf(deadline):
        dog = threading.Timer(max(1.0, deadline + 20 - time.monotonic()), fire)
        dog.daemon = True
        dog.start()

    def on_signal(signum, frame):
        stop(servers, grace=5)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    report.update(
        {
            "schema": "hsfork-serve-check/1",
            "config": {
                "model": a.model,
                "prompts": a.prompts,
                "n": a.n,
                "concurrency": a.concurrency,
                "max_tokens": a.max_tokens,
                "seed": a.seed,
                "tie_margin": a.tie_margin,
                "logprobs": a.logprobs,
                "max_model_len": a.max_model_len,
                "gpu_mem": a.gpu_mem,
                "kv_bytes": a.kv_bytes,
                "engine_args": a.engine_args,
                "vllm_cmd": a.vllm_cmd,
                "deadline": a.deadline,
            },
            "reference": servers[0].name,
            "requests": [asdict(r) for r in reqs],
            "servers": [],
            "candidates": {},
            "failed": {},
        }
    )
    rc = 1
    try:
        for i, s in enumerate(servers):
            if not s.attached:
                if i and a.stagger:
                    time.sleep(a.stagger)
                launch(a, s, out / "logs")
                log(f"[serve_check] launched {s.name} on {s.url} (log {s.log})")
        ready_by = (
            t_start + max(a.deadline / 2, a.deadline - a.client_budget)
            if not math.isinf(deadline)
            else math.inf
        )
        failed = asyncio.run(wait_ready(servers, ready_by, log))
        for name in failed:
            report["failed"][name] = log_tail(by_name[name].log, 40)
        ref = servers[0]
        if ref.name in failed:
            raise CheckError("the reference server did not come up")
        live = [s for s in servers if s.name not in failed]
        if len(live) < 2:
            raise CheckError("no candidate server came up")
        scrape_s = None if math.isinf(deadline) else 20.0
        before = asyncio.run(scrape_all(live, scrape_s))
        logprobs_for = {
            "ref": {ref.name},
            "all": {s.name for s in live},
            "none": set(),
        }[a.logprobs]
        log(
            f"[serve_check] {len(reqs)} requests x {len(live)} servers, "
            f"{a.concurrency} in flight each"
        )
        results = asyncio.run(
            run_requests(
                live, reqs, a.served_name, a.concurrency, logprobs_for, deadline - 15
            )
        )
        after = asyncio.run(scrape_all(live, scrape_s))
        for s in live:
            res = results[s.name]
            toks = sum(len(r["token_ids"] or []) for r in res)
            s_info = {
                "name": s.name,
                "spec": s.spec,
                "url": s.url,
                "version": s.version,
                "ready_s": s.ready_s,
                "client_s": s.client_s,
                "errors": sum(r["error"] is not None for r in res),
                "output_tokens": toks,
                "tokens_per_s": round(toks / s.client_s, 1) if s.client_s else None,
                "exact_match": exact_match(reqs, res),
                "spec_metrics": metrics_delta(before.get(s.name), after.get(s.name)),
                "log_facts": log_facts(s.log) if s.log else [],
                "results": res,
            }
            report["servers"].append(s_info)
        ref_res = results[ref.name]
        for s in live[1:]:
            rows = compare(reqs, ref_res, results[s.name], a.tie_margin)
            for pos, row in enumerate(rows):
                row["idx_pos"] = pos
            if not a.no_rescore and time.monotonic() < deadline - 10:
                asyncio.run(
                    rescore(
                        ref.url,
                        a.served_name,
                        rows,
                        ref_res,
                        results[s.name],
                        a.tie_margin,
                        deadline - 5,
                    )
                )
            finalize(rows)
            for row in rows:
                row.pop("idx_pos", None)
            report["candidates"][s.name] = {
                "summary": summarize(rows, len(reqs)),
                "rows": rows,
            }
        for name in failed:
            report["candidates"][name] = {
                "summary": {
                    "verdict": "FAIL",
                    "error": "server did not come up",
                    "missing": len(reqs),
                },
                "rows": [],
            }
        if a.lm_eval and time.monotonic() < deadline - 30:
            report["lm_eval"] = run_lm_eval(a, live, out, deadline - 5, log)
        for name, c in report["candidates"].items():
            if by_name[name].control:
                c["control"] = True
                c["summary"]["control_outcome"] = (
                    "expected-fail"
                    if c["summary"]["verdict"] == "FAIL"
                    else "unexpected-pass (the check did not tell it apart)"
                )
        verdicts = [
            c["summary"]["verdict"]
            for name, c in report["candidates"].items()
            if not by_name[name].control
        ]
        ok = all(v in ("PASS", "PASS-TIES") for v in verdicts) and bool(verdicts)
        report["verdict"] = "PASS" if ok else "FAIL"
        rc = 0 if ok else 1
    except CheckError as e:
        log(f"[serve_check] error: {e}")
        report["verdict"] = "ERROR"
        report["error"] = str(e)
        rc = 3
    finally:
        stop(servers)
        if dog is not None:
            dog.cancel()
        for s in report["servers"]:
            s["exit_code"] = by_name[s["name"]].exit_code
        report["total_s"] = round(time.monotonic() - t_start, 1)
        (out / "serve_check.json").write_text(json.dumps(report, indent=1) + "\n")
        md = markdown(report)
        (out / "serve_check.md").write_text(md)
        print(md, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
