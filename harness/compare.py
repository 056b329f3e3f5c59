"""Margin-aware comparison of speculative output against the greedy reference.

A speculative run must reproduce the reference's greedy tokens exactly. A
difference at a position is

- a ``tie`` when the reference's top-1/top-2 log-probability gap there is
  below ``tie_margin`` (numerical noise of the dtype can flip the argmax) and
  the speculative token is the reference's second choice;
- a ``divergence`` (a bug) otherwise.

The reference at each position is the reference model teacher-forced on the
candidate's own tokens (one non-speculative prefill of prompt + candidate with
``prompt_logprobs``), so every position is judged: a tie does not end the
comparison (as it would against the reference's own generation, after which
the two runs condition on different tokens), and a corrupted recurrent state
shows as divergences wherever it changes a choice. The reference's own
generation serves to measure the kernel-path noise (``noise``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Default tie margins (nats), by dtype: bf16 logits carry ~1e-2 relative
# noise through a forward pass; fp32 ~1e-6.
# "fp8": a block-FP8 checkpoint computing in bf16 (harness.fp8), and
# "fp8_online", a bf16 one vLLM quantizes as it loads; their measured noise
# floor widens the margin where FP8 GEMMs need it
TIE_MARGIN = {"bfloat16": 0.05, "float16": 0.02, "float32": 1e-3, "fp8": 0.05,
              "fp8_online": 0.05}  # fmt: skip


@dataclass(frozen=True)
class Position:
    """Reference top-2 at one generated position."""

    token: int
    second: int | None
    gap: float  # logprob(top1) - logprob(top2); inf if unknown
    # teacher-forced positions: logprob(top1) - logprob(candidate token)
    cand_gap: float | None = None
    # the {token: logprob} it was made from (top-k plus the actual token):
    # the drift oracle (harness.oracle) compares every position's values
    logprobs: dict | None = field(default=None, compare=False, repr=False)

    @classmethod
    def top(cls, logprobs: dict[int, float], candidate: int | None = None) -> Position:
        """The argmax of a (top-k plus actual token) logprob dict; with the
        candidate token, also how far below the top the candidate is."""
        ranked = sorted(logprobs.items(), key=lambda kv: (-kv[1], kv[0]))
        cand_gap = None
        if candidate is not None and candidate in logprobs:
            cand_gap = ranked[0][1] - logprobs[candidate]
        lps = dict(logprobs)
        if len(ranked) < 2:
            return cls(ranked[0][0], None, float("inf"), cand_gap, lps)
        return cls(
            ranked[0][0], ranked[1][0], ranked[0][1] - ranked[1][1], cand_gap, lps
        )

    @classmethod
    def from_logprobs(cls, token: int, logprobs: dict[int, float]) -> Position:
        ranked = sorted(logprobs.items(), key=lambda kv: -kv[1])
        lps = dict(logprobs)
        if not ranked:
            return cls(token, None, float("inf"), logprobs=lps)
        best = logprobs.get(token, ranked[0][1])
        others = [(t, lp) for t, lp in ranked if t != token]
        if not others:
            return cls(token, None, float("inf"), logprobs=lps)
        return cls(token, others[0][0], best - others[0][1], logprobs=lps)


@dataclass(frozen=True)
class Verification:
    checked: int
    divergences: int
    ties: int
    first: dict | None  # first divergence: position, margin, expected, got
    max_margin: float | None = None  # largest reference gap among divergences
    margins: tuple[float, ...] = ()  # reference gap at every divergence

    @property
    def status(self) -> str:
        return "diverged" if self.divergences else ("tie" if self.ties else "match")


def verify(
    reference: Sequence[Position],
    candidate: Sequence[int],
    tie_margin: float,
    expected_len: int | None = None,
    ref_tokens: Sequence[int] | None = None,
) -> Verification:
    """Judge every candidate token against the teacher-forced reference.

    With ``expected_len`` (the reference run's output length), a candidate
    that stops early or runs long counts as one more divergence there. With
    the reference run's tokens (``ref_tokens``) too, that happens only when
    the two agree on every token up to where the shorter one ends, so that
    the candidate stopped where the reference went on or went on where it
    stopped; a length that differs after a tie (the candidate took the other
    side of a near-tie, e.g. instead of a stop token) is the tie's
    consequence, already judged."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} positions for {len(candidate)} tokens")
    div = ties = 0
    first = None
    worst: float | None = None
    margins: list[float] = []
    for i, (ref, tok) in enumerate(zip(reference, candidate, strict=True)):
        if tok == ref.token:
            continue
        if ref.cand_gap is not None:
            # the candidate's own reference logprob is known: it is a tie when
            # it is within the noise of the top choice (also for >2-way ties)
            margin = ref.cand_gap
            tie = margin < tie_margin
        else:
            margin = ref.gap
            tie = ref.gap < tie_margin and tok == ref.second
        if tie:
            ties += 1
            continue
        div += 1
        worst = margin if worst is None else max(worst, margin)
        margins.append(margin)
        if first is None:
            first = {"position": i, "margin": margin, "expected": ref.token,
                     "got": tok}  # fmt: skip
    if ref_tokens is not None:
        expected_len = len(ref_tokens)
    if expected_len is not None and len(candidate) != expected_len:
        n = min(len(candidate), expected_len)
        same = ref_tokens is None or list(candidate[:n]) == list(ref_tokens[:n])
        if same:
            div += 1
        if same and first is None:
            first = {
                "position": n,
                "margin": None,
                "expected": f"{expected_len} tokens",
                "got": len(candidate),
            }
            if ref_tokens is not None:
                # the tokens where one stopped and the other went on
                first["last_common"] = list(ref_tokens[max(0, n - 3) : n])
                first["reference_next"] = list(ref_tokens[n : n + 3])
                first["candidate_next"] = list(candidate[n : n + 3])
    return Verification(len(candidate), div, ties, first, worst, tuple(margins))


# A cell whose tie margin takes in more than this share of its positions
# cannot be judged: the non-speculative runs' own disagreement with the
# teacher-forced reference (the noise the margin is made of) is as large as
# the choices being checked, so neither "ok" nor "diverged" says anything.
# Of 1,850 judged cells in the reports up to 2026-11-28, the largest share
# was 10 %, apart from three TP=2 NemotronH none-mode cells judged against a
# TP=1 prefill: 52-55 %.
UNJUDGED_TIE_SHARE = 0.25


def judgeable(row: dict) -> dict:
    """``row`` (a reported cell) with status ``inconclusive`` and the reason
    where its ties exceed ``UNJUDGED_TIE_SHARE`` of its tokens; other rows
    as they are. Applied when a cell is judged and when reports written
    before this rule are read, so that one summary applies one rule."""
    tokens, ties = row.get("tokens") or 0, row.get("ties") or 0
    if row.get("status") not in ("ok", "diverged") or not tokens:
        return row
    if ties <= UNJUDGED_TIE_SHARE * tokens:
        return row
    why = (f"{ties} of {tokens} positions within the tie margin "
           f"({row.get('tie_margin')}): the reference's own noise is as "
           f"large as the choices checked")  # fmt: skip
    return {**row, "status": "inconclusive", "judged_as": row["status"],
            "inconclusive": why}  # fmt: skip


def noise(generated: Sequence[Position], forced: Sequence[Position]) -> float:
    """Largest top-1/top-2 gap difference between the reference's generation
    and its teacher-forced prefill on the same tokens (kernel-path noise)."""
    worst = 0.0
    for g, f in zip(generated, forced, strict=False):
        same = g.token == f.token and g.second == f.second
        if same and g.gap != float("inf") and f.gap != float("inf"):
            worst = max(worst, abs(g.gap - f.gap))
    return worst


def verify_run(
    reference: Sequence[Position],
    ref_tokens: Sequence[int],
    candidate: Sequence[int],
    tie_margin: float,
) -> Verification:
    """Judge a candidate against the reference *run* of the same constrained
    requests (structured output: the grammar masks the logits, which a
    teacher-forced reference does not see). Token by token up to the first
    difference, whose margin is the reference run's own logprob gap between
    its token and the candidate's (its returned top-k, after the mask; a
    candidate outside the top-k is at least as far as the last of them).
    Later positions have another context and are not judged."""
    n = min(len(ref_tokens), len(candidate))
    for i in range(n):
        if ref_tokens[i] == candidate[i]:
            continue
        lps = reference[i].logprobs or {}
        top = lps.get(ref_tokens[i])
        if top is None:
            margin = reference[i].gap
        elif candidate[i] in lps:
            margin = top - lps[candidate[i]]
        else:
            margin = top - min(lps.values())
        if margin < tie_margin:
            return Verification(i + 1, 0, 1, None)
        first = {"position": i, "margin": margin, "expected": ref_tokens[i],
                 "got": candidate[i]}  # fmt: skip
        return Verification(i + 1, 1, 0, first, margin, (margin,))
    if len(candidate) != len(ref_tokens):
        first = {
            "position": n,
            "margin": None,
            "expected": f"{len(ref_tokens)} tokens",
            "got": len(candidate),
        }
        return Verification(n, 1, 0, first)
    return Verification(n, 0, 0, None)


@dataclass
class CellSummary:
    prompts: int = 0
    tokens: int = 0
    divergences: int = 0
    ties: int = 0
    first_divergence: dict | None = None
    max_margin: float | None = None
    margins: list[float] = field(default_factory=list)

    def add_verification(self, prompt_index: int, v: Verification) -> None:
        self.prompts += 1
        self.tokens += v.checked
        self.ties += v.ties
        self.divergences += v.divergences
        if v.max_margin is not None:
            self.max_margin = max(self.max_margin or 0.0, v.max_margin)
        self.margins += v.margins
        if v.first is not None and self.first_divergence is None:
            self.first_divergence = {"prompt": prompt_index, **v.first}

    @property
    def status(self) -> str:
        return "diverged" if self.divergences else "ok"
