"""The request sets ``serving.serve_check`` sends: held-out fast-apply
prompts with their known answers, or heterogeneous text and code prompts for
a general model; each request's endpoint (completions or chat) and stream
mode rotate, and ``payload`` is its OpenAI-compatible body (greedy, token ids
returned, top-k log-probabilities where asked: ``TOP_K``)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from . import CheckError

# logprobs a reference returns per generated token: the first difference of
# a structured-output answer is judged from them (serving.compare)
TOP_K = 5


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
            body["logprobs"] = TOP_K
    else:
        body["messages"] = req.messages
        if logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = TOP_K
    if logprobs:
        body["return_tokens_as_token_ids"] = True
    return body
