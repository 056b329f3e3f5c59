"""Sampled decoding checks (harness.sampled) on CPU with synthetic data: the
target distribution mirrors vLLM's own top-k/top-p masking, the support
check, the G-test's level and its planned power against an acceptance bug
(a numpy rejection sampler, correct and buggy), and the sampled cells."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import numpy as np
import pytest

from harness import sampled
from harness.compare import Position
from harness.sampled import Preset

# the statistics need scipy (tests/requirements-cpu.txt); the rest not
needs_scipy = pytest.mark.skipif(
    importlib.util.find_spec("scipy") is None, reason="scipy missing"
)


def _lps(rng, vocab=48, scale=2.0):
    x = rng.normal(0, scale, vocab)
    x = x - x.max()
    return x - math.log(np.exp(x).sum())


@pytest.mark.parametrize(
    ("t", "p", "k"), [(0.7, 1.0, 5), (0.8, 0.9, 5), (1.3, 0.5, 8), (1.0, 0.8, 0)]
)
def test_target_dist_matches_vllm_masking(t, p, k):
    """k 0: no top-k at T=1, the dict holds the top 24 raw logprobs (the
    vocabulary's tail is outside it)."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    rng = np.random.default_rng(0)
    for _ in range(20):
        lp = _lps(rng)
        logits = torch.tensor(lp / t, dtype=torch.float32)[None]
        masked = ops.apply_top_k_top_p_pytorch(
            logits.clone(),
            torch.tensor([k]) if k else None,
            torch.tensor([p]) if p < 1 else None,
        )
        want = torch.softmax(masked, -1)[0].numpy()
        top = np.argsort(-lp)[: k or 24]
        got = sampled.target_dist({int(i): float(lp[i]) for i in top}, Preset(t, p, k))
        dense = np.zeros_like(want)
        for tok, q in got.items():
            dense[tok] = q
        np.testing.assert_allclose(dense, want, atol=1e-5)


def test_in_support():
    p = Preset(0.8, 1.0, 3)
    lps = {1: -0.2, 2: -2.0, 3: -2.5, 4: -2.6, 5: -6.0}
    assert sampled.in_support(lps, 3, p, tol=0.01)
    # top-p 0.9 at T=0.8: the top-3 hold 0.861, 0.091, 0.048
    assert sampled.in_support(lps, 2, Preset(0.8, 0.9, 3), tol=0.01)
    assert not sampled.in_support(lps, 3, Preset(0.8, 0.9, 3), tol=0.01)
    assert not sampled.in_support(lps, 5, p, tol=0.01)  # outside top-3
    assert sampled.in_support(lps, 4, p, tol=0.2)  # a tie with the 3rd
    assert not sampled.in_support(lps, 4, p, tol=0.01)
    # top-p: token 2 lies below a head holding > 0.9 of the mass
    peaked = {1: -0.01, 2: -5.0, 3: -6.0}
    assert not sampled.in_support(peaked, 2, Preset(1.0, 0.9, 3), tol=0.01)
    assert sampled.in_support(peaked, 2, Preset(1.0, 1.0, 3), tol=0.01)


def test_verify_support_lossless_and_lossy():
    refs = [
        Position.top(
            {1: -0.1, 2: -2.5, 3: -3.0, 4: -3.5, 5: -4.0, 6: -4.5, 9: -9.0}, candidate=9
        )
    ]
    v = sampled.verify_support(refs, [9], "t0.7-k5", tol=0.05)
    assert v.divergences == 1 and v.first["position"] == 0
    assert (
        sampled.verify_support(refs, [9], "t0.8-p0.9-k5:synthetic", 0.05).divergences
        == 0
    )
    assert sampled.verify_support(refs, [2], "t0.7-k5", 0.05).divergences == 0


def test_bug_conditional_identity():
    p = {1: 0.5, 2: 0.3, 3: 0.2}
    # accepting the draft with its own probability reproduces p
    assert sampled.bug_conditional(p, 2, 0.3) == pytest.approx(p)
    q = sampled.bug_conditional(p, 2, 0.6)
    assert q[2] == 0.6 and sum(q.values()) == pytest.approx(1.0)


def _rejection_sample(rng, conds_lps, preset, length, n, bug=None):
    """numpy reference of speculative sampling with a one-hot draft (the
    target's argmax) at every position after the first: accept with
    probability a (p[d], or the bug's), else draw from the residual."""
    out = []
    for _ in range(n):
        pre = ()
        for j in range(length):
            lps = conds_lps[pre]
            p = sampled.target_dist(lps, preset)
            toks = list(p)
            if j == 0:
                t = toks[rng.choice(len(toks), p=[p[x] for x in toks])]
            else:
                d = max(lps, key=lambda x: (lps[x], -x))
                a = (
                    p.get(d, 0.0)
                    if bug is None
                    else sampled.wrong_acceptance(lps, preset, bug)
                )
                if rng.random() < a:
                    t = d
                else:
                    rest = [x for x in toks if x != d]
                    w = np.array([p[x] for x in rest])
                    t = rest[rng.choice(len(rest), p=w / w.sum())]
            pre = pre + (t,)
        out.append(pre)
    return out


def _conds(rng, preset, length, vocab=12):
    conds, frontier = {}, [()]
    for _ in range(length):
        nxt = []
        for f in frontier:
            lp = _lps(rng, vocab, scale=1.5)
            conds[f] = {i: float(lp[i]) for i in range(vocab)}
            nxt += [f + (t,) for t in sampled.target_dist(conds[f], preset)]
        frontier = nxt
    return conds


@needs_scipy
@pytest.mark.parametrize("bug", sampled.BUGS)
def test_g_test_level_and_planned_power(bug):
    preset = Preset(0.7, 0.95, 4)
    length = 2
    rng = np.random.default_rng(7)
    conds = _conds(rng, preset, length)
    exact = sampled.joint(
        {f: sampled.target_dist(v, preset) for f, v in conds.items()}, length
    )
    wrong = sampled.bug_joint(conds, preset, length, bug)
    n = sampled.plan(exact, wrong, cap=200_000)
    assert sampled.power(n, exact, wrong) >= sampled.POWER
    assert n < 200_000, "the bug is detectable with a feasible sample count"
    # the correct sampler passes, the buggy one fails, at the planned count
    good = _rejection_sample(rng, conds, preset, length, n)
    bad = _rejection_sample(rng, conds, preset, length, n, bug)
    assert all(r["ok"] for r in sampled.g_tests(good, exact).values())
    assert not sampled.g_tests(bad, exact)[length]["ok"]


@needs_scipy
def test_power_is_calibrated_by_simulation():
    # noncentral chi-square power against multinomial simulation
    from scipy.stats import chi2

    p = {i: x for i, x in enumerate([0.4, 0.3, 0.2, 0.1])}
    q = {i: x for i, x in enumerate([0.37, 0.31, 0.21, 0.11])}
    n = sampled.plan(p, q, target=0.8, level=0.01)
    rng = np.random.default_rng(3)
    crit = chi2.isf(0.01, 3)
    hits = 0
    for _ in range(400):
        c = rng.multinomial(n, list(q.values()))
        g, _, _ = sampled.gof(dict(enumerate(c)), p)
        hits += g > crit
    assert abs(hits / 400 - 0.8) < 0.08
    null = sum(
        sampled.gof(dict(enumerate(rng.multinomial(n, list(p.values())))), p)[2] < 0.01
        for _ in range(400)
    )
    assert null / 400 < 0.03


@needs_scipy
def test_gof_rejects_impossible_outcome():
    g, _, pv = sampled.gof({1: 10, 2: 1}, {1: 1.0})
    assert pv == 0.0 and g == math.inf


def test_sampled_cells_cover_every_speculating_family():
    from harness import equivalence as eq
    from harness.models import FAMILY_KINDS, FIXTURES

    cells = [eq.Cell(**kw) for kw in sampled.cells()]
    fams = {c.model for c in cells}
    # every fixture of the matrix (Kimi-Linear included), and of the other
    # hybrid families those with a speculative path on some line (Mamba1:
    # refused by the fork) that vLLM loads; Bailing-MoE-linear's lightning
    # attention verifies drafts on both lines
    matrix = set(FIXTURES) - set(FAMILY_KINDS)
    assert "kimi_linear" in matrix
    speculating = set(sampled.speculating_families())
    assert speculating == {
        "falcon_h1", "zamba2", "mamba2", "lfm2", "lfm2_moe", "qwen3_5_moe",
        "olmo_hybrid", "bailing_moe_linear",
    }  # fmt: skip
    assert fams == matrix | {eq.FASTAPPLY} | speculating
    methods = {sampled.preset(c.sampling).method for c in cells}
    assert methods == set(sampled.LOSSLESS + sampled.LOSSY)
    assert eq.slice_cells("sampled") == cells
    for item in eq.dry_run(cells):
        kw = item["engine_kwargs"]
        p = sampled.preset(item["cell"]["sampling"])
        spec = kw["speculative_config"]
        if p.method in ("block", "synthetic", "fly"):
            assert spec["rejection_sample_method"] == p.method
        if p.method == "synthetic":
            assert (
                1
                <= spec["synthetic_acceptance_length"]
                <= spec["num_speculative_tokens"] + 1
            )
    # greedy cells keep their key and engine arguments
    g = eq.Cell("qwen3_5", "ngram", 5, 8)
    assert "sampling" not in g.key()
    assert sampled.sampling_kwargs("greedy") == {"temperature": 0.0}


class _FakeLLM:
    """A fake engine for harness.sampled_gof: next-token logprobs from the
    last token (vocab 64); sampled requests draw their tokens from the
    target distribution with their own seed; ``bug`` emits the argmax
    draft with the bug's acceptance probability after the first token."""

    def __init__(self, bug=None):
        self.bug = bug

    @staticmethod
    def lps(tokens):
        g = np.random.default_rng(tokens[-1] * 7919 + len(tokens) % 3)
        return {i: float(x) for i, x in enumerate(_lps(g, 64, scale=1.5))}

    def get_metrics(self):
        return []

    def generate(self, prompts, sp, use_tqdm=False):
        outs = []
        for i, pr in enumerate(prompts):
            toks = list(pr["prompt_token_ids"])
            if isinstance(sp, list):
                p = sampled.preset(self.name)
                rng = np.random.default_rng(sp[i].seed)
                out = []
                for j in range(sp[i].max_tokens):
                    lps = self.lps(toks + out)
                    q = sampled.target_dist(lps, p)
                    if j and self.bug:
                        d = max(lps, key=lambda x: (lps[x], -x))
                        a = sampled.wrong_acceptance(lps, p, self.bug)
                        q = sampled.bug_conditional(q, d, a)
                    keys = list(q)
                    out.append(keys[rng.choice(len(keys), p=[q[x] for x in keys])])
                gen = SimpleNamespace(token_ids=out, logprobs=None)
            else:
                lps = self.lps(toks)
                top = sorted(lps, key=lambda x: -lps[x])[: sp.logprobs or 1]
                lp = [{t: SimpleNamespace(logprob=lps[t]) for t in top}]
                gen = SimpleNamespace(token_ids=[top[0]], logprobs=lp)
            outs.append(SimpleNamespace(outputs=[gen]))
        return outs


@needs_scipy
@pytest.mark.parametrize("bug", [None, "truncation"])
def test_sampled_gof_main_with_a_fake_engine(monkeypatch, tmp_path, bug):
    import json

    from harness import equivalence as eq
    from harness import models, sampled_gof

    name = "t0.8-p0.9-k5"
    fake = _FakeLLM(bug)
    fake.name = name
    monkeypatch.setattr(eq, "_engine", lambda cell, d: fake)
    monkeypatch.setattr(eq, "_shutdown", lambda llm: None)
    monkeypatch.setattr(models, "write_model", lambda kind, out, seed=0: out)
    cap = "50000"
    sampled_gof.main(
        [
            "--preset",
            name,
            "--length",
            "3",
            "--drafter",
            "ngram",
            "--cap",
            cap,
            "--out",
            str(tmp_path),
        ]
    )
    (f,) = tmp_path.glob("gof-*.json")
    r = json.loads(f.read_text())
    # the planned count fits the cap here, and reaches the planned power
    assert r["samples"] == max(r["planned"].values()) < int(cap)
    assert min(r["power"].values()) >= sampled.POWER and r["powered"]
    assert set(r["tests"]) == {"1", "2", "3"}
    # the correct sampler passes; the buggy one fails (positions 2 and 3)
    assert r["ok"] is (bug is None), r["tests"]
    if bug:
        assert r["tests"]["1"]["ok"]  # the first token is not speculative


def test_sampled_gof_refuses_float32_for_fla_fixtures(capsys):
    """FLA's chunked kernels (Gated DeltaNet, KDA) refuse float32 on CUDA:
    the test says so before it starts an engine, and names the fixture to
    use; bfloat16 or a Mamba2 fixture pass the check."""
    from harness import sampled_gof

    with pytest.raises(SystemExit) as e:
        sampled_gof.main(["--model", "qwen3_5"])
    assert e.value.code == 2
    assert "--model nemotron_h" in capsys.readouterr().err
    assert sampled_gof.float32_refusal("qwen3_5", "bfloat16") is None
    assert sampled_gof.float32_refusal("nemotron_h", "float32") is None
    # derived from the fixtures' mixers: every GDN and KDA fixture
    fla = {m for m in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear",
                       "olmo_hybrid", "fastapply", "nemotron_h", "zamba2",
                       "lfm2", "jamba") if sampled_gof.runs_fla(m)}  # fmt: skip
    assert fla == {"qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear",
                   "olmo_hybrid", "fastapply"}  # fmt: skip
