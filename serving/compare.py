"""Comparison of each candidate server with the reference, per request:
identical (text, token ids, finish reason), or judged token by token: the
reference server scores the candidate's tokens teacher-forced
(``rescore``), and a position below the reference's top choice by less
than the tie margin is a tie (numerical noise), by more a divergence;
without that, the first difference is judged from the reference's own
top-k (``prompts.TOP_K``).

The tie margin is the harness's (``harness.equivalence``): at least
``TIE_MARGIN``, and twice the noise measured on this fixture and server,
the largest difference between the top-1/top-2 gap the reference server
decoded with and the gap its teacher-forced prefill gives on the same
tokens (``rescore`` measures it on the reference's own answers)."""

from __future__ import annotations

import asyncio

from harness.compare import TIE_MARGIN as HARNESS_TIE_MARGIN
from harness.compare import Position, noise

from .servers import time_left

TIE_MARGIN = HARNESS_TIE_MARGIN["bfloat16"]  # nats
NOISE_SAMPLE = 64  # reference answers teacher-forced for the noise, at most


def first_diff(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def judge_first(ref: dict, cand: dict, pos: int, margin: float) -> dict:
    """The first token difference judged from the reference's own top-k:
    the gap from its token to the candidate's, or, for a candidate outside
    the top-k, to the last of them (a lower bound), as
    ``harness.compare.verify_run`` judges a constrained run."""
    top = ref["top"][pos] if pos < len(ref["top"]) else None
    ids = cand["token_ids"] or []
    cand_tok = ids[pos] if pos < len(ids) else None
    if not top or len(top) < 2 or cand_tok is None:
        return {"pos": pos, "gap": None, "tie": False, "cand_token": cand_tok}
    lps = {int(t): lp for t, lp in top}
    gap = top[0][1] - lps.get(cand_tok, min(lps.values()))
    tie = gap < margin
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


def _score(entry: dict | None) -> dict[int, float]:
    return {int(t): v["logprob"] for t, v in (entry or {}).items()}


def gap_noise(top: list, plp: list, start: int) -> float:
    """``harness.compare.noise`` of a served answer: the largest difference
    between the top-1/top-2 gap the reference decoded with (``top``, per
    generated token) and the gap of its teacher-forced prefill (``plp``,
    prompt logprobs from ``start``) where both rank the same two tokens
    first."""
    generated, forced = [], []
    for j, t in enumerate(top):
        entry = _score(plp[start + j]) if start + j < len(plp) else {}
        if t and entry:
            generated.append(Position.top({int(tok): lp for tok, lp in t}))
            forced.append(Position.top(entry))
    return noise(generated, forced)


def judge_forced(row: dict, gaps: list, margin: float) -> None:
    """Set ``ties``, ``divergences`` and ``status`` of a differing ``row``
    from its candidate's teacher-forced ``gaps`` (``(position, gap below
    the reference prefill's top choice)``, None: outside its top-2).

    A candidate whose every token is the prefill's choice, with as many
    tokens and the same finish as the reference's answer, differs only
    because the reference's own run took the other side of a near-tie (its
    first difference, ``row["first"]``, within ``margin``): a tie. One that
    stopped early or ran on, or whose reference was sure of its own token,
    diverged."""
    ties, divs = [], []
    for j, gap in gaps:
        if gap is None:
            divs.append({"pos": j, "gap": None})
        elif gap > 0:
            (ties if gap < margin else divs).append({"pos": j, "gap": round(gap, 4)})
    row["ties"], row["divergences"] = ties, divs
    row["status"] = "diverged" if divs else "tie"
    row["judged"] = "teacher-forced"
    if ties or divs:
        return
    first_gap = (row.get("first") or {}).get("gap")
    same_shape = row.get("same_finish") and row.get("ref_tokens") == row.get(
        "cand_tokens"
    )
    if same_shape and first_gap is not None and first_gap < margin:
        row["reason"] = (
            "every candidate token is the reference prefill's choice; the "
            "reference's own run took the other side of a near-tie"
        )
        return
    row["status"] = "diverged"
    row["reason"] = "greedy-consistent tokens, different length or stop"


async def rescore(url, model, rows, ref_res, cand_res, margin, deadline) -> dict:
    """Judge every differing request token by token: the reference server
    scores prompt + candidate tokens teacher-forced; sets ``ties``,
    ``divergences`` and ``status`` (tie | diverged) in the rows. It also
    scores up to ``NOISE_SAMPLE`` of the reference's own answers (the
    differing ones first, then matching ones) to measure the noise
    (``gap_noise``);
    the margin judged with is ``max(margin, 2 * noise)``, returned with the
    noise and how many answers it was measured on."""
    import aiohttp

    def scorable(row, res):
        return (
            ref_res[row["idx_pos"]]["prompt_token_ids"] is not None
            and res[row["idx_pos"]]["token_ids"] is not None
        )

    todo = [r for r in rows if r["status"] == "differs" and scorable(r, cand_res)]
    same = [r for r in rows if r["status"] == "match" and scorable(r, ref_res)]
    # each reference answer once: rows of a request sent many times share it
    # (serving.soak replays each distinct request once)
    seen: set[int] = set()

    def new_answer(r) -> bool:
        key = id(ref_res[r["idx_pos"]])
        fresh = key not in seen
        seen.add(key)
        return fresh

    # at most NOISE_SAMPLE answers, the differing ones' first: a soak's long
    # answers differ by the hundred (near-ties past the end of text), and
    # teacher-forcing each reference too doubled the requests that had to
    # finish before the deadline
    noisy = [r for r in todo if scorable(r, ref_res) and new_answer(r)]
    noisy += [r for r in same if new_answer(r)]
    noisy = noisy[:NOISE_SAMPLE]

    async def forced(session, row, tokens) -> tuple[list, str | None]:
        prompt = list(ref_res[row["idx_pos"]]["prompt_token_ids"])
        body = {
            "model": model,
            "prompt": prompt + list(tokens),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 2,
        }
        try:
            async with session.post(
                url + "/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=time_left(deadline)),
            ) as r:
                if r.status != 200:
                    return [], f"HTTP {r.status}: {(await r.text())[:300]}"
                data = await r.json()
        except Exception as e:  # noqa: BLE001 - recorded
            return [], f"{type(e).__name__}: {e}"[:300]
        return data["choices"][0].get("prompt_logprobs") or [], None

    async def noise_of(session, row) -> float | None:
        ref = ref_res[row["idx_pos"]]
        plp, err = await forced(session, row, ref["token_ids"])
        if err:
            return None
        return gap_noise(ref.get("top") or [], plp, len(ref["prompt_token_ids"]))

    async def cand_gaps(session, row) -> list | None:
        cand = list(cand_res[row["idx_pos"]]["token_ids"])
        plp, err = await forced(session, row, cand)
        if err:
            row["rescore_error"] = err
            return None
        start = len(ref_res[row["idx_pos"]]["prompt_token_ids"])
        gaps = []  # (position, gap below the top choice; None: not scored)
        for j, tok in enumerate(cand):
            lps = _score(plp[start + j] if start + j < len(plp) else None)
            if not lps:
                continue
            got = lps.get(tok)
            gaps.append((j, None if got is None else max(lps.values()) - got))
        return gaps

    noise, gaps = [], []
    if todo or noisy:
        async with aiohttp.ClientSession() as session:
            # the candidates' rows first: the verdict needs each of them,
            # the noise only a sample. The session holds 100 connections
            # and queues the rest; a request still queued at the deadline
            # fails, and hundreds of long noise answers queued ahead once
            # left differing rows unscored
            gaps, noise = await asyncio.gather(
                asyncio.gather(*(cand_gaps(session, r) for r in todo)),
                asyncio.gather(*(noise_of(session, r) for r in noisy)),
            )
    measured = [n for n in noise if n is not None]
    worst = max(measured, default=0.0)
    eff = max(margin, 2 * worst)
    for row, g in zip(todo, gaps, strict=True):
        if g is not None:
            judge_forced(row, g, eff)
    return {
        "noise": round(worst, 4),
        "measured_on": len(measured),
        "margin": round(eff, 4),
        "floor": margin,
    }


def finalize(rows: list[dict], margin: float | None = None) -> None:
    """Rows not judged teacher-forced: judge from the first difference,
    with ``margin`` where given (the one ``rescore`` measured) instead of
    the one ``compare`` judged with."""
    for row in rows:
        if row["status"] != "differs":
            continue
        first = row.get("first")
        if first and margin is not None and first.get("gap") is not None:
            first["tie"] = first["gap"] < margin
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
