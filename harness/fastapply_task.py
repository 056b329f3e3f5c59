"""The fast-apply task: its vocabulary, the (prompt, answer) generator, the
curriculum's difficulty levels, and vLLM's n-gram proposer replayed on
token lists.

Pure Python (no torch, no vLLM), and independent of the equivalence matrix:
``harness.equivalence`` takes the trained fixture's prompts from here, and
``harness.fastapply`` (training, evaluation, the vLLM runs) builds on it and
re-exports every name. The task's design, and why it is learnable in a few
GPU minutes, is in ``harness.fastapply``'s docstring.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .models import EOS_ID, FIRST_SPECIAL_ID, VOCAB

# ---------------------------------------------------------------------------
# vocabulary

CODE_WORDS = (
    "<nl>",
    "<in>",
    "(",
    ")",
    ",",
    ":",
    "=",
    "+",
    "-",
    "*",
    ".",
    "[",
    "]",
    "==",
    "return",
    "def",
    "if",
    "for",
    "in",
    "while",
    "else",
    "not",
    "and",
    "None",
    "self",
    "0",
    "1",
    "2",
    "<",
    ">",
    "+=",
    "len",
)
_W = {w: i for i, w in enumerate(CODE_WORDS)}
NL, INDENT = _W["<nl>"], _W["<in>"]
IDENT_LO = len(CODE_WORDS)  # 32
# markers: below the special ids of harness.models (prompts stay < 250)
FILE, SPAN, END, RENAME, ANSWER = range(240, 245)
IDENT_HI = FILE  # identifiers are ids 32..239
MARKERS = {
    FILE: "<file>",
    SPAN: "<span>",
    END: "</span>",
    RENAME: "<rename>",
    ANSWER: "<answer>",
    EOS_ID: "<eos>",
}
assert IDENT_HI <= FIRST_SPECIAL_ID and VOCAB > EOS_ID

# any ORDER consecutive tokens of the code region determine the next one
ORDER = 3
# identifiers per example (span; the context draws as many of its own)
SPAN_POOL = (10, 20)
ZIPF = 0.5
PROMPT_MAX = 300

_TOP = (
    "I = I ( I )",
    "I = I ( I , I )",
    "I = I . I ( I )",
    "I = I [ K ]",
    "I = I + I",
    "I . I ( I , K )",
    "I = I ( I . I , I )",
    "I = I * K",
)
_OPEN = (
    "def I ( I , I ) :",
    "def I ( self , I ) :",
    "if I == I :",
    "if not I :",
    "for I in I :",
    "for I in I ( I ) :",
    "while I < K :",
    "if I > K and I :",
)
_BODY = (
    "I = I ( I )",
    "I . I ( I )",
    "return I",
    "return I + I",
    "I += K",
    "I [ I ] = I",
    "I = len ( I )",
    "I = I . I",
    "self . I = I",
    "I = I ( I , I )",
    "return I ( I )",
)
_LITERALS = ("0", "1", "2", "None")
_LENGTH = {t: len(t.split()) + 1 for t in _TOP + _OPEN + _BODY}  # with <nl>


def detok(ids) -> str:
    """Readable text of ids (for debugging and reports)."""
    out = []
    for t in ids:
        if t < IDENT_LO:
            out.append(CODE_WORDS[t])
        elif t in MARKERS:
            out.append(MARKERS[t])
        else:
            out.append(f"v{t}")
    return " ".join(out).replace(" <nl> ", "\n").replace("<in> ", "    ")


# ---------------------------------------------------------------------------
# task generator


@dataclass(frozen=True)
class Difficulty:
    span_min: int = 40  # answer length before EOS, in tokens
    span_max: int = 120
    ctx_max: int = 200  # file context around the span, in tokens (total)
    renames_min: int = 1
    renames_max: int = 3


FULL = Difficulty()


class _Region:
    """A token sequence that stays deterministic at order ``ORDER``."""

    def __init__(self, start: list[int]):
        self.tokens = list(start)
        self.next: dict[tuple, int] = {}
        self._index(0)

    def _index(self, lo: int) -> None:
        t = self.tokens
        for i in range(max(ORDER, lo), len(t)):
            self.next[tuple(t[i - ORDER : i])] = t[i]

    def fits(self, extra: list[int]) -> bool:
        t = self.tokens[-ORDER:] + extra
        seen = {}
        for i in range(ORDER, len(t)):
            ctx = tuple(t[i - ORDER : i])
            want = self.next.get(ctx, seen.get(ctx, t[i]))
            if want != t[i]:
                return False
            seen[ctx] = t[i]
        return True

    def add(self, extra: list[int]) -> None:
        lo = len(self.tokens)
        self.tokens += extra
        self._index(lo)


def _line(rng: random.Random, pool, weights, template: str, indent: bool):
    out = [INDENT] if indent else []
    for w in template.split():
        if w == "I":
            out.append(rng.choices(pool, weights)[0])
        elif w == "K":
            out.append(_W[rng.choice(_LITERALS)])
        else:
            out.append(_W[w])
    out.append(NL)
    return out


def _code(rng, region: _Region, pool, budget: int, at_least: int) -> list[int]:
    """Lines appended to ``region`` until ``budget`` tokens would be
    exceeded (at least ``at_least`` tokens when possible)."""
    weights = [1.0 / (k + 1) ** ZIPF for k in range(len(pool))]
    out: list[int] = []
    indent = False
    misses = 0
    while misses < 200:
        if indent and rng.random() < 0.75:
            template, ind = rng.choice(_BODY), True
        else:
            template, ind = rng.choice(_OPEN if rng.random() < 0.3 else _TOP), False
        if len(out) + _LENGTH[template] + ind > budget:
            misses += 1
            if len(out) >= at_least and misses > 40:
                break
            continue
        line = _line(rng, pool, weights, template, ind)
        if not region.fits(line):
            misses += 1
            if len(out) >= at_least and misses > 40:
                break
            continue
        region.add(line)
        out += line
        indent = template.endswith(":") or (ind and rng.random() < 0.6)
    return out


def make_example(
    rng: random.Random, difficulty: Difficulty = FULL
) -> tuple[list[int], list[int]]:
    """One (prompt_ids, answer_ids); the answer ends with EOS."""
    d = difficulty
    while True:
        idents = rng.sample(range(IDENT_LO, IDENT_HI), 48)
        span_pool = idents[: rng.randint(*SPAN_POOL)]
        # file context: mostly its own names, a couple shared with the span
        ctx_pool = idents[24 : 24 + rng.randint(*SPAN_POOL)] + span_pool[:2]
        rng.shuffle(ctx_pool)
        fresh = idents[44:]
        target = rng.randint(d.span_min, d.span_max)
        # prompts stay within PROMPT_MAX (markers and instructions: <= 13)
        ctx_total = rng.randint(0, max(0, min(d.ctx_max, PROMPT_MAX - 13 - target)))
        before = rng.randint(0, ctx_total)
        region = _Region([FILE])
        ctx_a = _code(rng, region, ctx_pool, before, 0)
        if not region.fits([SPAN]):
            continue
        region.add([SPAN])
        span = _code(rng, region, span_pool, target, min(d.span_min, target))
        # the span's end (EOS) must be as determined as the rest
        if len(span) < min(d.span_min, target) or not region.fits([END]):
            continue
        region.add([END])
        ctx_b = _code(rng, region, ctx_pool, ctx_total - len(ctx_a), 0)
        names = sorted(set(span) - set(range(IDENT_LO)))
        hi = min(d.renames_max, len(names))
        n = rng.randint(min(d.renames_min, hi), hi)
        olds = rng.sample(names, n)
        mapping = dict(zip(olds, fresh[:n], strict=True))
        edits = []
        for old, new in mapping.items():
            edits += [RENAME, old, new]
        prompt = [*edits, FILE, *ctx_a, SPAN, *span, END, *ctx_b, ANSWER]
        answer = [mapping.get(t, t) for t in span] + [EOS_ID]
        return prompt, answer


def make_eval_set(n: int, seed: int, difficulty: Difficulty = FULL):
    """``n`` (prompt, answer) pairs at full difficulty, deterministic in
    ``seed`` (training draws from other seeds)."""
    rng = random.Random(f"fastapply-eval-{seed}")
    return [make_example(rng, difficulty) for _ in range(n)]


def difficulty(level: float) -> Difficulty:
    """The curriculum's ceiling at ``level`` in [0, 1]: at 0, pure copies of
    at most 12 tokens without file context; renames from 0.1 (all three by
    0.35), file context from 0.15 (full by 0.6), span length full by 0.45."""

    def ramp(lo: float, hi: float) -> float:
        return min(1.0, max(0.0, (level - lo) / (hi - lo)))

    return Difficulty(
        span_min=round(6 + (FULL.span_min - 6) * ramp(0.2, 0.6)),
        span_max=round(12 + (FULL.span_max - 12) * ramp(0.0, 0.45)),
        ctx_max=round(FULL.ctx_max * ramp(0.15, 0.6)),
        renames_min=0,
        renames_max=round(FULL.renames_max * ramp(0.1, 0.35)),
    )


def sample_difficulty(
    rng: random.Random, ceiling: Difficulty, at_ceiling: float = 0.0
) -> Difficulty:
    """Uniformly easier than ``ceiling`` (span length and context), or, with
    probability ``at_ceiling``, the ceiling itself (used once the curriculum
    is complete, to train on the evaluated distribution)."""
    if rng.random() < at_ceiling:
        return ceiling
    span_max = rng.randint(min(12, ceiling.span_max), ceiling.span_max)
    return replace(
        ceiling,
        span_max=span_max,
        span_min=min(ceiling.span_min, span_max),
        ctx_max=rng.randint(0, ceiling.ctx_max),
    )


# ---------------------------------------------------------------------------
# n-gram drafting, simulated (vLLM's NgramProposer semantics)


def ngram_draft(tokens, min_n: int = 2, max_n: int = 10, k: int = 64) -> list[int]:
    """The draft vLLM's n-gram proposer makes for ``tokens``: the longest
    suffix n-gram (``min_n <= n <= max_n``) found earlier in ``tokens``, its
    earliest occurrence, and up to ``k`` tokens after it."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        for j in range(0, total - n):
            if tokens[j : j + n] == suffix:
                start = j + n
                return list(tokens[start : min(start + k, total)])
    return []


def simulate_ngram(prompt, output, k: int = 64, min_n: int = 2, max_n: int = 10):
    """Replay greedy speculative decoding of ``output`` (which ends at EOS)
    with n-gram drafts: counts of zero-draft steps, drafts accepted in full
    and drafts accepted in part (including none)."""
    stats = {
        "steps": 0,
        "zero": 0,
        "full": 0,
        "partial": 0,
        "drafted": 0,
        "accepted": 0,
    }
    pos = 0
    while pos < len(output):
        draft = ngram_draft(list(prompt) + list(output[:pos]), min_n, max_n, k)
        acc = 0
        while acc < len(draft) and pos + acc < len(output):
            if draft[acc] != output[pos + acc]:
                break
            acc += 1
        stats["steps"] += 1
        stats["drafted"] += len(draft)
        stats["accepted"] += acc
        if not draft:
            stats["zero"] += 1
        elif acc == len(draft):
            stats["full"] += 1
        else:
            stats["partial"] += 1
        pos += acc + 1
    return stats


def ngram_spec(k: int = 64, lo: int = 2, hi: int = 10) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": lo,
        "prompt_lookup_max": hi,
    }


def simulate_set(examples, k: int = 64, min_n: int = 2, max_n: int = 10) -> dict:
    """``simulate_ngram`` summed over (prompt, answer) pairs."""
    agg: dict = {}
    for p, a in examples:
        for key, v in simulate_ngram(p, a, k, min_n, max_n).items():
            agg[key] = agg.get(key, 0) + v
    return agg
