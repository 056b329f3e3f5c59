"""Sampled decoding (temperature > 0, top-p/top-k, seeded) with speculation.

Sampled tokens differ from a non-speculative run's, so a sampled cell is not
judged by argmax flips. Three checks instead:

1. **Drift** (``harness.oracle``): at every position the candidate's
   log-probabilities given its own emitted prefix equal the non-speculative
   teacher-forced ones, within the measured noise floor. Lossy methods too
   (``synthetic``, ``fly``): they may emit other tokens, never other states.
2. **Support** (``verify_support``): a lossless method (``standard``,
   ``block``, probabilistic drafts) emits only tokens the target's
   temperature/top-k/top-p distribution can emit; a token outside it (beyond
   a tie tolerance) counts as a divergence.
3. **Distribution** (``gof``, ``plan``; GPU: ``harness.sampled_gof``): on
   a small fixture, many seeded samples of the first ``L`` tokens of one
   prompt with speculation, and a G-test
   (``scipy.stats.power_divergence``) of their joint distribution against
   the exact target distribution (product of the teacher-forced
   conditionals, computed from the top-k logprobs: with top-k sampling the
   support is known exactly). Run in float32, where the
   kernel noise (~1e-6 nats) gives the test no power against the exact
   distribution at the sample counts used (noncentrality ~ N * noise^2).

   Power: ``plan`` picks the number of samples from the target's own
   conditionals so that a realistic acceptance bug is found with power
   ``POWER`` at level ``LEVEL``: the draft token's acceptance probability
   computed from the wrong distribution (``BUGS``: temperature not applied,
   top-k/top-p renormalisation not applied). The bug's joint distribution
   follows from the rejection-sampling rule for a one-hot draft (what vLLM's
   n-gram, MTP and scripted drafters propose): the draft ``d`` is emitted
   with the (wrong) acceptance probability ``a``, any other token ``j`` with
   ``(1 - a) * p(j) / (1 - p(d))``. The noncentrality of the G-test under
   the bug is ``N * 2 * KL(bug || p)`` (Cochran; ``scipy.stats.ncx2``).

Presets (``PRESETS``): sampling parameters and the speculative-config keys of
a rejection-sampling method; a cell names one as ``Cell.sampling``.

Hand-written: the target distribution after temperature/top-k/top-p mirrors
vLLM's ``apply_top_k_top_p`` (ascending cumulative sum, mask ``<= 1 - p``) on
a dict of log-probabilities; the statistics are scipy's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .compare import Position, Verification
from .oracle import TOPK

LEVEL = 1e-3  # false-alarm rate of the distribution test
POWER = 0.99  # power against the planned bug
MIN_EXPECTED = 5  # bins with fewer expected samples are pooled (Cochran)
SEED = 1234  # per-cell sampling seed

# lossless methods: the emitted tokens follow the target distribution
LOSSLESS = ("standard", "block", "probabilistic")
LOSSY = ("synthetic", "fly")


@dataclass(frozen=True)
class Preset:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    method: str = "standard"  # LOSSLESS + LOSSY

    def sampling_kwargs(self) -> dict:
        kw = {"temperature": self.temperature, "seed": SEED}
        if self.top_p < 1.0:
            kw["top_p"] = self.top_p
        if self.top_k:
            kw["top_k"] = self.top_k
        return kw

    def spec_kwargs(self, k: int) -> dict:
        if self.method == "standard":
            return {}
        if self.method == "probabilistic":
            # drafts sampled from the drafter's distribution, accepted with
            # min(1, p/q) (MTP, EAGLE and draft models)
            return {"draft_sample_method": "probabilistic"}
        if self.method == "synthetic":
            # accept about half of the drafts
            return {
                "rejection_sample_method": "synthetic",
                "synthetic_acceptance_length": 1 + k / 2,
            }
        return {"rejection_sample_method": self.method}  # block | fly

    @property
    def lossless(self) -> bool:
        return self.method in LOSSLESS


def _presets() -> dict[str, Preset]:
    base = {
        "t1": Preset(1.0),
        "t0.7-k5": Preset(0.7, top_k=TOPK),
        "t0.8-p0.9-k5": Preset(0.8, 0.9, TOPK),
    }
    out = dict(base)
    for m in ("block", "synthetic", "fly", "probabilistic"):
        out[f"t0.8-p0.9-k5:{m}"] = Preset(0.8, 0.9, TOPK, m)
    return out


PRESETS: dict[str, Preset] = _presets()


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown sampling preset {name!r}; known: {list(PRESETS)}")
    return PRESETS[name]


def sampling_kwargs(name: str) -> dict:
    """SamplingParams keywords of a cell's ``sampling`` (greedy: T=0)."""
    return {"temperature": 0.0} if name == "greedy" else preset(name).sampling_kwargs()


def spec_kwargs(name: str, k: int) -> dict:
    """Speculative-config keys of a cell's ``sampling`` (the method)."""
    return {} if name == "greedy" else preset(name).spec_kwargs(k)


# ---------------------------------------------------------------------------
# sampled cells of the matrix

FASTAPPLY = "fastapply"  # harness.equivalence.FASTAPPLY
SAMPLED_PARTS = {
    "q": ("qwen3_5",),
    "n": ("nemotron_h",),
    "fa": ("fastapply",),
    "more": ("qwen3_next", "granitemoehybrid"),
    # the other hybrid families with a speculative path: speculating_families
    "fam": (),
    # Kimi-Linear (KDA; its spec path needs the CUTLASS DSL on v0.33.0),
    # with the cells of "fam"
    "kimi": ("kimi_linear",),
}


def speculating_families() -> tuple[str, ...]:
    """The other hybrid families (harness.models.FAMILY_KINDS) with a
    speculative path on some line (harness.models.FAMILY_SPEC) that vLLM
    loads (``harness.models.vllm_loads``): Jamba and Mamba are refused."""
    from .models import FAMILY_KINDS, FAMILY_SPEC, vllm_loads

    return tuple(
        k
        for k in FAMILY_KINDS
        if any(v is True for v in FAMILY_SPEC[k].values()) and vllm_loads(k)
    )


def cells(part: str = "all") -> list[dict]:
    """Sampled cells (slice ``sampled-<part>``: q, n, fa, more, fam, kimi, or
    all) for every family that speculates: n-gram at T=1
    and with top-p/top-k, scripted drafts (mixed draft counts; synthetic
    acceptance), MTP with standard, probabilistic-draft,
    block, synthetic and FLy acceptance (V1 and MRV2; FLy exists in v0.33.0
    only, v0.26.0 rejects it at config time and records ``rejected``).
    The other hybrid families (part ``fam``) and Kimi-Linear (part
    ``kimi``) get n-gram at T=1 and with top-p/top-k, and MTP (standard and
    probabilistic-draft acceptance) where the fixture has a head.
    Returns ``harness.equivalence.Cell`` keyword arguments (this module
    does not import the matrix)."""
    from .models import FIXTURES

    if part == "all":
        return [c for p in SAMPLED_PARTS for c in cells(p)]
    if part not in SAMPLED_PARTS:
        raise ValueError(f"unknown sampled part {part!r}")
    tp = "t0.8-p0.9-k5"
    out = []
    for m in speculating_families() if part == "fam" else SAMPLED_PARTS[part]:
        mt = 128 if m == FASTAPPLY else 96
        mtp = m == FASTAPPLY or FIXTURES[m]["mtp"]

        def c(drafter, k, runner="v1", sampling=tp, m=m, mt=mt, **kw):
            return {
                "model": m,
                "drafter": drafter,
                "k": k,
                "batch": 8,
                "runner": runner,
                "max_tokens": mt,
                "sampling": sampling,
                **kw,
            }

        if part in ("fam", "kimi"):
            out += [c("ngram", 5, sampling="t1"), c("ngram", 5)]
            if mtp:
                out += [
                    c("mtp", 3, async_sched=True),
                    c("mtp", 3, "mrv2", sampling=f"{tp}:probabilistic"),
                ]
            continue
        out += [
            c("ngram", 5, sampling="t1"),
            c("ngram", 5),
            c("scripted:heterogeneous", 4, sampling="t0.7-k5"),
            c("scripted:heterogeneous", 4, sampling=f"{tp}:synthetic"),
        ]
        if mtp:
            out += [
                c("mtp", 3, async_sched=True),
                c("mtp", 3, "mrv2", async_sched=True),
                c("mtp", 3, "mrv2", sampling=f"{tp}:probabilistic"),
                c("mtp", 3, "v1", sampling=f"{tp}:probabilistic"),
                c("mtp", 3, "mrv2", sampling=f"{tp}:block"),
                c("mtp", 3, "mrv2", sampling=f"{tp}:synthetic"),
                c("mtp", 3, "mrv2", sampling=f"{tp}:fly"),
                c("scripted:accept_then_zero", 4, "mrv2", sampling=f"{tp}:block"),
            ]
    return out


# ---------------------------------------------------------------------------
# the target distribution


def target_dist(lps: Mapping[int, float], p: Preset) -> dict[int, float]:
    """The distribution vLLM samples from at a position whose (raw)
    log-probabilities ``lps`` are known for the top tokens: temperature,
    then top-k, then top-p (vLLM's ``apply_top_k_top_p``). Raises when the
    dict cannot determine it (support wider than the dict)."""
    ranked = sorted(lps.items(), key=lambda kv: (-kv[1], kv[0]))
    if p.top_k:
        if len(ranked) < p.top_k:
            raise ValueError(f"top_k {p.top_k} needs {p.top_k} logprobs")
        ranked = ranked[: p.top_k]
        scaled = [(t, v / p.temperature) for t, v in ranked]
        z = max(v for _, v in scaled)
        w = [(t, math.exp(v - z)) for t, v in scaled]
        s = sum(x for _, x in w)
        probs = [(t, x / s) for t, x in w]
    elif p.temperature == 1.0:
        probs = [(t, math.exp(v)) for t, v in ranked]
        if p.top_p >= 1.0 or sum(x for _, x in probs) < p.top_p:
            raise ValueError("without top_k the support is the whole vocabulary")
    else:
        raise ValueError("a temperature other than 1 needs top_k")
    if p.top_p < 1.0:
        # ascending cumulative sum; drop while it stays <= 1 - p (vLLM)
        asc = sorted(probs, key=lambda kv: kv[1])
        # raw logprobs without top-k: the mass outside the dict (the
        # vocabulary's tail) comes first in the ascending sum
        cum, keep = max(0.0, 1.0 - sum(x for _, x in probs)), []
        for t, x in asc:
            cum += x
            if cum > 1 - p.top_p:
                keep.append((t, x))
        keep = keep or asc[-1:]
        probs = keep
    s = sum(x for _, x in probs)
    return {t: x / s for t, x in probs}


def in_support(lps: Mapping[int, float], token: int, p: Preset, tol: float) -> bool:
    """Whether ``token`` can be emitted, with logprobs uncertain by ``tol``
    nats: top-k: fewer than ``top_k`` tokens lie more than ``tol`` above it;
    top-p: the probability mass of the tokens more than ``tol`` above it,
    each scaled down by ``exp(-tol / T)``, stays below ``top_p``. ``lps``
    must hold the token (teacher-forced logprobs do) and, with top-k, the
    top ``top_k`` tokens. Without top-k at T != 1 the normaliser is unknown
    and top-p makes no claim."""
    v, t_ = lps[token], p.temperature
    above = [x for t, x in lps.items() if t != token and x > v + tol]
    if p.top_k and len(above) >= p.top_k:
        return False
    if p.top_p < 1.0:
        if p.top_k:
            support = sorted(lps.values(), reverse=True)[: p.top_k]
            z = max(support)
            logz = z / t_ + math.log(sum(math.exp((x - z) / t_) for x in support))
        elif t_ == 1.0:
            logz = 0.0  # raw logprobs are normalised
        else:
            return True
        mass = sum(math.exp(x / t_ - logz) for x in above) * math.exp(-tol / t_)
        if mass >= p.top_p:
            return False
    return True


def verify_support(
    reference: Sequence[Position], candidate: Sequence[int], name: str, tol: float
) -> Verification:
    """A sampled cell's check against the teacher-forced reference (its
    ``logprobs``): each emitted token must lie in the target's support
    (lossless methods); lossy methods (``synthetic``, ``fly``) are judged by
    the drift oracle alone."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} positions for {len(candidate)} tokens")
    p = preset(name)
    div, first = 0, None
    if p.lossless:
        for i, (ref, tok) in enumerate(zip(reference, candidate, strict=True)):
            if ref.logprobs is None or tok not in ref.logprobs:
                raise ValueError("verify_support needs teacher-forced logprobs")
            if not in_support(ref.logprobs, tok, p, tol):
                div += 1
                if first is None:
                    first = {
                        "position": i,
                        "margin": None,
                        "expected": f"a token of the {name} support",
                        "got": tok,
                    }
    return Verification(len(candidate), div, 0, first)


# ---------------------------------------------------------------------------
# the distribution test


def gof(counts: Mapping, probs: Mapping, min_expected: float = MIN_EXPECTED):
    """G-test of observed ``counts`` (outcome -> n) against ``probs``
    (outcome -> p). Outcomes with expected count below ``min_expected`` are
    pooled into one bin; an observed outcome of probability 0 makes the
    test fail outright (p-value 0). Returns ``(G, dof, pvalue)``."""
    from scipy.stats import power_divergence

    n = sum(counts.values())
    if any(probs.get(o, 0.0) <= 0.0 for o, c in counts.items() if c):
        return math.inf, 0, 0.0
    obs, exp = [], []
    pool_o = pool_e = 0.0
    for o, q in probs.items():
        e = n * q
        if e < min_expected:
            pool_o += counts.get(o, 0)
            pool_e += e
        else:
            obs.append(counts.get(o, 0))
            exp.append(e)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    if len(obs) < 2:
        return 0.0, 0, 1.0
    s = sum(exp)  # probs may sum to 1 within rounding
    exp = [e * n / s for e in exp]
    g, pv = power_divergence(obs, exp, lambda_="log-likelihood")
    return float(g), len(obs) - 1, float(pv)


def joint(conds: Mapping[tuple, Mapping[int, float]], length: int) -> dict:
    """Joint distribution of the first ``length`` tokens: ``conds[prefix]``
    is the conditional distribution after ``prefix`` (a tuple of tokens,
    ``()`` for the first)."""
    out = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for pre, q in out.items():
            for t, x in conds[pre].items():
                nxt[pre + (t,)] = q * x
        out = nxt
    return out


def bug_conditional(p: Mapping[int, float], draft: int, a: float) -> dict:
    """A one-hot draft ``draft`` accepted with probability ``a`` (correct:
    ``a = p[draft]``), otherwise a token from the residual ``p`` without the
    draft: the emitted distribution."""
    pd = p.get(draft, 0.0)
    if pd >= 1.0:
        return {draft: 1.0}  # nothing else can be emitted
    out = {t: (1 - a) * x / (1 - pd) for t, x in p.items() if t != draft}
    out[draft] = a
    return out


def wrong_acceptance(lps: Mapping[int, float], p: Preset, bug: str) -> float:
    """The acceptance probability of the target's argmax draft under
    ``bug``: ``temperature`` (acceptance from T=1 probabilities with the
    same truncation), ``truncation`` (from the untruncated, tempered
    distribution: top-k/top-p renormalisation missing)."""
    d = max(lps, key=lambda t: (lps[t], -t))
    if bug == "temperature":
        return target_dist(lps, Preset(1.0, p.top_p, p.top_k or len(lps)))[d]
    if bug == "truncation":
        full = Preset(p.temperature, 1.0, len(lps))
        return target_dist(lps, full)[d]
    raise ValueError(bug)


BUGS = ("temperature", "truncation")


def bug_joint(
    conds_lps: Mapping[tuple, Mapping[int, float]], p: Preset, length: int, bug: str
) -> dict:
    """The joint distribution when positions after the first are emitted by
    a buggy rejection sampler (the draft: the target's argmax there)."""
    conds = {}
    for pre, lps in conds_lps.items():
        q = target_dist(lps, p)
        if pre:
            d = max(lps, key=lambda t: (lps[t], -t))
            q = bug_conditional(q, d, wrong_acceptance(lps, p, bug))
        conds[pre] = q
    return joint(conds, length)


def power(
    n: int,
    p: Mapping,
    q: Mapping,
    level: float = LEVEL,
    min_expected: float = MIN_EXPECTED,
) -> float:
    """Power of ``gof`` with ``n`` samples against the alternative ``q``
    (noncentral chi-square with noncentrality ``2 n KL(q || p)`` on the
    bins ``gof`` would use)."""
    from scipy.stats import chi2, ncx2

    for d in (p, q):
        if abs(sum(d.values()) - 1.0) > 1e-9:
            raise ValueError(f"not a distribution: sums to {sum(d.values())}")
    keep = [o for o, x in p.items() if n * x >= min_expected]
    rest = [o for o in p if o not in set(keep)]
    pb = [p[o] for o in keep] + ([sum(p[o] for o in rest)] if rest else [])
    qb = [q.get(o, 0.0) for o in keep] + (
        [sum(q.get(o, 0.0) for o in rest)] if rest else []
    )
    dof = len(pb) - 1
    if dof < 1:
        return 0.0
    lam = 2 * n * sum(y * math.log(y / x) for x, y in zip(pb, qb, strict=True) if y > 0)
    return float(ncx2.sf(chi2.isf(level, dof), dof, lam))


def plan(
    p: Mapping,
    q: Mapping,
    target: float = POWER,
    level: float = LEVEL,
    cap: int = 10**7,
) -> int:
    """The fewest samples (doubling, then bisection) for which ``gof`` finds
    ``q`` with power ``target``; ``cap`` if even that many do not."""
    lo, hi = 1, 64
    while power(hi, p, q, level) < target:
        lo, hi = hi, hi * 2
        if hi > cap:
            return cap
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        if power(mid, p, q, level) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def g_tests(samples: Sequence[Sequence[int]], exact: Mapping) -> dict:
    """Report of one distribution test: per prefix length, the G-test of the
    samples' first tokens against the exact joint distribution."""
    length = len(next(iter(exact)))
    out = {}
    for j in range(1, length + 1):
        marg: dict[tuple, float] = {}
        for o, x in exact.items():
            marg[o[:j]] = marg.get(o[:j], 0.0) + x
        counts = Counter(tuple(s[:j]) for s in samples)
        g, dof, pv = gof(counts, marg)
        out[j] = {
            "G": round(g, 3) if math.isfinite(g) else "inf",
            "dof": dof,
            "p": pv,
            "ok": pv >= LEVEL,
        }
    return out
