"""The drift oracle (harness.oracle) on synthetic logprob data, and wired
into harness.equivalence.run_cells with a fake engine (no vLLM engine, no
GPU): a drift above the floor fails, one at the floor passes, a divergence
is still caught, a tie still tolerated; reports show the worst drift."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from harness import oracle
from harness.compare import Position, verify

VOCAB = 256  # the fixtures' (prompt ids reach FIRST_SPECIAL_ID)


def _log_softmax(x):
    x = x - x.max()
    return x - math.log(np.exp(x).sum())


def _dict(lp, token, k=oracle.TOPK):
    top = np.argsort(-lp, kind="stable")[:k]
    d = {int(t): float(lp[t]) for t in top}
    d[int(token)] = float(lp[token])
    return d


def _seq(rng, n, noise, bump=None):
    """Reference and candidate dicts of n positions: candidate logits =
    reference logits + noise (and ``bump`` = (position, nats) added to the
    third-ranked token: a drift that flips no argmax)."""
    refs, cands, toks = [], [], []
    for i in range(n):
        logits = rng.normal(0, 3, VOCAB)
        c = logits + rng.normal(0, noise, VOCAB)
        if bump and bump[0] == i:
            third = np.argsort(-logits)[2]
            c[third] += bump[1]
        lr, lc = _log_softmax(logits), _log_softmax(c)
        tok = int(np.argmax(lr))
        refs.append(_dict(lr, tok))
        cands.append(_dict(lc, tok))
        toks.append(tok)
    return refs, cands, toks


def _floor(noise, seqs=8, n=64, seed=0):
    rng = np.random.default_rng(seed)
    f = oracle.Floor()
    for _ in range(seqs):
        refs, cands, toks = _seq(rng, n, noise)
        f.add(cands, refs, toks)
    return f


def test_position_drift_values_and_lower_bounds():
    ref = {1: -0.1, 2: -2.0, 3: -3.0}
    cand = {1: -0.15, 2: -2.0, 4: -2.5}
    d = oracle.position_drift(cand, ref, 1, k=3)
    assert d.token == pytest.approx(0.05)
    # token 4: in cand's top-3 only, ref value <= ref's 3rd (-3.0): >= 0.5
    assert d.topk == pytest.approx(0.5)
    assert d.set_changed
    # the entry behind it: token 4, absent from ref's dict, rank 2 in cand's
    assert d.topk_entry == (4, -2.5, None, 2, None)
    same = oracle.position_drift(ref, ref, 2, k=3)
    assert (same.token, same.topk, same.set_changed) == (0.0, 0.0, False)
    nan = oracle.position_drift({1: float("nan"), 2: -1.0}, ref, 1, k=3)
    assert nan.token == math.inf
    # a NaN that does not sort into the top-k is still one
    late = {1: -0.1, 2: -2.0, 3: -3.0, 4: float("nan")}
    assert oracle.position_drift(late, ref, 1, k=2).topk == math.inf


def test_deep_tail_rounding_step_is_allowed_a_real_drift_is_not():
    # A top-5 entry at log-probability -40 moves in bf16 steps of 0.25: a
    # floor of one step and a candidate 1.5 steps off (the logits rounded
    # the other way) is noise; one nat off at the same depth is not.
    floor = oracle.Floor()
    floor.token, floor.topk, floor.positions = 0.0, 0.25, 1000
    ref = {1: -0.01, 2: -5.0, 3: -40.0}

    def judged(cand):
        cell = oracle.CellDrift()
        cell.add(0, [cand], [ref], [1])
        return cell.judge(floor, "bfloat16")["drift_violations"]

    assert judged({1: -0.01, 2: -5.0, 3: -40.375}) == 0
    assert judged({1: -0.01, 2: -5.0, 3: -41.0}) == 1
    # the report names the entry that moved, its two values and ranks
    cell = oracle.CellDrift()
    cell.add(0, [{1: -0.01, 2: -5.0, 3: -41.0}], [ref], [1])
    assert cell.judge(floor, "bfloat16")["first_drift"]["topk_entry"] == {
        "token": 3, "candidate": -41.0, "reference": -40.0,
        "candidate_rank": 2, "reference_rank": 2,
    }  # fmt: skip
    # near zero the allowance is the floor alone: the emitted token's
    # log-probability may not move by a nat
    assert judged({1: -1.01, 2: -5.0, 3: -40.0}) == 1


def test_threshold_rounds_up_to_the_floors_rounding_step():
    # A fixture whose logits are 16-32 in size: top-k entries move in steps
    # of 0.125 at any depth (a drift of -5.0 vs -5.375 is three steps, not a
    # deep-tail value the magnitude allowance would cover). A floor of two
    # steps and a factor of 1.46 (0.365) must not fail a third step, which
    # is all a correct run's drift can reach next; a fourth step fails.
    assert oracle.step(0.25) == 0.125
    assert oracle.step(0.116974) == 0.03125
    assert oracle.step(0.0) == 0.0
    assert oracle.threshold(0.25, "bfloat16", 1.46) == pytest.approx(0.375)
    floor = oracle.Floor()
    floor.token, floor.topk, floor.positions = 0.0, 0.25, 39921
    ref = {1: -0.01, 2: -5.0, 3: -7.0}

    def judged(cand, m):
        cell = oracle.CellDrift()
        for p in range(m):
            cell.add(p, [cand if p == 0 else ref], [ref], [1])
        return cell.judge(floor, "bfloat16")

    j = judged({1: -0.01, 2: -5.375, 3: -7.0}, 5307)
    assert 1.4 < j["drift_factor"] < 1.5
    assert j["drift_violations"] == 0
    assert judged({1: -0.01, 2: -5.5, 3: -7.0}, 5307)["drift_violations"] == 1


def test_rejudge_settles_reports_written_under_the_older_threshold():
    # a fast-apply cell reported under the older rule: one third step over
    # a floor of two, no argmax flip; the step rule reads it ok. A drift
    # beyond the new bar, or a cell with a flip, is left as it was.
    row = {"status": "diverged", "divergences": 0, "dtype": "bfloat16",
           "drift_floor": 0.0001, "drift_topk_floor": 0.249997,
           "drift_factor": 1.462, "drift_max": 2e-06,
           "drift_topk_max": 0.374998, "drift_violations": 1,
           "first_drift": {"prompt": 37}}  # fmt: skip
    r = oracle.rejudge(row)
    assert r["status"] == "ok" and r["drift_violations"] == 0
    assert r["drift_rejudged"] and r["drift_topk_threshold"] == 0.375
    assert row["status"] == "diverged"  # the input is not changed
    assert oracle.rejudge({**row, "drift_topk_max": 0.5})["status"] == "diverged"
    flip = oracle.rejudge({**row, "divergences": 2})
    assert flip["status"] == "diverged" and flip["drift_violations"] == 0
    ok = {"status": "ok", "drift_violations": 0}
    assert oracle.rejudge(ok) is ok


def test_factor_follows_sample_sizes():
    # more floor positions: a smaller factor; more cell positions: larger
    assert oracle.factor(10_000, 1000) < oracle.factor(100, 1000)
    assert oracle.factor(1000, 100_000) > oracle.factor(1000, 100)
    assert oracle.factor(10**9, 1) == 1.0
    # the false-alarm rate it stands for: M * N**-c == ALPHA
    n, m = 1500, 6000
    c = oracle.factor(n, m)
    assert m * n**-c == pytest.approx(oracle.ALPHA)


def test_drift_above_floor_fails_at_floor_passes():
    noise = 0.01
    floor = _floor(noise)
    rng = np.random.default_rng(1)
    ok = oracle.CellDrift()
    for p in range(8):
        refs, cands, toks = _seq(rng, 64, noise)
        ok.add(p, cands, refs, toks)
    j = ok.judge(floor, "bfloat16")
    assert j["drift_violations"] == 0
    # a drift exactly at the floor passes (the factor is at least 1)
    at = oracle.CellDrift()
    ref = {1: -0.5, 2: -1.0}
    at.add(0, [{1: -0.5 - floor.token, 2: -1.0}], [ref], [1])
    assert at.judge(floor, "bfloat16")["drift_violations"] == 0
    # a bump far above the threshold at one position fails there
    thr = j["drift_threshold"]
    bad = oracle.CellDrift()
    rng = np.random.default_rng(2)
    for p in range(8):
        bump = (17, 3 * thr + 0.3) if p == 5 else None
        refs, cands, toks = _seq(rng, 64, noise, bump)
        bad.add(p, cands, refs, toks)
    jb = bad.judge(floor, "bfloat16")
    assert jb["drift_violations"] >= 1
    assert jb["first_drift"]["prompt"] == 5
    assert jb["first_drift"]["position"] == 17
    # the worst position, with the emitted token's size and its bars
    worst = jb["drift_worst_at"]
    assert (worst["prompt"], worst["position"]) == (5, 17)
    assert worst["topk_drift"] > worst["topk_limit"] > 0
    assert worst["drift"] <= worst["limit"] and worst["magnitude"] >= 0


def _peaked(rng, n, noise, rank=0, bump=0.0):
    """A trained fixture's positions: one near-certain token (logit +12),
    a few others of -3 to -8, the rest deep; the candidate's logits carry
    ``noise`` and it emits the ``rank``-th token (a sampled or synthetic
    acceptance run emits unlikely ones), whose logit ``bump`` moves."""
    refs, cands, toks = [], [], []
    for _ in range(n):
        logits = rng.normal(-8, 1, VOCAB)
        logits[rng.choice(VOCAB, 4, replace=False)] = rng.uniform(5, 9, 4)
        logits[rng.integers(VOCAB)] = 12.0
        tok = int(np.argsort(-logits, kind="stable")[rank])
        c = logits + rng.normal(0, noise, VOCAB)
        c[tok] += bump
        lr, lc = _log_softmax(logits), _log_softmax(c)
        refs.append(_dict(lr, tok))
        cands.append(_dict(lc, tok))
        toks.append(tok)
    return refs, cands, toks


def test_an_unlikely_emitted_token_is_judged_by_the_floor_at_its_size():
    # The floor runs emit the near-certain token: its log-probability
    # barely moves, so the plain token floor is about zero. A correct
    # candidate that emits the second-ranked token (about -4 nats) carries
    # the same logit noise as the floor's top-k entries of that size and
    # passes; one whose emitted token's logit is off by half a nat fails.
    noise = 0.02
    rng = np.random.default_rng(0)
    floor = oracle.Floor()
    for _ in range(12):
        refs, cands, toks = _peaked(rng, 64, noise)
        floor.add(cands, refs, toks)
    assert floor.token < 0.01 < floor.at(4.0)
    assert floor.at(0.01) <= floor.token + 1e-12  # near-certain: still tight

    def judged(bump):
        cell = oracle.CellDrift()
        r = np.random.default_rng(1)
        for p in range(8):
            refs, cands, toks = _peaked(r, 64, noise, rank=1, bump=bump)
            cell.add(p, cands, refs, toks)
        return cell.judge(floor, "bfloat16")

    ok = judged(0.0)
    assert ok["drift_max"] > 2 * ok["drift_threshold"]  # the old rule's bar
    assert ok["drift_violations"] == 0
    assert ok["drift_floor_by_magnitude"]
    assert judged(0.5)["drift_violations"] > 0


def test_a_size_the_floor_never_saw_takes_the_next_larger_one():
    # A trained fixture's floor (from the sampled fast-apply cells): entries
    # near 0 and at 16-32, nothing between. A token of -3 is judged by the
    # 16 bucket times 1 - p (the log-sum-exp's rounding moves it nearly as
    # much); one of -0.1 (p = 0.9) by a tenth of it; the near-certain ones
    # stay at their own floor; where a smaller size was seen, a larger one
    # is not borrowed.
    f = oracle.Floor()
    f.by_mag = {oracle.LOWEST: 1e-5, 4: 0.1875, 5: 0.1875}
    assert f.at(0.01) == 1e-5
    assert f.at(3.0) == pytest.approx(0.1875 * (1 - math.exp(-3.0)))
    assert f.at(0.1) == pytest.approx(0.1875 * (1 - math.exp(-0.1)))
    assert f.at(0.1) < 0.02
    assert f.at(20.0) == 0.1875
    dense = oracle.Floor()
    dense.by_mag = {oracle.LOWEST: 0.003, 1: 0.07, 3: 0.2}
    assert dense.at(3.0) == 0.07
    assert oracle.Floor().at(3.0) == 0.0


def test_floor_is_not_below_dtype_precision():
    floor = oracle.Floor(token=0.0, topk=0.0, positions=1000)
    d = oracle.CellDrift()
    eps = oracle.EPS["bfloat16"]
    d.add(0, [{1: -1.0 - eps / 2, 2: -2.0}], [{1: -1.0, 2: -2.0}], [1])
    assert d.judge(floor, "bfloat16")["drift_violations"] == 0
    assert d.judge(floor, "float32")["drift_violations"] == 1


def test_floor_pair_stops_after_first_difference():
    a = [{1: -0.1, 2: -3.0}, {3: -0.2, 4: -2.0}, {5: -0.1, 6: -3.0}]
    b = [{1: -0.1, 2: -3.0}, {4: -0.21, 3: -0.19}, {7: -9.0, 8: -9.5}]
    f = oracle.Floor()
    f.add_pair(a, b, [1, 3, 5], [1, 4, 7])
    assert f.positions == 2  # position 0 and the first differing one
    assert f.topk == pytest.approx(1.79)


def test_divergence_still_caught_and_tie_tolerated():
    # a flip at a decisive position is a divergence; at a near tie a tie,
    # and neither the tie's logprobs nor the divergence's drift
    ref = [Position.top({1: -0.1, 2: -3.0}, candidate=2),
           Position.top({3: -0.69, 4: -0.70}, candidate=4)]  # fmt: skip
    v = verify(ref, [2, 4], tie_margin=0.05)
    assert (v.divergences, v.ties) == (1, 1)
    assert ref[0].logprobs == {1: -0.1, 2: -3.0}
    # the candidate's own logprobs at the tie (its token is the second
    # choice, values within the floor): no drift violation either
    floor = oracle.Floor(token=0.01, topk=0.01, positions=1000)
    d = oracle.CellDrift()
    d.add(0, [{3: -0.695, 4: -0.695}], [ref[1].logprobs], [4])
    assert d.judge(floor, "bfloat16")["drift_violations"] == 0


def test_with_floor_same_engine_other_batches():
    calls = []

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        calls.append((waves, logprobs, batches))
        return [f"out{p[0]}" for w in waves for p in w], {}

    wave = [[1], [2], [3], [4], [5], [6]]
    outs, fouts = oracle.with_floor(fake_generate, "cell", "dir", wave, 6)
    ((waves, logprobs, batches),) = calls  # one engine
    assert waves == [wave, wave[::-1]] and batches == [6, 2]
    assert logprobs == oracle.TOPK
    assert outs == fouts == [f"out{i}" for i in range(1, 7)]


# ---------------------------------------------------------------------------
# run_cells with a fake engine


class FakeLLM:
    """Deterministic fake model: logits from the last two tokens; each
    engine adds its own noise (kernel noise); ``bump`` lowers the
    third-ranked token from position ``bump[0]`` of each continuation in
    speculative cells; ``flip`` makes speculative cells emit the second
    choice at a decisive position."""

    engines = 0

    def __init__(self, cell, noise, bump=None, flip=None, preemptions=None):
        FakeLLM.engines += 1
        self.rng = np.random.default_rng(1000 + FakeLLM.engines)
        self.spec = cell.drafter != "none"
        self.noise, self.bump, self.flip = noise, bump, flip
        # what the engine reports as vllm:num_preemptions (None: no metric)
        self.preemptions = preemptions
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(
                cache_config=SimpleNamespace(block_size=16),
                scheduler_config=SimpleNamespace(async_scheduling=False),
                use_v2_model_runner=False,
            )
        )

    def get_metrics(self):
        if self.preemptions is None:
            return []
        return [SimpleNamespace(name="vllm:num_preemptions", value=self.preemptions)]

    def logprobs(self, seq, gen_pos):
        g = np.random.default_rng(
            hash((seq[-1], seq[-2] if len(seq) > 1 else -1)) % 2**32
        )
        logits = g.normal(0, 3, VOCAB) + self.rng.normal(0, self.noise, VOCAB)
        if self.spec and self.bump and gen_pos >= self.bump[0]:
            # lowered: no argmax can flip
            logits[np.argsort(-logits)[2]] -= self.bump[1]
        return _log_softmax(logits)

    def generate(self, prompts, sp, use_tqdm=False):
        outs = []
        for pr in prompts:
            toks = list(pr["prompt_token_ids"])
            if sp.prompt_logprobs:
                plp = [None]
                for i in range(1, len(toks)):
                    lp = self.logprobs(toks[:i], None)
                    plp.append({t: SimpleNamespace(logprob=v)
                                for t, v in _dict(lp, toks[i]).items()})  # fmt: skip
                gen = SimpleNamespace(token_ids=[0], logprobs=None)
                outs.append(SimpleNamespace(prompt_logprobs=plp, outputs=[gen]))
                continue
            out, lps = [], []
            for j in range(sp.max_tokens):
                lp = self.logprobs(toks + out, j)
                tok = int(np.argmax(lp))
                if self.spec and self.flip == j:
                    tok = int(np.argsort(-lp)[1])
                out.append(tok)
                lps.append({t: SimpleNamespace(logprob=v)
                            for t, v in _dict(lp, tok).items()})  # fmt: skip
            gen = SimpleNamespace(token_ids=out, logprobs=lps if sp.logprobs else None)
            # n > 1: the same completion n times (a stand-in for n samples)
            outs.append(SimpleNamespace(prompt_logprobs=None, outputs=[gen] * sp.n))
        return outs


def _run(monkeypatch, tmp_path, preempt=False, **fake):
    from harness import equivalence as eq
    from harness import models

    monkeypatch.setattr(eq, "_engine", lambda cell, d: FakeLLM(cell, **fake))
    monkeypatch.setattr(eq, "_shutdown", lambda llm: None)
    monkeypatch.setattr(models, "write_model", lambda kind, out, seed=0: out)
    cells = [eq.Cell("qwen3_5", "ngram", 5, 4, max_tokens=24, preempt=preempt)]
    return eq.run_cells(cells, tmp_path, n_prompts=4, seed=0)


def test_a_preemption_cell_that_never_preempted_is_invalid(monkeypatch, tmp_path):
    """A preemption cell is judged only where the engine preempted: with
    vllm:num_preemptions 0 it is an error (an invalid cell), not ok."""
    (row,) = _run(monkeypatch, tmp_path, preempt=True, noise=1e-3, preemptions=0)
    assert row["status"] == "error" and "never preempted" in row["error"]
    assert row["preemptions"] == 0 and row["divergences"] == 0
    (row,) = _run(monkeypatch, tmp_path, preempt=True, noise=1e-3, preemptions=3)
    assert row["status"] == "ok" and row["preemptions"] == 3
    # a cell that is not a preemption cell does not look at the counter
    (row,) = _run(monkeypatch, tmp_path, noise=1e-3, preemptions=0)
    assert row["status"] == "ok" and "preemptions" not in row


def test_run_cells_clean_cell_passes(monkeypatch, tmp_path):
    (row,) = _run(monkeypatch, tmp_path, noise=1e-3)
    assert row["status"] == "ok", row
    assert row["drift_violations"] == 0
    assert 0 < row["drift_max"] <= row["drift_threshold"]
    assert row["drift_floor_positions"] > 0


def test_run_cells_drift_without_flip_fails(monkeypatch, tmp_path):
    (row,) = _run(monkeypatch, tmp_path, noise=1e-3, bump=(10, 0.5))
    assert row["divergences"] == 0  # no argmax flipped
    assert row["status"] == "diverged" and row["drift_violations"] > 0
    assert row["first_drift"]["position"] == 10
    from harness.report import markdown, validate

    validate(row)
    assert "over" in markdown([row], "t")


def test_run_cells_divergence_still_caught(monkeypatch, tmp_path):
    (row,) = _run(monkeypatch, tmp_path, noise=1e-3, flip=6)
    assert row["status"] == "diverged" and row["divergences"] > 0


def _ngram_and_mtp_cells(monkeypatch, tmp_path, engine) -> list[dict]:
    """run_cells over an n-gram and an MTP cell of the Qwen3.5 fixture, with
    ``engine(cell, model_dir)`` in place of vLLM."""
    from harness import equivalence as eq
    from harness import models

    monkeypatch.setattr(eq, "_engine", engine)
    monkeypatch.setattr(eq, "_shutdown", lambda llm: None)
    monkeypatch.setattr(models, "write_model", lambda kind, out, seed=0: out)
    cells = [eq.Cell("qwen3_5", "ngram", 5, 4, max_tokens=24),
             eq.Cell("qwen3_5", "mtp", 3, 4, max_tokens=24)]  # fmt: skip
    return eq.run_cells(cells, tmp_path, n_prompts=4, seed=0)


def test_run_time_value_error_is_an_error_not_a_refusal(monkeypatch, tmp_path):
    """vLLM runs in-process, so a ValueError raised while a speculative
    engine decodes reaches run_cells as such: the cell's error. Only one
    raised while the engine is built is a refusal ("rejected")."""

    class Broken(FakeLLM):
        def generate(self, prompts, sp, use_tqdm=False):
            if self.spec:
                raise ValueError("index 9 is out of bounds for dimension 0")
            return super().generate(prompts, sp, use_tqdm)

    def engine(cell, d):
        if cell.drafter == "mtp":
            raise ValueError("MTP is not supported for this model")
        return Broken(cell, noise=1e-3)

    rows = _ngram_and_mtp_cells(monkeypatch, tmp_path, engine)
    assert [r["status"] for r in rows] == ["error", "rejected"]


def test_a_missing_model_directory_is_not_a_refusal(monkeypatch, tmp_path):
    """pydantic raises a ValueError for a model directory that is not there
    (a fixture that did not reach the host): that cell never ran. It is an
    error, not a refusal, and summaries read it as not run."""
    from harness import full_matrix

    missing = (
        "1 validation error for ModelConfig\n  Value error, Invalid repository "
        "ID or local directory specified: '/w/fixtures/fastapply'."
    )

    def engine(cell, d):
        llm = FakeLLM(cell, noise=1e-3)
        if not llm.spec:  # the reference
            return llm
        if cell.drafter == "mtp":
            raise ValueError("MTP is not supported for this model")
        raise ValueError(missing)

    rows = _ngram_and_mtp_cells(monkeypatch, tmp_path, engine)
    assert [r["status"] for r in rows] == ["error", "rejected"]
    # rows written before the rule: refused (vLLM's and huggingface_hub's
    # words for a directory that is not there), the weights file missing
    hub = ("HFValidationError: Repo id must be in the form 'repo_name' or "
           "'namespace/repo_name': '/w/repo/fixtures/fastapply'.")  # fmt: skip
    old = [{**rows[0], "status": "rejected"},
           {**rows[0], "k": 7, "status": "rejected", "error": hub},
           {**rows[1], "drafter": "ngram", "k": 9, "status": "error",
            "error": "FileNotFoundError: No such file or directory: "
                     "/w/fixtures/fastapply/model.safetensors"}]  # fmt: skip
    (tmp_path / "s-fork.json").write_text(json.dumps(old + [rows[1]]))
    got = full_matrix.collect(tmp_path)["fork"]
    assert [c["status"] for c, _ in got.values()] == ["rejected"]
    assert [c["drafter"] for c, _ in got.values()] == ["mtp"]


def test_a_refused_candidate_needs_no_reference(monkeypatch, tmp_path):
    """A base model that fails without speculation (Plamo2 on v0.26.0 on a
    GPU) left its speculative cells errored with the reference's error,
    though the fork refuses them at config time. A refused configuration
    needs no reference: the cell reports the refusal. A candidate that is
    not refused keeps the reference's error."""

    built = []

    class BrokenBase(FakeLLM):
        def generate(self, prompts, sp, use_tqdm=False):
            raise RuntimeError("rms_norm, layernorm_kernels.cu:233")

    def engine(cell, d):
        built.append(cell.drafter)
        if cell.drafter == "ngram":
            raise ValueError(
                "Speculative decoding is not supported for Plamo2ForCausalLM"
            )
        return BrokenBase(cell, noise=1e-3)

    rows = _ngram_and_mtp_cells(monkeypatch, tmp_path, engine)
    assert [r["status"] for r in rows] == ["rejected", "error"]
    assert "not supported for Plamo2ForCausalLM" in rows[0]["error"]
    assert "rms_norm" in rows[1]["error"]
    # each cell: its reference, then its candidate's engine (built only)
    assert built == ["none", "ngram", "none", "mtp"]


def test_full_matrix_summary_names_worst_drift(tmp_path, monkeypatch):
    from harness import full_matrix

    cell = {"model": "qwen3_5", "runner": "v1", "cache_mode": "none",
            "drafter": "ngram", "k": 5, "batch": 8, "graphs": "eager",
            "async": False, "chunked": False, "preempt": False,
            "kv_cache_dtype": "auto", "status": "ok", "tokens": 10,
            "divergences": 0, "ties": 0, "drift_max": 0.02,
            "drift_threshold": 0.08, "drift_topk_max": 0.03,
            "drift_topk_threshold": 0.09, "drift_violations": 0}  # fmt: skip
    (tmp_path / "x-fork.json").write_text(json.dumps([cell]))
    monkeypatch.setattr(full_matrix, "expected_cells",
                        lambda: [("x", {k: cell[k] for k in cell})])  # fmt: skip
    monkeypatch.setattr("harness.report.heatmap", lambda *a, **k: None)
    full_matrix.summarize(tmp_path, "t")
    text = (tmp_path / "FULL.md").read_text()
    assert "worst drift: 0.02 nats, 0.25 of its threshold" in text
    assert "drift 0.02/0.08" in text


def test_run_cells_drift_report_mode(monkeypatch, tmp_path):
    monkeypatch.setenv(oracle.DRIFT_ENV, "report")
    (row,) = _run(monkeypatch, tmp_path, noise=1e-3, bump=(10, 0.5))
    assert row["status"] == "ok" and row["drift_violations"] > 0
    from harness.report import markdown, validate

    validate(row)
    assert "over" in markdown([row], "t")
    monkeypatch.setenv(oracle.DRIFT_ENV, "nonsense")
    with pytest.raises(ValueError):
        oracle.enforced()


@pytest.mark.parametrize("cache_mode", ["none", "align"])
def test_run_cells_judges_every_completion_of_an_n2_cell(
    monkeypatch, tmp_path, cache_mode
):
    """request="n2" (a sampled cell, two completions per prompt): every
    completion is verified against teacher forcing of its own prompt; in
    align mode the second wave continues the (one-completion) reference."""
    from harness import equivalence as eq
    from harness import models

    monkeypatch.setattr(eq, "_engine", lambda cell, d: FakeLLM(cell, noise=1e-3))
    monkeypatch.setattr(eq, "_shutdown", lambda llm: None)
    monkeypatch.setattr(models, "write_model", lambda kind, out, seed=0: out)
    cells = [eq.Cell("qwen3_5", "ngram", 5, 4, cache_mode=cache_mode,
                     max_tokens=24, sampling="t1", request="n2")]  # fmt: skip
    (row,) = eq.run_cells(cells, tmp_path, n_prompts=4, seed=0)
    waves = 2 if cache_mode == "align" else 1
    assert row["status"] == "ok", row.get("error")
    assert row["prompts"] == 8 * waves and row["tokens"] == 8 * 24 * waves


def _run_sampled(
    monkeypatch, tmp_path, spec_noise, ctx_noise, bump=None, ctx_fails=False,
    sampling="t1", chunked_engines=None,
):  # fmt: skip
    """One sampled cell (``sampling`` "greedy": a greedy one); the speculative
    engine and the context floor's chunked teacher-forced pass with noise of
    their own, every other engine 1e-3. ``chunked_engines``: a list that
    gets one entry per chunked engine started."""
    from harness import equivalence as eq
    from harness import models

    def engine(cell, d):
        if cell.chunked:
            if chunked_engines is not None:
                chunked_engines.append(cell)
            if ctx_fails:
                raise RuntimeError("no chunked engine here")
            return FakeLLM(cell, noise=ctx_noise)
        if cell.drafter != "none":
            return FakeLLM(cell, noise=spec_noise, bump=bump)
        return FakeLLM(cell, noise=1e-3)

    monkeypatch.setattr(eq, "_engine", engine)
    monkeypatch.setattr(eq, "_shutdown", lambda llm: None)
    monkeypatch.setattr(models, "write_model", lambda kind, out, seed=0: out)
    cells = [eq.Cell("qwen3_5", "ngram", 5, 4, max_tokens=24, sampling=sampling)]
    (row,) = eq.run_cells(cells, tmp_path, n_prompts=4, seed=0)
    return row


def test_a_greedy_cell_over_the_plain_floor_gets_the_context_floor(
    monkeypatch, tmp_path
):
    """A greedy speculative cell whose drift exceeds the plain floor is
    judged again with the context floor of its own tokens (a verify row is
    a short prefill chunk of its own); one within the plain floor starts no
    chunked engine. A real change is not hidden by it."""
    started: list = []
    quiet = _run_sampled(monkeypatch, tmp_path, spec_noise=1e-3, ctx_noise=0.05,
                         sampling="greedy", chunked_engines=started)  # fmt: skip
    assert quiet["status"] == "ok" and "drift_context_floor" not in quiet
    assert started == []
    noisy = _run_sampled(monkeypatch, tmp_path, spec_noise=0.05, ctx_noise=0.05,
                         sampling="greedy", chunked_engines=started)  # fmt: skip
    # (drift only: this much noise can also flip a near-tie of the fake
    # model, which the argmax oracle judges by its own margin)
    assert noisy["drift_violations"] == 0, json.dumps(noisy)
    assert noisy["drift_context_floor_why"] == "over the plain floor"
    assert noisy["drift_context_floor_positions"] > 0 and len(started) == 1
    # the same drift where the chunked prefill agrees with the reference
    bad = _run_sampled(monkeypatch, tmp_path, spec_noise=0.05, ctx_noise=1e-3,
                       sampling="greedy")  # fmt: skip
    assert bad["status"] == "diverged" and bad["drift_violations"] > 0
    assert bad["drift_context_floor_why"] == "over the plain floor"
    # a lowered third choice: over the plain floor, so the context floor is
    # measured, and both of its prefills are non-speculative: still diverged
    row = _run_sampled(monkeypatch, tmp_path, spec_noise=1e-3, ctx_noise=1e-3,
                       bump=(10, 0.5), sampling="greedy")  # fmt: skip
    assert row["drift_context_floor_why"] == "over the plain floor"
    assert row["status"] == "diverged" and row["drift_violations"] > 0


def test_a_sampled_cell_is_judged_with_the_context_floor_of_its_own_tokens(
    monkeypatch, tmp_path
):
    """A sampled candidate's drift is judged against the greedy floor and
    the drift of a second, chunked prefill of its own tokens: drift that
    two non-speculative prefills show in the candidate's contexts is noise
    there. Without that floor the same drift fails; a change of the
    candidate's own distribution (a lowered third choice) still fails with
    it, since both prefills are non-speculative."""
    noisy = _run_sampled(monkeypatch, tmp_path, spec_noise=0.05, ctx_noise=0.05)
    assert noisy["status"] == "ok", json.dumps(noisy)
    assert noisy["drift_context_floor_positions"] == noisy["drift_positions"] > 0
    # the same candidate where the prefills agree: the greedy floor alone
    quiet = _run_sampled(monkeypatch, tmp_path, spec_noise=0.05, ctx_noise=1e-3)
    assert quiet["status"] == "diverged" and quiet["drift_violations"] > 0
    assert noisy["drift_context_topk_floor"] > 10 * quiet["drift_context_topk_floor"]
    # a real change is not hidden by a context floor of the same tokens
    row = _run_sampled(monkeypatch, tmp_path, spec_noise=1e-3, ctx_noise=1e-3,
                       bump=(10, 0.5))  # fmt: skip
    assert row["status"] == "diverged" and row["drift_violations"] > 0
    assert row["drift_context_topk_floor"] < 0.05 < row["drift_topk_max"]


def _run_compiled(monkeypatch, tmp_path, spec_noise, ctl_noise, bump=None,
                  ctl_fails=False, controls=None, flip=None):  # fmt: skip
    """One greedy cell whose engine is compiled (CUDA graphs) against the
    eager reference: its speculative engine with ``spec_noise``, the same
    engine without a drafter (the control) with ``ctl_noise``, every eager
    engine (reference, floor, teacher-forced passes) 1e-3. ``controls``: a
    list that gets one entry per control engine started."""
    from harness import equivalence as eq
    from harness import models

    def engine(cell, d):
        if cell.graphs == "eager":
            return FakeLLM(cell, noise=1e-3)
        if cell.drafter != "none":
            return FakeLLM(cell, noise=spec_noise, bump=bump, flip=flip)
        if controls is not None:
            controls.append(cell)
        if ctl_fails:
            raise RuntimeError("no control engine here")
        return FakeLLM(cell, noise=ctl_noise)

    monkeypatch.setattr(eq, "_engine", engine)
    monkeypatch.setattr(eq, "_shutdown", lambda llm: None)
    monkeypatch.setattr(models, "write_model", lambda kind, out, seed=0: out)
    fp = "full_and_piecewise"
    cells = [eq.Cell("qwen3_5", "mtp", 3, 4, "default", "align", fp,
                     async_sched=True, max_tokens=24)]  # fmt: skip
    (row,) = eq.run_cells(cells, tmp_path, n_prompts=4, seed=0)
    return row


def test_a_compiled_cell_over_both_floors_gets_its_control_floor(monkeypatch, tmp_path):
    """A compiled FP8 target with an MTP drafter drifted past the bar while
    its control (the same engine, no drafter) drifted further from the
    eager reference: the drift was the compiled target's, not
    speculation's. A greedy speculative cell still over the plain and
    context floors is judged again with the drift of its own engine
    without the drafter; one within them starts no control. The control
    has no drafter: a real change is not hidden by it."""
    started: list = []
    quiet = _run_compiled(monkeypatch, tmp_path, 1e-3, 0.01, controls=started)
    assert quiet["status"] == "ok" and "drift_control_floor" not in quiet
    assert started == []
    noisy = _run_compiled(monkeypatch, tmp_path, 0.01, 0.01, controls=started)
    # (drift only: this much noise can also flip a near-tie of the fake
    # model, which the argmax oracle judges by its own margin)
    assert noisy["drift_violations"] == 0, json.dumps(noisy)
    assert noisy["drift_control_floor_why"] == "over the plain and context floors"
    assert noisy["drift_control_floor_positions"] > 0
    # the control: the candidate's engine without its drafter
    (ctl,) = started
    assert (ctl.drafter, ctl.k, ctl.runner, ctl.cache_mode, ctl.graphs,
            ctl.async_sched, ctl.batch) == ("none", 0, "default", "align",
                                            "full_and_piecewise", True, 4)  # fmt: skip
    # the same drift where the control agrees with the reference
    bad = _run_compiled(monkeypatch, tmp_path, 0.01, 1e-3)
    assert bad["status"] == "diverged" and bad["drift_violations"] > 0
    assert bad["drift_control_floor_why"] == "over the plain and context floors"
    # a lowered third choice under the same compiled noise: still diverged
    row = _run_compiled(monkeypatch, tmp_path, 0.01, 0.01, bump=(10, 0.5))
    assert row["status"] == "diverged" and row["drift_violations"] > 0
    assert row["drift_control_topk_floor"] < 0.5 < row["drift_topk_max"]
    # a flipped token is diverged whatever the floor: no control is started
    started.clear()
    row = _run_compiled(monkeypatch, tmp_path, 0.01, 0.01, flip=3, controls=started)
    assert row["status"] == "diverged" and row["divergences"] > 0
    assert started == [] and "drift_control_floor" not in row


def test_a_failed_control_leaves_the_floor_it_had(monkeypatch, tmp_path):
    row = _run_compiled(monkeypatch, tmp_path, 0.01, 0.01, ctl_fails=True)
    assert row["status"] == "diverged"
    assert "no control engine" in row["drift_control_floor_error"]
    assert "drift_control_floor" not in row


def test_floor_add_prefix_stops_at_the_first_differing_token():
    """The control's run against the reference's prefill counts while their
    tokens agree, and the top-k alone at the first token that differs."""
    ref = [{1: -0.1, 2: -3.0}, {3: -0.2, 4: -2.0}, {5: -0.1, 6: -4.0}]
    gen = [{1: -0.1, 2: -3.0}, {4: -0.5, 3: -1.0}, {9: -9.0}]
    f = oracle.Floor()
    f.add_prefix(gen, ref, [1, 4, 9], [1, 3, 5])
    # position 0 agrees (no drift), position 1 differs: its top-k only
    assert f.positions == 2
    assert f.token == 0.0 and f.topk == pytest.approx(1.5)


def test_a_failed_context_pass_leaves_the_plain_floor(monkeypatch, tmp_path):
    row = _run_sampled(monkeypatch, tmp_path, spec_noise=0.05, ctx_noise=0.05,
                       ctx_fails=True)  # fmt: skip
    assert row["status"] == "diverged"
    assert "no chunked engine" in row["drift_context_floor_error"]
    assert "drift_context_floor" not in row


def test_a_matrix_process_without_the_fastapply_fixture_stops_before_any_engine(
    monkeypatch, tmp_path
):
    """A GPU call that did not carry fixtures/: the process says what is
    missing and how many of its cells need it, and starts no engine (each
    cell used to fail in its own engine start, 23-31 s apiece); a slice
    without fast-apply cells runs as before."""
    from harness import equivalence as eq

    monkeypatch.setattr(eq, "FASTAPPLY_DIR", tmp_path / "nowhere")
    started = []
    monkeypatch.setattr(eq, "run_cells", lambda *a, **k: started.append(a) or [])
    with pytest.raises(SystemExit, match="holds no checkpoint, and 2 of the 2"):
        eq.main(["--slice", "fa3-mtp-probe", "--out", str(tmp_path)])
    assert started == []
    import harness.report

    monkeypatch.setattr(harness.report, "write_report", lambda *a: {})
    eq.main(["--slice", "mamba1-probe", "--out", str(tmp_path)])
    assert len(started) == 1
