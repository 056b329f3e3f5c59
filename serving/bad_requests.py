"""Malformed requests against a running speculative ``vllm serve``: each
must get a 4xx answer, never a 5xx, a hang or a dead server (issue:
reliability, bad input).

    python -m serving bad-requests --url http://127.0.0.1:8000 --model NAME \\
        --max-model-len 4096 --out OUT

Every case is one request (``CASES``: negative or oversized ``max_tokens``,
a prompt over ``max_model_len``, out-of-range sampling parameters, too many
log-probabilities, an invalid structured-output regex, a speculative config
inside a request, an unknown model, an empty chat, wrong types, a body that
is not JSON), sent alone, each with a hang guard (``--timeout``); after
them ``/health`` must still answer 200 and one well-formed request must
still be served. Writes ``OUT/bad_requests.json`` and the table
``OUT/bad_requests.md`` (case, request, status, the error's first line).

Why by hand: vLLM's own tests check its validators one by one, in process;
this asks a served engine with speculation over HTTP, as a client would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import NamedTuple


class Case(NamedTuple):
    name: str
    path: str  # /v1/completions | /v1/chat/completions
    body: object  # a dict, or raw bytes (not JSON)
    why: str
    # "4xx", or "not 5xx" where vLLM documents another answer
    expect: str = "4xx"


def cases(model: str, max_model_len: int) -> list[Case]:
    comp, chat = "/v1/completions", "/v1/chat/completions"

    def c(**kw) -> dict:
        return {"model": model, "prompt": "t1 t2 t3", "max_tokens": 8, **kw}

    long_prompt = list(range(1, 200)) * (max_model_len // 199 + 2)
    return [
        Case("negative max_tokens", comp, c(max_tokens=-1), "max_tokens < 0"),
        Case(
            "max_tokens over the context",
            comp,
            c(max_tokens=max_model_len * 2),
            "prompt + max_tokens > max_model_len",
        ),  # fmt: skip
        Case(
            "prompt over max_model_len",
            comp,
            c(prompt=long_prompt[: max_model_len + 64]),
            "a token-id prompt longer than max_model_len",
        ),  # fmt: skip
        Case("negative temperature", comp, c(temperature=-1.0), "temperature < 0"),
        Case("top_p above 1", comp, c(top_p=2.0), "top_p > 1"),
        Case("n = 0", comp, c(n=0), "n < 1"),
        Case("too many logprobs", comp, c(logprobs=10_000), "logprobs > max_logprobs"),
        Case(
            "invalid regex",
            comp,
            c(structured_outputs={"regex": "(["}),
            "structured output that does not compile",
        ),  # fmt: skip
        Case(
            "speculative config in a request",
            comp,
            c(speculative_config={"num_speculative_tokens": -1}),
            "speculation is a server setting; vLLM ignores (and logs) request "
            "fields it does not know",
            "not 5xx",
        ),  # fmt: skip
        Case(
            "unknown model",
            comp,
            dict(c(), model="no-such-model"),
            "a model the server does not serve",
        ),  # fmt: skip
        Case(
            "empty chat",
            chat,
            {"model": model, "messages": [], "max_tokens": 8},
            "no messages",
        ),  # fmt: skip
        Case(
            "max_tokens of the wrong type",
            comp,
            c(max_tokens="many"),
            "a string for an integer",
        ),  # fmt: skip
        Case("stop of the wrong type", comp, c(stop=7), "an integer for a string"),
        Case("body not JSON", comp, b"{not json", "a malformed body"),
    ]


async def send(session, url: str, case: Case, timeout: float) -> dict:
    import aiohttp

    kw: dict = {"timeout": aiohttp.ClientTimeout(total=timeout)}
    if isinstance(case.body, bytes):
        kw.update(data=case.body, headers={"Content-Type": "application/json"})
    else:
        kw["json"] = case.body
    try:
        async with session.post(url + case.path, **kw) as r:
            text = await r.text()
            err = _first_line(text) if r.status >= 400 else ""
            return {"status": r.status, "error": err}
    except TimeoutError:
        return {"status": None, "error": f"no answer within {timeout:.0f} s (hang)"}
    except Exception as e:  # noqa: BLE001 - recorded per case
        return {"status": None, "error": f"{type(e).__name__}: {e}"[:300]}


def _first_line(text: str) -> str:
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", err) if isinstance(err, dict) else err
        text = str(msg)
    except (json.JSONDecodeError, AttributeError):
        pass
    return text.strip().splitlines()[0][:240] if text.strip() else ""


def verdict(row: dict) -> str:
    s = row["status"]
    if s is None:
        return "no answer"
    if 400 <= s < 500:
        return "4xx"
    if s >= 500:
        return "5xx"
    return "accepted"


async def run(url: str, model: str, max_model_len: int, timeout: float) -> dict:
    import aiohttp

    rows = []
    async with aiohttp.ClientSession() as session:
        for case in cases(model, max_model_len):
            got = await send(session, url, case, timeout)
            body = case.body if not isinstance(case.body, bytes) else case.body.decode()
            shown = json.dumps(body)[:160] if not isinstance(body, str) else body
            row = {"case": case.name, "why": case.why, "request": shown, **got}
            row["verdict"] = verdict(row)
            row["expected"] = case.expect
            row["ok"] = row["verdict"] == "4xx" or (
                case.expect == "not 5xx" and row["verdict"] == "accepted"
            )
            rows.append(row)
        try:
            async with session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                healthy = r.status == 200
        except Exception:  # noqa: BLE001 - a dead server
            healthy = False
        good = await send(
            session,
            url,
            Case("well-formed", "/v1/completions",
                 {"model": model, "prompt": "t1 t2 t3", "max_tokens": 4}, ""),
            timeout,
        )  # fmt: skip
    ok = all(r["ok"] for r in rows) and healthy and good["status"] == 200
    return {
        "verdict": "PASS" if ok else "FAIL",
        "rows": rows,
        "healthy_after": healthy,
        "well_formed_after": good,
    }


def markdown(rep: dict) -> str:
    lines = [
        f"# Malformed requests: {rep['verdict']}",
        "",
        "| case | request | status | verdict | expected | error (first line) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        req = r["request"].replace("|", "/")
        err = (r["error"] or "").replace("|", "/")
        lines.append(
            f"| {r['case']} | `{req}` | {r['status']} | {r['verdict']}"
            f"{'' if r['ok'] else ' **unexpected**'} | {r['expected']} | {err} |"
        )
    lines += [
        "",
        f"`/health` after: {'200' if rep['healthy_after'] else 'FAILED'}; a "
        f"well-formed request after: HTTP {rep['well_formed_after']['status']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m serving.bad_requests", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=120.0, help="hang guard per case")
    ap.add_argument("--out", default="out/bad_requests")
    a = ap.parse_args(argv)
    rep = asyncio.run(run(a.url.rstrip("/"), a.model, a.max_model_len, a.timeout))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bad_requests.json").write_text(json.dumps(rep, indent=1))
    (out / "bad_requests.md").write_text(markdown(rep))
    print(markdown(rep))
    return 0 if rep["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
