"""Margin-aware comparison of speculative output against the greedy reference.

A speculative run must reproduce the reference's greedy tokens exactly. Where
it does not, the first divergence decides the request's verdict:

- ``tie``: the reference's top-1/top-2 log-probability gap at that position is
  below ``tie_margin`` (numerical noise of the dtype can flip the argmax) and
  the speculative token is the reference's second choice;
- ``diverged``: any other difference, a bug.

Tokens after the first divergence are not compared: from there on the two
runs condition on different prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Default tie margins (nats), by dtype: bf16 logits carry ~1e-2 relative
# noise through a forward pass; fp32 ~1e-6.
TIE_MARGIN = {"bfloat16": 0.05, "float16": 0.02, "float32": 1e-3}


@dataclass(frozen=True)
class Position:
    """Reference top-2 at one generated position."""

    token: int
    second: int | None
    gap: float  # logprob(top1) - logprob(top2); inf if unknown

    @classmethod
    def from_logprobs(cls, token: int, logprobs: dict[int, float]) -> Position:
        ranked = sorted(logprobs.items(), key=lambda kv: -kv[1])
        if not ranked:
            return cls(token, None, float("inf"))
        best = logprobs.get(token, ranked[0][1])
        others = [(t, lp) for t, lp in ranked if t != token]
        if not others:
            return cls(token, None, float("inf"))
        return cls(token, others[0][0], best - others[0][1])


@dataclass(frozen=True)
class Verdict:
    status: str  # "match" | "tie" | "diverged"
    compared: int  # tokens compared (up to and including the divergence)
    position: int | None = None  # index of the first divergence
    margin: float | None = None  # reference gap there
    expected: int | None = None
    got: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def compare(
    reference: Sequence[Position],
    candidate: Sequence[int],
    tie_margin: float,
) -> Verdict:
    n = min(len(reference), len(candidate))
    for i in range(n):
        ref = reference[i]
        if candidate[i] == ref.token:
            continue
        tie = ref.gap < tie_margin and candidate[i] == ref.second
        return Verdict(
            "tie" if tie else "diverged",
            i + 1,
            i,
            ref.gap,
            ref.token,
            candidate[i],
        )
    if len(candidate) != len(reference):
        # a run that stops early or runs long (EOS/stop handling) is a bug too
        return Verdict(
            "diverged",
            n,
            n,
            None,
            reference[n].token if n < len(reference) else None,
            candidate[n] if n < len(candidate) else None,
        )
    return Verdict("match", n)


@dataclass
class CellSummary:
    prompts: int = 0
    tokens: int = 0
    divergences: int = 0
    ties: int = 0
    first_divergence: dict | None = None

    def add(self, prompt_index: int, verdict: Verdict) -> None:
        self.prompts += 1
        self.tokens += verdict.compared
        if verdict.status == "tie":
            self.ties += 1
        elif verdict.status == "diverged":
            self.divergences += 1
            if self.first_divergence is None:
                self.first_divergence = {
                    "prompt": prompt_index,
                    "position": verdict.position,
                    "margin": verdict.margin,
                    "expected": verdict.expected,
                    "got": verdict.got,
                }

    @property
    def status(self) -> str:
        return "diverged" if self.divergences else "ok"


def summarize(
    reference: Sequence[Sequence[Position]],
    candidates: Sequence[Sequence[int]],
    tie_margin: float,
) -> CellSummary:
    if len(reference) != len(candidates):
        raise ValueError(f"{len(reference)} references, {len(candidates)} candidates")
    summary = CellSummary()
    for i, (ref, cand) in enumerate(zip(reference, candidates)):
        summary.add(i, compare(ref, cand, tie_margin))
    return summary
