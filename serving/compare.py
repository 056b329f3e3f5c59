"""Comparison of each candidate server with the reference, per request:
identical (text, token ids, finish reason), or judged token by token: the
reference server scores the candidate's tokens teacher-forced
(``rescore``), and a position below the reference's top choice by less
than the tie margin is a tie (bf16 noise), by more a divergence; without
that, the first difference is judged from the reference's own top-2."""

from __future__ import annotations

import asyncio

from .servers import time_left

TIE_MARGIN = 0.05  # nats; harness.compare.TIE_MARGIN["bfloat16"]


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
