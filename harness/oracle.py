"""Every token is a test: per-position log-probability drift against the
teacher-forced reference, judged against a measured noise floor.

``harness.compare`` judges a cell by its argmax flips (beyond bf16 ties).
A corrupted recurrent state that does not flip a choice passes it. This
module adds a second oracle over every generated position: the candidate's
own log-probability of the token it emitted, and its top-k log-probabilities,
must equal (within noise) the non-speculative model's teacher-forced
log-probabilities on the same prefix:

- ``token drift`` = |lp_cand(tok) - lp_ref(tok)|;
- ``top-k drift``: the largest |lp_cand(t) - lp_ref(t)| over the union of
  both top-k sets. Where a token is in one top-k and not in the other, its
  value on the other side is unknown but at most that side's k-th value, so
  ``max(0, lp_one(t) - kth_other)`` is a lower bound of its drift and is used
  (a changed top-k set counts only as far as values prove it).

Noise floor (``Floor``): the same two quantities for non-speculative runs
against the same teacher-forced reference, from two runs that differ only in
batch composition (the reference run, and the same prompts again in the
same engine, in reverse order, a third of the batch at a time: ``with_floor``),
plus the two runs against each other where their
tokens agree. A non-speculative run's logprobs come from the decode path,
the reference's from a prefill: the floor holds the kernel-path noise a
correct speculative run also carries.

The floor of an emitted token is taken at its size (``Floor.at``): the
largest drift the floor runs showed on any entry, emitted or top-k, no
larger than it. A non-speculative run emits mostly near-certain tokens, so
the plain token floor is about zero; a sampled candidate, or one whose
acceptance does not follow the target (synthetic acceptance), also emits
tokens of log-probability -3 or -10, which carry the logits' noise as the
floor's top-k entries of that size do.

Context floor (sampled cells, and greedy ones over the plain floor): a
sampled candidate emits tokens the non-speculative runs never emit, and
judges its drift in contexts the floor runs never saw; there a flatter
distribution puts more entries in the range where logits round coarsely.
Its own tokens are teacher-forced a second time, prefilled in chunks
(``harness.equivalence.PLP_CHUNK``), and the drift of that prefill from
the reference's, at the candidate's positions, is added to the floor of
that cell (``Floor.merged``). Both are non-speculative prefills of the
same tokens: a speculative bug moves the candidate, never its context
floor. A greedy speculative cell whose drift exceeds the plain floor is
judged again the same way (a verify row is a short prefill chunk of its
own, and the fixtures' top-k tail entries move under a change of prefill
shape alone); the pass runs only for such cells, since the merged floor
is never below the plain one (``drift_context_floor_why`` in the row).

Control floor (greedy speculative cells still over both floors): the
candidate's own engine without its drafter (``harness.equivalence.
control_cell``: the same runner, compilation and CUDA graphs, backends,
dtype, cache mode and batch) decodes the same prompts, and its drift from
the reference's teacher-forced pass is added to that cell's floor
(``Floor.add_prefix``). The reference is eager: a compiled engine whose
fusions round other intermediates (an FP8 target quantizes the unrounded
norm outputs where the eager one quantizes bf16-rounded ones) moves the
fixture's deep top-k entries without any speculation. The control has no
drafter, so a speculative bug moves the candidate, never its control.

Threshold (``threshold``): ``factor * max(floor, eps(dtype))``, and never
below the floor plus two rounding steps at the position's magnitude
(``allowance``). The factor
is derived, not chosen: if drift has (at most) exponential tails with scale
s, the largest of N floor positions is about s ln N, so a position of a
correct cell exceeds ``c * max_N`` with probability about ``N**-c``; over the
cell's M positions the chance of a false alarm is about ``M * N**-c``. The
factor is the ``c`` that holds this to ``ALPHA`` per cell:
``c = max(1, ln(M / ALPHA) / ln N)`` (about 2 for N = 1500, M = 6000).
Gaussian tails (the sum of many rounding errors) are lighter, so the rate
there is lower still. ``eps(dtype)`` (bf16 2**-8) is one unit of relative
precision: a floor below it means the floor sample happened to be bitwise
deterministic, not that smaller drifts are meaningful.

Hand-written: vLLM returns log-probabilities as per-position dicts; the
comparison is a few lines of dict arithmetic over them, with no library
doing the same.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# top-k log-probabilities requested from every run (generated and prompt
# logprobs; vLLM's default max_logprobs is 20)
TOPK = 5
# false-alarm probability per cell under the tail model (module docstring)
ALPHA = 1e-3
# one unit of relative precision per dtype (machine epsilon of the mantissa)
EPS = {
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
    "float32": 2.0**-23,
    "fp8": 2.0**-8,  # a block-FP8 checkpoint computes in bf16 (harness.fp8)
    "fp8_online": 2.0**-8,  # so does a bf16 one vLLM quantizes as it loads
}

LP = dict[int, float]
# HSFORK_DRIFT=report records drift violations without failing the cell
# (the default, "fail", makes a cell with a violation "diverged")
DRIFT_ENV = "HSFORK_DRIFT"


def enforced() -> bool:
    mode = os.environ.get(DRIFT_ENV, "fail")
    if mode not in ("fail", "report"):
        raise ValueError(f"{DRIFT_ENV} must be fail or report, not {mode!r}")
    return mode == "fail"


def lp_dict(entry) -> LP:
    """``{token: logprob}`` of one vLLM logprobs entry (a dict of Logprob
    objects, or already floats)."""
    return {int(t): float(getattr(v, "logprob", v)) for t, v in entry.items()}


def output_lps(outs) -> list[list[LP]]:
    """Per request, per generated position: the ``{token: logprob}`` vLLM
    returned (top-k plus the emitted token)."""
    return [[lp_dict(e) for e in (o.outputs[0].logprobs or [])] for o in outs]


def _topk(lps: LP, k: int) -> list[tuple[int, float]]:
    return sorted(lps.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def _bad(x: float) -> bool:
    return not math.isfinite(x) and x != -math.inf


@dataclass(frozen=True)
class PositionDrift:
    token: float  # |lp_cand(tok) - lp_ref(tok)|
    topk: float  # largest (proven) drift over the union of the top-k sets
    set_changed: bool  # the top-k sets differ
    # magnitude of the log-probabilities behind ``token`` and ``topk``: the
    # size of one rounding step there (``allowance``)
    token_mag: float = 0.0
    topk_mag: float = 0.0
    # (drift, magnitude) of every entry both sides returned: the emitted
    # token and the top-k union (``Floor.at``)
    entries: tuple[tuple[float, float], ...] = ()
    # the entry behind ``topk``: (token, candidate's value, reference's
    # value), None where that side did not return the token (its k-th value
    # bounded the drift), and each side's rank of it (0 = top-1; None: not
    # in that side's top-k). Empty when the emitted token is the worst.
    topk_entry: tuple = ()


def _rank(top: list[tuple[int, float]], token: int) -> int | None:
    return next((i for i, (t, _) in enumerate(top) if t == token), None)


def _topk_worst(cand: LP, ref: LP, k: int) -> tuple[float, bool, float, tuple]:
    """``_topk_drift``, and the entry behind the drift (``topk_entry``)."""
    # any NaN in either dict (a NaN need not sort into the top-k)
    if any(_bad(v) for v in (*cand.values(), *ref.values())):
        return math.inf, True, 0.0, ()
    top_c, top_r = _topk(cand, k), _topk(ref, k)
    worst, mag, at = 0.0, 0.0, ()
    if top_c and top_r:
        kth_c, kth_r = top_c[-1][1], top_r[-1][1]
        pairs = [(t, v, ref.get(t, kth_r), t in ref) for t, v in top_c]
        pairs += [(t, v, cand.get(t, kth_c), t in cand) for t, v in top_r]
        for t, v, other, both in pairs:
            d = abs(v - other) if both else max(0.0, v - other)
            if d > worst:
                worst, mag = d, max(abs(v), abs(other))
                at = (t, cand.get(t), ref.get(t), _rank(top_c, t), _rank(top_r, t))
    return worst, {t for t, _ in top_c} != {t for t, _ in top_r}, mag, at


def _topk_drift(cand: LP, ref: LP, k: int) -> tuple[float, bool, float]:
    """Largest proven drift over the union of both top-k sets, whether the
    sets differ, and the magnitude of the values behind that drift."""
    return _topk_worst(cand, ref, k)[:3]


def position_drift(cand: LP, ref: LP, token: int, k: int = TOPK) -> PositionDrift:
    """Drift of one position: ``cand`` and ``ref`` hold top-k and the emitted
    ``token`` (vLLM's generated and prompt logprobs both do)."""
    if token not in cand or token not in ref:
        raise KeyError(f"token {token} missing from a logprob dict")
    a, b = cand[token], ref[token]
    if _bad(a) or _bad(b):
        return PositionDrift(math.inf, math.inf, True)
    tok = 0.0 if a == b else abs(a - b)
    tok_mag = max(abs(a), abs(b))
    top, changed, top_mag, top_at = _topk_worst(cand, ref, k)
    if tok >= top:
        top, top_mag, top_at = tok, tok_mag, ()
    shared = {token, *(t for t, _ in _topk(cand, k)), *(t for t, _ in _topk(ref, k))}
    entries = tuple(
        (abs(cand[t] - ref[t]), max(abs(cand[t]), abs(ref[t])))
        for t in sorted(shared)
        if t in cand and t in ref and math.isfinite(cand[t]) and math.isfinite(ref[t])
    )
    return PositionDrift(tok, top, changed, tok_mag, top_mag, entries, top_at)


def sequence_drift(
    cand: Sequence[LP], ref: Sequence[LP], tokens: Sequence[int], k: int = TOPK
) -> list[PositionDrift]:
    if not (len(cand) == len(ref) == len(tokens)):
        raise ValueError(
            f"{len(cand)} / {len(ref)} logprob dicts, {len(tokens)} tokens"
        )
    return [
        position_drift(c, r, t, k) for c, r, t in zip(cand, ref, tokens, strict=True)
    ]


@dataclass
class Floor:
    """Noise floor of one (model, dtype, kv cache dtype): the largest drift
    of non-speculative runs (``add``: against the teacher-forced reference;
    ``add_pair``: two runs against each other while their tokens agree)."""

    token: float = 0.0
    topk: float = 0.0
    positions: int = 0
    # magnitude bucket (``bucket``) -> the largest drift of an entry of that
    # size, over emitted tokens and top-k entries alike (``at``)
    by_mag: dict[int, float] = field(default_factory=dict)

    def _add(self, drifts: Iterable[PositionDrift]) -> None:
        for d in drifts:
            self.token = max(self.token, d.token)
            self.topk = max(self.topk, d.topk)
            self.positions += 1
            for drift, mag in d.entries:
                b = bucket(mag)
                self.by_mag[b] = max(self.by_mag.get(b, 0.0), drift)

    def at(self, magnitude: float) -> float:
        """The largest drift the floor saw on an entry no larger than
        ``magnitude`` (to its power of two): the floor of an emitted token
        of that size. A non-speculative run emits mostly near-certain
        tokens, whose log-probabilities barely move, so ``token`` is about
        zero; a sampled candidate, and one whose acceptance does not follow
        the target (synthetic acceptance), emits tokens of -3 or -10 too,
        whose values carry the logits' noise as the top-k entries of the
        same size do. Entries larger than the token's do not count, so a
        near-certain token is still held to the near-certain floor.

        Where the floor saw no entry between the near-certain ones and this
        size, it takes the next larger size it saw, scaled by ``1 - p``
        (``p = exp(-magnitude)``, the token's probability): a token's
        log-probability moves by its own logit's rounding less the
        probability-weighted rounding of all logits (the log-sum-exp), so
        one far from certain moves as much as the floor's larger entries,
        one of probability ``p`` about ``1 - p`` of that. A trained
        fixture's distributions hold one token near 0 and the rest below
        -16, so its floor has nothing in between, while a candidate that
        accepted an unlikely token emits tokens of -1 to -10 in the
        contexts that follow."""
        b = bucket(magnitude)
        out = max((v for k, v in self.by_mag.items() if k <= b), default=0.0)
        if b > LOWEST and not any(LOWEST < k <= b for k in self.by_mag):
            larger = [k for k in self.by_mag if k > b]
            if larger:
                scale = -math.expm1(-magnitude)  # 1 - p
                out = max(out, self.by_mag[min(larger)] * scale)
        return out

    def add(self, gen: Sequence[LP], forced: Sequence[LP], tokens: Sequence[int]):
        if _complete(gen, forced, tokens):
            self._add(sequence_drift(gen, forced, tokens))

    def add_prefix(self, gen: Sequence[LP], forced: Sequence[LP], gen_tokens,
                   forced_tokens) -> None:  # fmt: skip
        """A run against the teacher-forced pass of another run's tokens (the
        control floor: a non-speculative run of the candidate's engine
        against the reference's prefill), up to and including their first
        differing token: both condition on the same prefix there, where
        only the top-k must agree (as in ``add_pair``)."""
        m = min(len(gen_tokens), len(forced_tokens), len(gen), len(forced))
        n = 0
        while n < m and gen_tokens[n] == forced_tokens[n]:
            n += 1
        self.add(gen[:n], forced[:n], list(gen_tokens[:n]))
        if n < m and gen[n] is not None and forced[n] is not None:
            top, changed, mag = _topk_drift(gen[n], forced[n], TOPK)
            self._add([PositionDrift(0.0, top, changed, 0.0, mag)])

    def merged(self, other: Floor) -> Floor:
        """The floor of both samples together: each largest drift of
        either, over all their positions."""
        by_mag = dict(self.by_mag)
        for b, v in other.by_mag.items():
            by_mag[b] = max(by_mag.get(b, 0.0), v)
        return Floor(
            max(self.token, other.token),
            max(self.topk, other.topk),
            self.positions + other.positions,
            by_mag,
        )

    def add_pair(self, a: Sequence[LP], b: Sequence[LP], ta, tb) -> None:
        """Two non-speculative runs of one prompt, up to and including their
        first differing token (both condition on the same prefix there)."""
        if not _complete(a, b, ta) or not _complete(b, a, tb):
            return
        n = 0
        while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
            n += 1
        for i in range(min(n, len(a), len(b))):
            self._add([position_drift(a[i], b[i], ta[i])])
        if n < min(len(ta), len(tb)):
            # same prefix, different tokens: the top-k still must agree
            top, changed, mag = _topk_drift(a[n], b[n], TOPK)
            self._add([PositionDrift(0.0, top, changed, 0.0, mag)])


LOWEST = -4  # the bucket of the near-certain entries (up to 1/16)


def bucket(magnitude: float) -> int:
    """``ceil(log2(magnitude))``, at least ``LOWEST``: entries of up to
    1/16, then one bucket per power of two."""
    if not (magnitude > 2.0**LOWEST):
        return LOWEST
    return math.ceil(math.log2(magnitude)) if math.isfinite(magnitude) else 64


def _complete(a: Sequence, b: Sequence, tokens: Sequence) -> bool:
    """Both runs returned a logprob dict at every position (a run without
    logprobs, or a test's fake reference without them, is not judged)."""
    n = len(tokens)
    return (
        len(a) >= n
        and len(b) >= n
        and all(x is not None for x in list(a[:n]) + list(b[:n]))
    )


def factor(floor_positions: int, cell_positions: int, alpha: float = ALPHA) -> float:
    """``c`` of the module docstring: ``max(1, ln(M / alpha) / ln N)``."""
    n = max(floor_positions, 2)
    m = max(cell_positions, 1)
    return max(1.0, math.log(m / alpha) / math.log(n))


def step(floor_value: float) -> float:
    """The rounding step at the floor's scale: the largest power of two not
    above half the floor (a floor is the largest drift of many positions, so
    it spans at least two such steps). 0 for a zero floor."""
    if not (floor_value > 0 and math.isfinite(floor_value)):
        return 0.0
    return 2.0 ** math.floor(math.log2(floor_value / 2))


def threshold(floor_value: float, dtype: str, c: float) -> float:
    """``c * max(floor, eps)``, rounded up to the next multiple of the
    floor's rounding step (``step``). Drift is quantised where logits are
    rounded to ``dtype`` before the log-softmax: a top-k entry of a fixture
    whose logits are 16-32 in size moves in steps of 0.125, so a floor of
    two steps (0.25) times a factor of 1.46 (0.365) would put the bar
    between two steps and fail a correct cell for its third step (0.375);
    the drift of a correct run can only take the step values."""
    t = c * max(floor_value, EPS[dtype])
    q = step(floor_value)
    return math.ceil(t / q - 1e-9) * q if q else t


def allowance(floor_value: float, dtype: str, magnitude: float) -> float:
    """The floor plus two rounding steps at ``magnitude``: logits are
    rounded to ``dtype`` before the log-softmax, so two correct runs whose
    logits differ in the last bit differ in a log-probability of size
    ``magnitude`` by about ``EPS * magnitude`` each way. A deep-tail top-k
    entry (log-probability -40) moves in steps of 0.125-0.25 in bf16; the
    floor, a maximum over a few positions, need not have met the largest
    such step, and a drift is quantised, not exponential, at that scale."""
    return floor_value + 2 * EPS[dtype] * magnitude


@dataclass
class CellDrift:
    """Per-position drift of one cell's candidates against the teacher-forced
    reference; ``judge`` turns it into report fields."""

    drifts: list[tuple[int, int, int, PositionDrift]] = field(default_factory=list)
    missing: int = 0  # sequences whose candidate returned no logprobs

    def add(
        self,
        prompt: int,
        cand: Sequence[LP],
        forced: Sequence[LP],
        tokens: Sequence[int],
    ) -> None:
        if not _complete(cand, forced, tokens):
            self.missing += 1
            return
        for i, d in enumerate(sequence_drift(cand, forced, tokens)):
            self.drifts.append((prompt, i, tokens[i], d))

    def judge(self, floor: Floor, dtype: str, alpha: float = ALPHA) -> dict:
        """Report fields: worst drifts, the floor, the factor and thresholds,
        how many positions exceed them, and the first that does."""
        m = len(self.drifts)
        c = factor(floor.positions, m, alpha)
        thr_tok = threshold(floor.token, dtype, c)
        thr_top = threshold(floor.topk, dtype, c)
        worst_tok = max((d.token for *_, d in self.drifts), default=0.0)
        worst_top = max((d.topk for *_, d in self.drifts), default=0.0)
        violations = 0
        first = worst = None
        worst_ratio = -1.0
        for prompt, pos, tok, d in self.drifts:
            lim_tok = max(
                thr_tok,
                allowance(floor.token, dtype, d.token_mag),
                threshold(floor.at(d.token_mag), dtype, c),
            )
            lim_top = max(thr_top, allowance(floor.topk, dtype, d.topk_mag))
            ratio = max(d.token / max(lim_tok, 1e-30), d.topk / max(lim_top, 1e-30))
            where = {
                "prompt": prompt,
                "position": pos,
                "token": tok,
                "drift": _r(d.token),
                "topk_drift": _r(d.topk),
                # the emitted token's log-probability size and its bar
                "magnitude": _r(d.token_mag),
                "limit": _r(lim_tok),
                "topk_limit": _r(lim_top),
            }
            if d.topk_entry:
                t, vc, vr, rc, rr = d.topk_entry
                where["topk_entry"] = {
                    "token": t,
                    "candidate": None if vc is None else _r(vc),
                    "reference": None if vr is None else _r(vr),
                    "candidate_rank": rc,
                    "reference_rank": rr,
                }
            if ratio > worst_ratio:
                worst_ratio, worst = ratio, where
            if d.token > lim_tok or d.topk > lim_top:
                violations += 1
                if first is None:
                    first = where
        return {
            "drift_positions": m,
            "drift_max": _r(worst_tok),
            "drift_topk_max": _r(worst_top),
            "drift_floor": _r(floor.token),
            "drift_topk_floor": _r(floor.topk),
            "drift_floor_positions": floor.positions,
            "drift_floor_by_magnitude": {
                str(2.0**b): _r(v) for b, v in sorted(floor.by_mag.items())
            },
            "drift_factor": round(c, 3),
            "drift_threshold": _r(thr_tok),
            "drift_topk_threshold": _r(thr_top),
            "drift_set_changes": sum(d.set_changed for *_, d in self.drifts),
            "drift_violations": violations,
            "drift_enforced": enforced(),
            "drift_missing": self.missing,
            "first_drift": first,
            # the position closest to (or furthest over) its bars
            "drift_worst_at": worst,
        }


def rejudge(row: dict) -> dict:
    """A reported cell judged again under today's ``threshold`` from the
    floor and factor it recorded, where that settles it: a cell whose worst
    token and top-k drifts are both within the new thresholds has no
    position over them (the bar only moved up). Marks such a row
    ``drift_rejudged``; a diverged cell with no argmax flip then reads ok.
    Other rows are returned as they are. For reports written before a
    change of ``threshold``, so that one summary applies one rule."""
    need = ("drift_floor", "drift_topk_floor", "drift_factor", "drift_max",
            "drift_topk_max")  # fmt: skip
    if not row.get("drift_violations") or not all(
        isinstance(row.get(k), (int, float)) for k in need
    ):
        return row
    dtype = row.get("dtype") or "bfloat16"
    c = row["drift_factor"]
    thr_tok = threshold(row["drift_floor"], dtype, c)
    thr_top = threshold(row["drift_topk_floor"], dtype, c)
    if row["drift_max"] > thr_tok or row["drift_topk_max"] > thr_top:
        return row
    out = {**row, "drift_threshold": _r(thr_tok),
           "drift_topk_threshold": _r(thr_top), "drift_violations": 0,
           "first_drift": None, "drift_rejudged": True}  # fmt: skip
    if out.get("status") == "diverged" and not out.get("divergences"):
        out["status"] = "ok"
    return out


def _r(x: float) -> float | str:
    return round(x, 6) if math.isfinite(x) else "inf"


def floor_batch(batch: int) -> int:
    """The floor run's batch: a third of the reference's (other neighbours,
    other row positions, other batch sizes)."""
    return max(1, batch // 3)


def with_floor(generate, cell, model_dir: str, wave: list, batch: int):
    """``generate`` (harness.equivalence's) one wave of prompts ``batch`` at
    a time, then the same wave again in the same engine, in reverse order,
    ``floor_batch(batch)`` at a time: ``(outputs, floor outputs)``, both in
    the wave's order. Only the batch composition differs between the two."""
    rev = list(reversed(wave))
    outs, _ = generate(cell, model_dir, [wave, rev], TOPK,
                       batches=[batch, floor_batch(batch)])  # fmt: skip
    return list(outs[: len(wave)]), list(reversed(outs[len(wave) :]))
