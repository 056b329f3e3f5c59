"""A fake of ``vllm serve``'s OpenAI-compatible API, for CPU tests of
``serving.serve_check`` and of the lm-eval task (no model, no GPU).

It takes ``vllm serve``'s command line (``MODEL --port P [--host H]
[--served-model-name N] [--speculative-config JSON] ...``; other vLLM flags
are ignored) and serves ``/health``, ``/version``, ``/v1/models``,
``/metrics`` (spec-decode counters when a speculative config is given),
``/v1/completions`` and ``/v1/chat/completions`` (streaming and not;
``return_token_ids``, ``logprobs``/``top_logprobs``,
``return_tokens_as_token_ids``, ``prompt_logprobs``, ``stop``,
``max_tokens``, ``stream_options.include_usage``) in vLLM's response
layout. Greedy "models":

- ``--fake-mode model``: words hash to ids 1..999 (the word ``t<n>`` is id
  ``n``), token ``i`` reads `` w<i>``; the next token is a function of the
  last two; its top-1/top-2 log-probability gap is 2.0, or 0.01 at "tie"
  positions (next id divisible by 11); no EOS (runs to ``max_tokens``);
- ``--fake-mode fastapply``: the fast-apply oracle: prompts are
  ``harness.fastapply`` prompts as text (``t<id>`` words, see
  ``serving.make_model.prompt_text``); the answer is the span with the
  renames applied, then EOS (id 255, not in the text), each token `` t<id>``.

``--fake-perturb decisive`` makes the server a wrong candidate: for one
request in four (by prompt hash) it emits the second choice at output
position 5, where the gap is decisive. ``--fake-perturb ties`` emits the
second choice at every tie position (a harmless divergence), and
``--fake-perturb fail`` answers one request in four with HTTP 500.
``--fake-restart-perturb PERTURB MARKER`` perturbs only a server started
again (after a kill: the marker file exists). ``--fake-prefill-noise X``
widens every top-1/top-2 gap of ``prompt_logprobs`` by X nats: the prefill
disagrees with the decode, as kernel paths of a real model do.
``--fake-startup-s`` delays ``/health``; ``--fake-exit-s`` makes the server
exit early (a crash), and ``--fake-crash-on-request`` makes it exit at its
first generation request (a crash that no timing can hide).
``--fake-engine-child`` starts a child process whose command line names
``EngineCore``, as vLLM's engine core does: once it is gone, ``/health``
answers 503 and every generation request an HTTP 500 naming the dead
engine (what ``vllm serve`` does when its engine core dies).
``n`` > 1 (not streamed) returns that many choices (the same completion).

    python -m serving.fake_server MODEL --port 8100 [--fake-mode fastapply]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import zlib
from pathlib import Path

V = 1000
EOS_FA = 255
TIE_GAP, GAP = 0.01, 2.0
TOP1_LP = -0.05


class FakeModel:
    def __init__(self, mode: str, perturb: str):
        self.mode, self.perturb = mode, perturb

    # -- tokens ------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w[0] == "t" and w[1:].isdigit():
                ids.append(int(w[1:]) % V)
            else:
                ids.append(1 + zlib.crc32(w.encode()) % (V - 1))
        return ids

    def piece(self, tok: int) -> str:
        if self.mode == "fastapply":
            return "" if tok == EOS_FA else f" t{tok}"
        return f" w{tok}"

    def eos(self) -> int | None:
        return EOS_FA if self.mode == "fastapply" else None

    # -- greedy distribution -----------------------------------------------

    def top2(self, ctx: list[int]) -> tuple[int, int, float]:
        """(top-1, top-2, gap) after ``ctx``."""
        if self.mode == "fastapply":
            from harness import fastapply as fa

            if fa.ANSWER in ctx:
                cut = ctx.index(fa.ANSWER) + 1
                answer = _oracle(ctx[:cut])
                pos = len(ctx) - cut
                tok = answer[pos] if pos < len(answer) else EOS_FA
            else:
                tok = EOS_FA
            return tok, (tok + 1) % 240, GAP
        a = ctx[-1] if ctx else 0
        b = ctx[-2] if len(ctx) > 1 else 0
        tok = 1 + (a * 31 + b * 17 + 7) % (V - 1)
        second = 1 + tok % (V - 1)
        return tok, second, TIE_GAP if tok % 11 == 0 else GAP

    def generate(self, prompt: list[int], max_tokens: int, key: int):
        """Greedy ids with (top1, top2, gap) per position, perturbed as
        configured."""
        ctx = list(prompt)
        out, dists = [], []
        for pos in range(max_tokens):
            t1, t2, gap = self.top2(ctx)
            tok = t1
            decisive = self.perturb == "decisive" and key % 4 == 0 and pos == 5
            if decisive or (self.perturb == "ties" and gap == TIE_GAP):
                tok = t2
            out.append(tok)
            dists.append((t1, t2, gap))
            ctx.append(tok)
            if tok == self.eos():
                break
        return out, dists


def _oracle(prompt: list[int]) -> list[int]:
    """The fast-apply answer of a prompt (renamed span + EOS)."""
    from harness import fastapply as fa

    mapping = {}
    i = 0
    while i + 2 < len(prompt) and prompt[i] == fa.RENAME:
        mapping[prompt[i + 1]] = prompt[i + 2]
        i += 3
    try:
        span = prompt[prompt.index(fa.SPAN) + 1 : prompt.index(fa.END)]
    except ValueError:
        return [EOS_FA]
    return [mapping.get(t, t) for t in span] + [EOS_FA]


def _lp_token(tok: int, as_ids: bool, model: FakeModel) -> str:
    return f"token_id:{tok}" if as_ids else model.piece(tok)


class Server:
    def __init__(self, a: argparse.Namespace, spec: dict | None):
        self.a = a
        self.spec = spec
        perturb = a.fake_perturb
        if a.fake_restart_perturb:
            # a server started again (its marker file exists) perturbs as
            # asked: a restart that answers otherwise than before
            marker = Path(a.fake_restart_perturb[1])
            if marker.exists():
                perturb = a.fake_restart_perturb[0]
            marker.touch()
        self.model = FakeModel(a.fake_mode, perturb)
        self.t0 = time.time()
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
        self.per_pos: dict[int, int] = {}
        self.gen_tokens = 0
        self.answered = 0
        self.preemptions = 0
        self.n = 0

    def _count(self, n_tokens: int) -> None:
        """Spec-decode counters as if every 4 tokens were one step with k
        drafts of which 3 were accepted."""
        self.gen_tokens += n_tokens
        self.answered += 1
        every = self.a.fake_preempt_every
        if every and self.answered % every == 0:
            self.preemptions += 1
        if not self.spec:
            return
        k = int(self.spec.get("num_speculative_tokens", 1))
        steps = (n_tokens + 3) // 4
        acc = min(3, k)
        self.counters["drafts"] += steps
        self.counters["draft_tokens"] += steps * k
        self.counters["accepted"] += steps * acc
        for p in range(acc):
            self.per_pos[p] = self.per_pos.get(p, 0) + steps

    def metrics_text(self) -> str:
        lab = f'engine="0",model_name="{self.a.served_model_name}"'
        lines = [
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lab}}} {float(self.gen_tokens)}",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{lab}}} {float(self.preemptions)}",
        ]
        if self.spec:
            c = self.counters
            lines += [
                "# TYPE vllm:spec_decode_num_drafts_total counter",
                f"vllm:spec_decode_num_drafts_total{{{lab}}} {float(c['drafts'])}",
                f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} "
                f"{float(c['draft_tokens'])}",
                f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} "
                f"{float(c['accepted'])}",
            ]
            for p, v in sorted(self.per_pos.items()):
                lines.append(
                    f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},"
                    f'position="{p}"}} {float(v)}'
                )
        return "\n".join(lines) + "\n"

    # -- request handling ----------------------------------------------------

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            parts = []
            for m in body["messages"]:
                c = m["content"]
                if not isinstance(c, str):
                    c = "".join(p.get("text", "") for p in c)
                if self.a.fake_mode != "fastapply":
                    c = f"{m['role']} {c}"
                parts.append(c)
            return self.model.tokenize(" ".join(parts))
        p = body["prompt"]
        if isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, list):
            return [int(x) for x in p]
        return self.model.tokenize(p)

    def run(self, body: dict, chat: bool):
        prompt = self._prompt(body, chat)
        max_tokens = int(
            body.get("max_completion_tokens") or body.get("max_tokens") or 16
        )
        key = zlib.crc32(json.dumps(prompt).encode())
        if self.a.fake_perturb == "fail" and key % 4 == 1:
            raise RuntimeError("injected failure")
        ids, dists = self.model.generate(prompt, max_tokens, key)
        eos = self.model.eos()
        finish = "stop" if ids and ids[-1] == eos else "length"
        stops = body.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        text = ""
        for i, t in enumerate(ids):
            text += self.model.piece(t)
            hit = next((s for s in stops if s and s in text), None)
            if hit:
                text = text[: text.index(hit)]
                ids, dists = ids[: i + 1], dists[: i + 1]
                finish = "stop"
                break
        self._count(len(ids))
        return prompt, ids, dists, text, finish

    def prompt_logprobs(self, prompt: list[int], k: int):
        out: list = [None]
        for j in range(1, len(prompt)):
            t1, t2, gap = self.model.top2(prompt[:j])
            d = {
                str(t1): {
                    "logprob": TOP1_LP,
                    "rank": 1,
                    "decoded_token": self.model.piece(t1),
                },
            }
            gap += self.a.fake_prefill_noise
            if k >= 2:
                d[str(t2)] = {
                    "logprob": TOP1_LP - gap,
                    "rank": 2,
                    "decoded_token": self.model.piece(t2),
                }
            act = prompt[j]
            if str(act) not in d:
                lp, rank = (TOP1_LP - gap, 2) if act == t2 else (-20.0, 999)
                d[str(act)] = {
                    "logprob": lp,
                    "rank": rank,
                    "decoded_token": self.model.piece(act),
                }
            out.append(d)
        return out


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m serving.fake_server")
    ap.add_argument("model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--speculative-config", default=None)
    ap.add_argument("--fake-mode", choices=["model", "fastapply"], default="model")
    ap.add_argument(
        "--fake-perturb", choices=["none", "decisive", "ties", "fail"], default="none"
    )
    ap.add_argument("--fake-startup-s", type=float, default=0.0)
    ap.add_argument("--fake-exit-s", type=float, default=0.0)
    ap.add_argument("--fake-crash-on-request", action="store_true")
    ap.add_argument("--fake-engine-child", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--fake-prefill-noise", type=float, default=0.0)
    ap.add_argument(
        "--fake-restart-perturb",
        nargs=2,
        metavar=("PERTURB", "MARKER"),
        default=None,
        help="perturb as PERTURB when started again (MARKER: a file written at "
        "the first start)",
    )
    ap.add_argument(
        "--fake-preempt-every",
        type=int,
        default=0,
        help="count a preemption every N answers (vllm:num_preemptions_total)",
    )
    ap.add_argument(
        "--fake-hold-until",
        default=None,
        metavar="URL",
        help="hold every completion until URL answers HTTP 200",
    )
    ap.add_argument(
        "--fake-no-validation",
        action="store_true",
        help="answer malformed requests with HTTP 500 instead of 400",
    )
    a, _ = ap.parse_known_args(argv)
    a.served_model_name = a.served_model_name or a.model
    return a


def make_app(a: argparse.Namespace):
    from aiohttp import web

    spec = json.loads(a.speculative_config) if a.speculative_config else None
    srv = Server(a, spec)
    model = srv.model
    engine = None
    if a.fake_engine_child:
        import subprocess

        engine = subprocess.Popen(
            [sys.executable, "-c", "import time\nwhile True: time.sleep(1)",
             "EngineCore"]
        )  # fmt: skip

    def engine_dead() -> bool:
        return engine is not None and engine.poll() is not None

    async def health(request):
        if time.time() - srv.t0 < a.fake_startup_s or engine_dead():
            return web.Response(status=503)
        return web.Response(text="")

    async def version(request):
        return web.json_response({"version": "fake"})

    async def models(request):
        return web.json_response(
            {"object": "list", "data": [{"id": a.served_model_name, "object": "model"}]}
        )

    async def metrics(request):
        return web.Response(text=srv.metrics_text(), content_type="text/plain")

    def lp_entries(ids, dists, body, chat):
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        k = int(body.get("top_logprobs") or 0) if chat else int(body["logprobs"])
        rows = []
        for tok, (t1, t2, gap) in zip(ids, dists, strict=True):
            lp = {t1: TOP1_LP, t2: TOP1_LP - gap}
            top = sorted(lp.items(), key=lambda x: -x[1])[: max(k, 1)]
            rows.append((tok, lp.get(tok, -20.0), top))
        if chat:
            return {
                "content": [
                    {
                        "token": _lp_token(tok, as_ids, model),
                        "logprob": lp,
                        "bytes": None,
                        "top_logprobs": [
                            {
                                "token": _lp_token(t, as_ids, model),
                                "logprob": v,
                                "bytes": None,
                            }
                            for t, v in top
                        ],
                    }
                    for tok, lp, top in rows
                ]
            }
        return {
            "tokens": [_lp_token(t, as_ids, model) for t, _, _ in rows],
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [
                {_lp_token(t, as_ids, model): v for t, v in top} for _, _, top in rows
            ],
            "text_offset": [0] * len(rows),
        }

    def want_lp(body, chat):
        return bool(body.get("logprobs")) if chat else body.get("logprobs") is not None

    def bad_request(message: str):
        return web.json_response(
            {"error": {"message": message, "type": "BadRequestError"}}, status=400
        )

    def invalid(body: dict, chat: bool) -> str | None:
        """What vLLM's request validation would refuse (a few of its checks)."""
        import re

        mt = body.get("max_tokens", 16)
        if not isinstance(mt, int) or isinstance(mt, bool):
            return "max_tokens: Input should be a valid integer"
        if mt < 0:
            return "max_tokens must be at least 0"
        if chat and not body.get("messages"):
            return "messages: the list is empty"
        if not isinstance(body.get("stop", []), (str, list)):
            return "stop: Input should be a valid string or list"
        if float(body.get("temperature", 0) or 0) < 0:
            return "temperature must be non-negative"
        if float(body.get("top_p", 1) or 1) > 1:
            return "top_p must be in (0, 1]"
        if int(body.get("n", 1)) < 1:
            return "n must be at least 1"
        lp = body.get("logprobs")
        if not chat and isinstance(lp, int) and lp > 20:
            return "logprobs: at most 20"
        regex = (body.get("structured_outputs") or {}).get("regex")
        if regex is not None:
            try:
                re.compile(regex)
            except re.error as e:
                return f"invalid regex: {e}"
        prompt = body.get("prompt")
        n_prompt = (
            len(prompt) if isinstance(prompt, list) else len(str(prompt or "").split())
        )
        if n_prompt + mt > a.max_model_len:
            return (
                f"This model's maximum context length is {a.max_model_len} tokens; "
                f"the request has {n_prompt} prompt tokens and max_tokens {mt}"
            )
        return None

    async def hold():
        # --fake-hold-until: answer nothing until that URL answers 200 (a
        # test's condition, e.g. the reference server being up)
        import aiohttp

        async with aiohttp.ClientSession() as s:
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(a.fake_hold_until) as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.05)

    async def handle(request, chat: bool):
        if a.fake_crash_on_request:
            os._exit(3)
        if a.fake_hold_until:
            await hold()
        if engine_dead():
            return web.json_response(
                {"error": {"message": "EngineCore encountered an issue",
                           "type": "EngineDeadError"}},
                status=500,
            )  # fmt: skip
        try:
            body = await request.json()
        except ValueError:
            return bad_request("the body is not valid JSON")
        if body.get("model") != a.served_model_name:
            return web.json_response(
                {"error": {"message": f"The model `{body.get('model')}` does not "
                           "exist.", "type": "NotFoundError"}},
                status=404,
            )  # fmt: skip
        problem = invalid(body, chat)
        if problem:
            if a.fake_no_validation:
                return web.json_response(
                    {"error": {"message": problem, "type": "InternalServerError"}},
                    status=500,
                )
            return bad_request(problem)
        srv.n += 1
        try:
            prompt, ids, dists, text, finish = srv.run(body, chat)
        except Exception as e:  # noqa: BLE001 - reported to the client
            return web.json_response(
                {"error": {"message": str(e), "type": "InternalServerError"}},
                status=500,
            )
        rid = f"fake-{srv.n}"
        tok_ids = bool(body.get("return_token_ids"))
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        }
        if not body.get("stream"):
            lp = lp_entries(ids, dists, body, chat) if want_lp(body, chat) else None
            choice = {
                "index": 0,
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": ids if tok_ids else None,
            }
            resp = {
                "id": rid,
                "created": int(time.time()),
                "model": a.served_model_name,
                "usage": usage,
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                resp["object"] = "chat.completion"
                resp["prompt_token_ids"] = prompt if tok_ids else None
            else:
                choice["text"] = text
                choice["prompt_token_ids"] = prompt if tok_ids else None
                pl = body.get("prompt_logprobs")
                choice["prompt_logprobs"] = (
                    srv.prompt_logprobs(prompt, int(pl)) if pl is not None else None
                )
                resp["object"] = "text_completion"
            n = int(body.get("n") or 1)
            resp["choices"] = [dict(choice, index=j) for j in range(n)]
            return web.json_response(resp)
        # streaming: chunks of 1-4 tokens, text cut to what the ids say
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)

        async def send(obj):
            await out.write(f"data: {json.dumps(obj)}\n\n".encode())

        base = {
            "id": rid,
            "created": int(time.time()),
            "model": a.served_model_name,
            "object": "chat.completion.chunk" if chat else "text_completion",
        }
        if chat:
            first = dict(
                base,
                choices=[
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            first["prompt_token_ids"] = prompt if tok_ids else None
            await send(first)
        pieces = [model.piece(t) for t in ids]
        sent = 0
        i = 0
        while i < len(ids):
            n = 1 + (i * 7 + len(prompt)) % 4
            j = min(len(ids), i + n)
            chunk_text = "".join(pieces[i:j])
            # the stop string cut: never send past the final text
            chunk_text = chunk_text[: max(0, len(text) - sent)]
            sent += len(chunk_text)
            lp = (
                lp_entries(ids[i:j], dists[i:j], body, chat)
                if want_lp(body, chat)
                else None
            )
            c = {
                "index": 0,
                "logprobs": lp,
                "finish_reason": finish if j == len(ids) else None,
                "token_ids": ids[i:j] if tok_ids else None,
            }
            if chat:
                c["delta"] = {"content": chunk_text}
            else:
                c["text"] = chunk_text
                if i == 0:
                    c["prompt_token_ids"] = prompt if tok_ids else None
            await send(dict(base, choices=[c]))
            await asyncio.sleep(0)
            i = j
        if (body.get("stream_options") or {}).get("include_usage"):
            await send(dict(base, choices=[], usage=usage))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def completions(request):
        return await handle(request, chat=False)

    async def chat(request):
        return await handle(request, chat=True)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def main(argv: list[str] | None = None) -> int:
    from aiohttp import web

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":  # accept `vllm serve MODEL ...` shape
        args = args[1:]
    a = _parse(args)
    if a.fake_exit_s:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.call_later(a.fake_exit_s, lambda: os._exit(3))
        web.run_app(make_app(a), host=a.host, port=a.port, print=None, loop=loop)
    else:
        web.run_app(make_app(a), host=a.host, port=a.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
