# SPDX-License-Identifier: Apache-2.0
"""The equivalence harness's own logic: margin classification, the scripted
drafter's schedules and request matching, report building."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import fake_engines, fake_output, run_until_done

from harness.compare import CellSummary, Position, noise, verify
from harness.drafter import (
    SCHEDULES,
    Script,
    ScriptedProposer,
    StepContext,
    drafts_for,
)
from harness.report import markdown, validate, write_report


def _ref(tokens, gaps=None, second=None):
    gaps = gaps or [5.0] * len(tokens)
    return [
        Position(t, (second[i] if second else (t + 1) % 256), g)
        for i, (t, g) in enumerate(zip(tokens, gaps, strict=False))
    ]


# --- margin-aware verification ---------------------------------------------


def test_match():
    v = verify(_ref([1, 2, 3]), [1, 2, 3], 0.05)
    assert (v.status, v.checked, v.divergences) == ("match", 3, 0)


def test_divergence_above_margin_is_a_bug():
    v = verify(_ref([1, 2, 3], gaps=[5, 0.5, 5]), [1, 3, 3], 0.05)
    assert v.status == "diverged"
    assert v.first == {"position": 1, "margin": 0.5, "expected": 2, "got": 3}


def test_divergence_below_margin_to_second_choice_is_a_tie():
    v = verify(_ref([1, 2, 3], gaps=[5, 0.01, 5]), [1, 3, 3], 0.05)
    assert (v.status, v.ties) == ("tie", 1)


def test_below_margin_but_not_the_second_choice_is_a_bug():
    v = verify(_ref([1, 2, 3], gaps=[5, 0.01, 5]), [1, 77, 3], 0.05)
    assert v.status == "diverged"


def test_length_mismatch_is_a_bug():
    v = verify(_ref([1, 2]), [1, 2], 0.05, expected_len=3)
    assert (v.status, v.divergences) == ("diverged", 1)
    assert v.first["position"] == 2
    assert verify(_ref([1, 2]), [1, 2], 0.05, expected_len=2).status == "match"


def test_a_candidate_that_does_not_stop_where_the_reference_stopped_diverges():
    """The reference run stopped on token 7 (a stop token id); a candidate
    with the same tokens that goes on is a bug, reported with the tokens
    where the two part."""
    v = verify(_ref([1, 7, 4, 4]), [1, 7, 4, 4], 0.05, ref_tokens=[1, 7])
    assert (v.status, v.divergences) == ("diverged", 1)
    assert v.first["position"] == 2 and v.first["margin"] is None
    assert v.first["last_common"] == [1, 7] and v.first["candidate_next"] == [4, 4]
    # stopping early where the reference went on, too
    v = verify(_ref([1, 2]), [1, 2], 0.05, ref_tokens=[1, 2, 3])
    assert (v.status, v.first["reference_next"]) == ("diverged", [3])


def test_a_length_that_differs_after_a_tie_is_the_tie():
    """The reference took token 7 (a stop token) at a near-tie and stopped;
    the candidate took the other side (8) and went on: one tie, no
    divergence, though the lengths differ."""
    ref = _ref([1, 7, 5, 5], gaps=[5, 0.01, 5, 5])
    v = verify(ref, [1, 8, 5, 5], 0.05, ref_tokens=[1, 7])
    assert (v.status, v.divergences, v.ties) == ("tie", 0, 1)
    # the same length difference without the tie is a bug
    v = verify(_ref([1, 7, 5, 5]), [1, 8, 5, 5], 0.05, ref_tokens=[1, 7])
    assert v.status == "diverged"


def test_position_from_logprobs():
    p = Position.from_logprobs(5, {5: -0.1, 9: -2.1, 3: -4.0})
    assert (p.token, p.second) == (5, 9)
    assert p.gap == pytest.approx(2.0)
    # greedy token not the argmax of what was returned (ties in the sampler)
    p = Position.from_logprobs(9, {5: -0.1, 9: -0.1})
    assert (p.second, p.gap) == (5, 0.0)


def test_summary_counts_and_first_divergence():
    s = CellSummary()
    s.add_verification(0, verify(_ref([1, 2]), [1, 2], 0.05))
    s.add_verification(1, verify(_ref([3, 4], gaps=[0.01, 5]), [4, 4], 0.05))
    s.add_verification(2, verify(_ref([5, 6], gaps=[5, 2]), [5, 7], 0.05))
    assert (s.prompts, s.divergences, s.ties, s.status) == (3, 1, 1, "diverged")
    assert s.first_divergence["prompt"] == 2 and s.first_divergence["position"] == 1
    assert s.tokens == 6 and s.max_margin == 2


# --- scripted drafter ---------------------------------------------------------


def _ctx(step=0, generated=10, length=40, k=4, row=0, block=16):
    return StepContext(row, step, generated, length, k, block, 0)


def test_schedules_shapes():
    assert SCHEDULES["all_zero"](_ctx()) == (0, 0)
    assert SCHEDULES["all_accept"](_ctx()) == (4, 4)
    assert SCHEDULES["all_reject"](_ctx()) == (4, 0)
    assert SCHEDULES["accept_then_zero"](_ctx(step=0)) == (4, 4)
    assert SCHEDULES["accept_then_zero"](_ctx(step=1)) == (0, 0)
    for step in range(50):
        n, c = SCHEDULES["random"](_ctx(step=step))
        assert 0 <= c <= n <= 4
    # deterministic
    assert [SCHEDULES["random"](_ctx(step=s)) for s in range(20)] == [
        SCHEDULES["random"](_ctx(step=s)) for s in range(20)
    ]
    seen = {SCHEDULES["random"](_ctx(step=s)) for s in range(200)}
    assert (0, 0) in seen and (4, 4) in seen and any(0 < c < n for n, c in seen)


def test_boundary_schedule_lands_on_and_crosses_block_boundaries():
    # length 40, block 16: 8 tokens to the boundary at 48
    assert SCHEDULES["boundary"](_ctx(step=0, length=40, k=16)) == (8, 8)
    assert SCHEDULES["boundary"](_ctx(step=1, length=40, k=16)) == (9, 9)
    assert SCHEDULES["boundary"](_ctx(step=0, length=40, k=4)) == (4, 4)


def test_heterogeneous_rows_differ():
    rows = [SCHEDULES["heterogeneous"](_ctx(row=r, step=1)) for r in range(4)]
    assert rows[1] == (0, 0) and rows[2] == (4, 4) and rows[3] == (0, 0)


def test_drafts_follow_reference_then_go_wrong():
    ref = list(range(100, 130))
    ctx = _ctx(generated=9, k=4)  # the token just sampled is ref[9]
    d = drafts_for(lambda c: (4, 2), ctx, ref, 256)
    assert d[:2] == [ref[10], ref[11]]
    assert d[2] != ref[12] and d[3] != ref[13]
    assert drafts_for(lambda c: (4, 4), _ctx(generated=27), ref, 256) == [
        ref[28],
        ref[29],
    ]


def test_proposer_matches_requests_by_prompt(tmp_path, monkeypatch):
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    refs = [[50 + i for i in range(20)], [80 + i for i in range(20)]]
    script = tmp_path / "s.json"
    script.write_text(json.dumps({
        "schedule": "all_accept", "vocab_size": 256,
        "requests": [{"prompt": p, "reference": r}
                     for p, r in zip(prompts, refs, strict=True)],
    }))  # fmt: skip
    monkeypatch.setenv("HSFORK_SCRIPT", str(script))

    class Spec:
        num_speculative_tokens = 3

    class Cache:
        block_size = 32

    class Cfg:
        speculative_config = Spec()
        cache_config = Cache()

    prop = ScriptedProposer(Cfg())
    # the script names no block size: the engine's is used
    assert prop.script.block_size == 32
    # batch: row 0 = second prompt + 2 generated, row 1 = first prompt + 1,
    # row 2 = a partial prefill, row 3 = an unknown request
    rows = [prompts[1] + refs[1][:2], prompts[0] + refs[0][:1], [1, 2], [9, 9, 9]]
    width = max(map(len, rows))
    token_ids = np.zeros((4, width), dtype=np.int64)
    for i, r in enumerate(rows):
        token_ids[i, : len(r)] = r
    out = prop.propose(
        [[refs[1][1]], [refs[0][0]], [], [9]],
        np.array([len(r) for r in rows]),
        token_ids,
    )
    assert out == [refs[1][2:5], refs[0][1:4], [], []]
    assert prop.steps == {1: 1, 0: 1}


def test_script_prefers_longest_prompt():
    s = Script({"schedule": "all_zero", "vocab_size": 256, "requests": [
        {"prompt": list(range(10)), "reference": []},
        {"prompt": list(range(12)), "reference": []},
    ]})  # fmt: skip
    assert s.find(list(range(12)) + [99]) == 1
    assert s.find(list(range(10)) + [99]) == 0
    assert s.find([5] * 12) is None


# --- reports -----------------------------------------------------------------


def _cell(**kw):
    base = dict(model="qwen3_5", runner="v1", cache_mode="none", drafter="ngram",
                k=5, batch=8, graphs="eager", status="ok", tokens=100,
                divergences=0, ties=0)  # fmt: skip
    base["async"] = False
    base.update(kw)
    return base


def test_report_validation():
    validate(_cell())
    with pytest.raises(ValueError):
        validate(_cell(status="ok", divergences=2))
    with pytest.raises(ValueError):
        validate(_cell(status="diverged", divergences=0))
    with pytest.raises(ValueError):
        validate({"model": "x"})


def test_report_files(tmp_path):
    cells = [
        _cell(),
        _cell(drafter="scripted:accept_then_zero", status="diverged", divergences=3,
              first_divergence={"prompt": 1, "position": 5, "margin": 2.5}),
        _cell(runner="mrv2", status="rejected", error="ngram not supported | x"),
        _cell(cache_mode="align", status="inconclusive", ties=60,
              inconclusive="60 of 100 positions within the tie margin"),
    ]  # fmt: skip
    paths = write_report(cells, tmp_path, "unit")
    assert json.loads(paths["json"].read_text()) == cells
    md = paths["md"].read_text()
    assert "4 cells: 1 ok, 1 diverged, 1 inconclusive, 1 rejected" in md
    assert "60 of 100 positions within the tie margin" in md
    assert "prompt 1 pos 5 margin 2.5" in md and "ngram not supported / x" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert markdown([], "empty").startswith("# empty")


# --- teacher-forced verification ---------------------------------------------


def test_verify_judges_every_position():
    ref = [Position(5, 6, 3.0), Position(7, 8, 0.01), Position(9, 1, 3.0),
           Position(2, 3, 3.0)]  # fmt: skip
    v = verify(ref, [5, 8, 4, 2], 0.05)
    assert (v.checked, v.divergences, v.ties, v.status) == (4, 1, 1, "diverged")
    assert v.first == {"position": 2, "margin": 3.0, "expected": 9, "got": 4}
    assert verify(ref, [5, 8, 9, 2], 0.05).status == "tie"
    assert verify(ref, [5, 7, 9, 2], 0.05).status == "match"
    with pytest.raises(ValueError):
        verify(ref, [5], 0.05)


def test_top_and_noise():
    p = Position.top({3: -0.5, 4: -0.2, 9: -3.0})
    assert (p.token, p.second) == (4, 3) and p.gap == pytest.approx(0.3)
    gen = [Position(1, 2, 1.0), Position(3, 4, 2.0), Position(5, 6, 1.0)]
    forced = [Position(1, 2, 1.1), Position(3, 4, 1.75), Position(6, 5, 0.1)]
    assert noise(gen, forced) == pytest.approx(0.25)


def test_run_cells_orchestration_with_a_fake_engine(tmp_path, monkeypatch):
    """Reference, cells and verification wired together: a fake 'model'
    whose greedy choice is a function of the previous token; a 'buggy' cell
    corrupts one token of one request, a correct cell changes nothing."""
    import harness.equivalence as eq

    def nxt(prev):
        return (prev * 7 + 3) % 250

    class Out:
        def __init__(self, toks, lps=None, plps=None):
            class C:
                pass

            self.outputs = [C()]
            self.outputs[0].token_ids = toks
            self.outputs[0].logprobs = lps
            self.prompt_logprobs = plps

    class LP:
        def __init__(self, v):
            self.logprob = v

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        outs = []
        prompts = [p for w in waves for p in w]
        for j, p in enumerate(prompts):
            toks, prev = [], p[-1]
            for _ in range(cell.max_tokens):
                prev = nxt(prev)
                toks.append(prev)
            if cell.drafter == "scripted:all_accept" and j == 1:
                toks[5] = (toks[5] + 1) % 250  # the "bug"
            lps = [{t: LP(-0.1), (t + 1) % 250: LP(-3.0)} for t in toks]
            outs.append(Out(toks, lps if logprobs else None))
        return outs, {"vllm:spec_decode_num_drafts": 1}

    def fake_forced(model, dtype, model_dir, seqs, kv_cache_dtype="auto", **_):
        res = []
        for p, c in seqs:
            full = list(p) + list(c)
            res.append([
                Position(nxt(full[len(p) + i - 1]), 0, 3.0) for i in range(len(c))
            ])  # fmt: skip
        return res

    fake_engines(monkeypatch, fake_generate, fake_forced)
    cells = [
        eq.Cell("qwen3_5", "scripted:all_zero", 4, 4, max_tokens=12),
        eq.Cell("qwen3_5", "scripted:all_accept", 4, 4, max_tokens=12),
    ]
    # a deadline already passed: nothing starts, nothing is reported
    assert eq.run_cells(cells, tmp_path, n_prompts=4, seed=0, deadline_s=-1) == []
    rows = eq.run_cells(cells, tmp_path, n_prompts=4, seed=0)
    assert [r["status"] for r in rows] == ["ok", "diverged"]
    assert rows[0]["tokens"] == 48 and rows[0]["divergences"] == 0
    # the corrupted token, and the next one (its context changed)
    assert rows[1]["first_divergence"]["prompt"] == 1
    assert rows[1]["first_divergence"]["position"] == 5
    assert rows[1]["divergences"] == 2


def test_verify_reports_largest_divergence_margin():
    ref = [Position(1, 2, 0.3), Position(3, 4, 4.0), Position(5, 6, 1.0)]
    v = verify(ref, [2, 9, 7], 0.25)
    assert v.divergences == 3 and v.max_margin == 4.0
    assert verify(ref, [1, 3, 5], 0.25).max_margin is None


def test_verify_uses_the_candidates_own_logprob_when_known():
    # a three-way exact tie: the candidate is not "the second choice" but is
    # as likely as the top: a tie, not a bug
    p = Position.top({77: -1.0, 152: -1.0, 89: -1.0}, candidate=89)
    assert p.cand_gap == 0.0
    assert verify([p], [89], 0.25).status == "tie"
    # far below the top: a divergence whose margin is the candidate's deficit
    p = Position.top({5: -0.1, 6: -2.0, 9: -6.1}, candidate=9)
    v = verify([p], [9], 0.25)
    assert v.status == "diverged" and v.first["margin"] == pytest.approx(6.0)


def test_second_wave_shares_prefixes_with_the_first():
    from harness.equivalence import make_prompts, second_wave

    first = make_prompts(4, seed=3)
    conts = [[200 + j for j in range(40)] for _ in first]
    second = second_wave(first, conts, seed=3)
    for p, c, q in zip(first, conts, second, strict=True):
        assert q[: len(p) + 30] == p + c[:30]
        assert len(q) == len(p) + 30 + 4
    assert second == second_wave(first, conts, seed=3)


def test_v1_matrix_parts_cover_the_issue_dimensions():
    from harness.equivalence import slice_cells

    cells = [c for p in ("q-state", "n-state", "q-drafters")
             for c in slice_cells(f"v1-matrix-{p}")]  # fmt: skip
    assert {c.model for c in cells} == {"qwen3_5", "nemotron_h"}
    assert {c.runner for c in cells} == {"v1"}
    assert any(c.drafter == "ngram" and c.k == 64 for c in cells)
    assert {(c.drafter, c.k) for c in cells if c.drafter == "mtp"} == {
        ("mtp", 1),
        ("mtp", 3),
    }
    for flag in ("chunked", "preempt", "async_sched"):
        assert any(getattr(c, flag) for c in cells), flag
    assert {c.cache_mode for c in cells} == {"none", "align"}
    assert {c.graphs for c in cells} == {"eager", "full_and_piecewise"}
    assert max(c.batch for c in cells) == 64


def test_preempt_cells_take_the_least_pool_plus_two_blocks():
    """A preemption cell's KV pool is the least one the engine starts with
    (harness.fuzz_pool, vLLM's own admission check: block sizes differ by
    line) plus 2 blocks, so that running requests are preempted (plus
    PREEMPT_SLACK_K8 for the n-gram k=8 cells, whose requests hold 9 state
    blocks per Mamba group: tests/test_preempt_pool.py); the cell records
    vLLM's preemption counter, and one that never preempted is an invalid
    cell (an error, not a refusal)."""
    from harness import fuzz_pool
    from harness.equivalence import (
        PREEMPT_SLACK_K8,
        engine_kwargs,
        slice_cells,
        spec_config,
    )

    cells = [c for c in slice_cells("v1-matrix-q-preempt") if c.preempt]
    assert {c.k for c in cells} == {4, 8}
    for c in cells:
        kw = engine_kwargs(c, "/m", spec_config(c))
        slack = PREEMPT_SLACK_K8 if c.k == 8 else 2
        assert kw["num_gpu_blocks_override"] == fuzz_pool.POOL_BASE + slack
        assert kw["max_model_len"] == 512
    # the hook turns the request into least + one block per Mamba group and
    # sequence + 2, with the least found by the admission check
    calls = []

    class Cfg:
        class cache_config:  # noqa: N801
            num_gpu_blocks_override = fuzz_pool.POOL_BASE + 2
            block_size = 64

        class scheduler_config:  # noqa: N801
            max_num_seqs = 16

    def orig(cfg, *a, **k):
        n = cfg.cache_config.num_gpu_blocks_override
        calls.append(n)
        if n < 9:
            raise ValueError("To serve at least one request with the model's ...")
        return []

    fuzz_pool.sized(orig, count_mamba=lambda _: 1)(Cfg)
    assert Cfg.cache_config.num_gpu_blocks_override == 9 + 16 + 2


def test_side_by_side_prefers_completed_results(tmp_path):
    from harness.report import side_by_side

    base = {"model": "qwen3_5", "runner": "v1", "drafter": "ngram", "k": 5,
            "batch": 8, "cache_mode": "none", "graphs": "eager", "async": False,
            "tokens": 10, "divergences": 0, "ties": 0}  # fmt: skip
    (tmp_path / "a-fork.json").write_text(json.dumps([{**base, "status": "error"}]))
    (tmp_path / "b-fork.json").write_text(json.dumps([{**base, "status": "ok"}]))
    # the upstream column names the release the cells recorded
    bad = {**base, "status": "diverged", "divergences": 3, "vllm": "0.33.0"}
    (tmp_path / "a-upstream.json").write_text(json.dumps([bad]))
    table = side_by_side(sorted(tmp_path.glob("*.json")))
    lines = table.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith("| fork | upstream v0.33.0 |")
    assert "ok: 0 div, 0 ties / 10 tok <sub>b-fork.json</sub>" in lines[2]
    assert "**diverged**: 3 div" in lines[2] and "a-upstream.json" in lines[2]


def test_turboquant_prefill_falls_back_to_sdpa_without_fa2(monkeypatch):
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CPU test bed only (a GPU host may have FlashAttention 2)")
    from vllm.v1.attention.backends import turboquant_attn

    import harness.equivalence as eq

    # this CPU test bed has no FlashAttention 2 binary: TurboQuant's own
    # SDPA branch must be taken
    monkeypatch.setattr(turboquant_attn, "_HAS_FLASH_ATTN", True)
    assert eq.turboquant_prefill() == "sdpa"
    assert turboquant_attn._HAS_FLASH_ATTN is False
    assert eq.turboquant_prefill() == "sdpa"


def test_full_matrix_runs_cover_both_runners_and_every_fixture():
    from harness.full_matrix import RUNS, expected_cells

    assert sorted(RUNS) == [1, 2, 3, 4, 5, 6]
    cells = [k for _, k in expected_cells()]
    # the paths production runs, and every family, are in the whole matrix
    assert {c.get("request") for c in cells} >= {"stop", "regex", "n2"}
    assert any(c.get("turns", 2) > 2 for c in cells)
    assert any(c["dtype"] == "fp8" for c in cells)
    assert any(c["drafter"] == "ngram:acceptance" for c in cells)
    assert any(c.get("engine", {}).get("gdn_prefill_backend") == "flashinfer"
               for c in cells)  # fmt: skip
    from harness.equivalence import family_cells

    assert {c.model for c in family_cells("all")} <= {c["model"] for c in cells}
    by_runner = {r: {c["model"] for c in cells if c["runner"] == r}
                 for r in ("v1", "mrv2")}  # fmt: skip
    assert by_runner["v1"] >= {"qwen3_5", "nemotron_h", "fastapply", "qwen3_next",
                               "granitemoehybrid", "kimi_linear"}  # fmt: skip
    # Mamba2 and GDN on Model Runner V2 (through their MTP heads)
    assert by_runner["mrv2"] >= {"qwen3_5", "nemotron_h", "fastapply"}
    for runner in ("v1", "mrv2"):
        mine = [c for c in cells if c["runner"] == runner]
        assert {c["cache_mode"] for c in mine} == {"none", "align"}
        assert {c["graphs"] for c in mine} == {"eager", "full_and_piecewise"}
        for flag in ("chunked", "preempt", "async"):
            assert any(c[flag] for c in mine), (runner, flag)
        assert any(c["drafter"].startswith("scripted:") for c in mine)
        assert {c["k"] for c in mine if c["drafter"] == "mtp"} == {1, 3}
    assert any(c["drafter"] == "ngram" and c["k"] == 64 for c in cells)


def test_full_matrix_shards_deal_each_cell_to_one_process():
    """A ``slice:S`` entry of RUNS: S processes (``--shard i/S``) that
    together run each of the slice's cells once."""
    from harness.equivalence import shard, slice_cells
    from harness.full_matrix import RUNS, slice_of

    sharded = [e for n in RUNS for e in RUNS[n] if ":" in e]
    assert sharded
    for entry in sharded:
        cells = slice_cells(slice_of(entry))
        s = int(entry.partition(":")[2])
        dealt = [c.key() for i in range(1, s + 1) for c in shard(cells, f"{i}/{s}")]
        assert sorted(map(json.dumps, dealt)) == sorted(
            json.dumps(c.key()) for c in cells
        )
        sizes = [len(shard(cells, f"{i}/{s}")) for i in range(1, s + 1)]
        assert max(sizes) - min(sizes) <= 1
    for bad in ("0/2", "3/2", "x"):
        with pytest.raises(SystemExit):
            shard([], bad)


def test_shards_keep_the_cells_of_a_reference_together():
    """Cells that share a non-speculative reference go to one process,
    which builds that reference once: the tp2 slice's 8 fast-apply cells
    (n-gram and MTP for each runner and cache mode) in 4 processes give
    each process one reference, where dealing them round-robin gave each
    two (two compiled TP=2 reference engines, minutes each)."""
    from harness.equivalence import reference_key, shard, slice_cells

    cells = [c for c in slice_cells("tp2") if c.model == "fastapply"]
    assert len(cells) == 8
    for i in range(1, 5):
        part = shard(cells, f"{i}/4")
        assert len(part) == 2
        assert len({reference_key(c, 8) for c in part}) == 1
        assert {c.drafter for c in part} == {"ngram", "mtp"}


def test_full_matrix_summary_lists_unrun_cells(tmp_path):
    from harness.equivalence import slice_cells
    from harness.full_matrix import RUNS, expected_cells, summarize

    first = slice_cells(RUNS[1][0])[0].key()
    done = {**first, "prompts": 8, "tokens": 100, "divergences": 0, "ties": 0,
            "status": "ok"}  # fmt: skip
    bad = {**done, "status": "diverged", "divergences": 7}
    (tmp_path / "v1-smoke-fork.json").write_text(json.dumps([done]))
    (tmp_path / "v1-smoke-upstream.json").write_text(json.dumps([bad]))
    counts = summarize(tmp_path, "t")
    n = len({json.dumps(k, sort_keys=True) for _, k in expected_cells()})
    assert counts["fork"] == {"ok": 1, "not run": n - 1}
    assert counts["upstream"] == {"diverged": 1, "not run": n - 1}
    text = (tmp_path / "FULL.md").read_text()
    assert "ok: 0 div, 0 ties / 100 tok | **diverged**: 7 div" in text
    assert text.count("not run | not run") == n - 1
    assert (tmp_path / "full-fork.png").exists()


def test_draft_model_cells_draft_with_their_own_model():
    from harness.equivalence import engine_kwargs, slice_cells, spec_config

    cells = slice_cells("draft-model-probe")
    assert {c.runner for c in cells} == {"v1", "mrv2"}
    hybrid = next(c for c in cells if c.drafter == "draft_model")
    kw = engine_kwargs(hybrid, "/m/nemotron_h", spec_config(hybrid))
    assert kw["speculative_config"] == {
        "method": "draft_model",
        "model": "/m/nemotron_h-draft_model",
        "num_speculative_tokens": 3,
    }
    dense = [c for c in cells if c.drafter == "draft_model:dense"]
    assert {c.model for c in dense} == {"qwen3_5", "nemotron_h", "fastapply"}
    assert {c.cache_mode for c in dense} == {"none", "align"}
    kw = engine_kwargs(dense[0], "/m/qwen3_5", spec_config(dense[0]))
    assert kw["speculative_config"]["method"] == "draft_model"
    assert kw["speculative_config"]["model"] == "/m/qwen3_5-draft_model-dense"


@pytest.mark.parametrize(
    ("drafter", "arch"), [("eagle3", "Qwen3ForCausalLM"), ("eagle", "LlamaForCausalLM")]
)
def test_eagle_cells_write_and_use_a_head(tmp_path, drafter, arch):
    pytest.importorskip("torch")
    from harness.equivalence import (
        FASTAPPLY_DIR,
        drafter_dir,
        engine_kwargs,
        slice_cells,
        spec_config,
        write_drafter,
    )
    from harness.models import write_model

    cells = slice_cells(f"{drafter}-probe")
    assert {c.runner for c in cells} == {"v1", "mrv2"}
    assert {c.drafter for c in cells} == {drafter}
    cell = cells[0]
    target = str(write_model(cell.model, tmp_path / "model-qwen3_5"))
    write_drafter(cell, target, seed=0)
    head = drafter_dir(target, drafter)
    assert json.loads(Path(head, "config.json").read_text())["architectures"] == [arch]
    kw = engine_kwargs(cell, target, spec_config(cell))
    assert kw["speculative_config"]["method"] == drafter
    assert kw["speculative_config"]["model"] == head
    # the committed fixture's head goes to the temp folder, not beside it
    assert not drafter_dir(str(FASTAPPLY_DIR), drafter).startswith(str(FASTAPPLY_DIR))


@pytest.mark.parametrize(
    ("drafter", "arch", "size_key"),
    [
        ("medusa", "MedusaModel", "num_heads"),
        ("dspark", "Qwen3DSparkModel", "block_size"),
    ],
)
def test_medusa_and_dspark_cells_write_a_head_per_k(tmp_path, drafter, arch, size_key):
    """Medusa drafts one token per head and DSpark a block of its size: a
    cell's head is written for its k, in a folder of its own per k, and the
    speculative config asks for k tokens. medusa-probe runs V1 without async
    scheduling (v0.26.0 refuses it with Medusa) and one MRV2 cell;
    dspark-probe runs Model Runner V2 and the default runner, and one V1
    cell."""
    pytest.importorskip("torch")
    from harness.equivalence import (
        Cell,
        drafter_dir,
        engine_kwargs,
        slice_cells,
        spec_config,
        write_drafter,
    )
    from harness.models import write_model

    cells = slice_cells(f"{drafter}-probe")
    assert {c.drafter for c in cells} == {drafter}
    if drafter == "medusa":
        assert [c.runner for c in cells].count("mrv2") == 1
        assert not any(c.async_sched for c in cells)
        assert {c.model for c in cells} == {"qwen3_5", "fastapply", "nemotron_h"}
    else:
        assert [c.runner for c in cells].count("v1") == 1
        assert {c.runner for c in cells} == {"v1", "mrv2", "default"}
        assert any(c.graphs != "eager" and c.runner == "mrv2" for c in cells)
    assert {c.cache_mode for c in cells} == {"none", "align"}
    target = str(write_model("qwen3_5", tmp_path / "model-qwen3_5"))
    for k in (3, 5):
        cell = Cell("qwen3_5", drafter, k, 8, "mrv2" if drafter == "dspark" else "v1")
        write_drafter(cell, target, seed=0)
        head = drafter_dir(target, drafter, k)
        assert head.endswith(f"-{drafter}-k{k}")
        cfg = json.loads(Path(head, "config.json").read_text())
        assert cfg["architectures"] == [arch] and cfg[size_key] == k
        spec = engine_kwargs(cell, target, spec_config(cell))["speculative_config"]
        assert spec["method"] == drafter and spec["model"] == head
        assert spec["num_speculative_tokens"] == k
    with pytest.raises(ValueError, match="per k"):
        drafter_dir(target, drafter)


# --- vLLM lines (harness.compat) ----------------------------------------------

LINES = ("0.26.0", "0.33.0")


@pytest.fixture(params=LINES)
def line(request, monkeypatch):
    """Each test runs for both vLLM lines the harness drives (the version
    harness.compat targets, overridden; nothing here imports vLLM)."""
    monkeypatch.setenv("HSFORK_VLLM_VERSION", request.param)
    return request.param


def test_compat_parses_and_detects_versions(monkeypatch):
    from harness import compat

    assert compat.parse_version("v0.26.0") == (0, 26, 0)
    assert compat.parse_version("0.33.0rc1.dev4+gabc") == (0, 33, 0)
    assert compat.parse_version("0.33") == (0, 33, 0)
    with pytest.raises(ValueError):
        compat.parse_version("main")
    monkeypatch.setenv("HSFORK_VLLM_VERSION", "0.33.0")
    assert compat.vllm_version() == (0, 33, 0) and compat.version_source() == "env"
    assert compat.at_least(0, 33) and not compat.at_least(0, 34)
    monkeypatch.delenv("HSFORK_VLLM_VERSION")
    # without the override: the installed vLLM's version (read, not imported)
    found = compat._installed_version()
    if found is not None:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        text = Path(spec.submodule_search_locations[0], "_version.py").read_text()
        assert f"'{found}'" in text or f'"{found}"' in text
        assert compat.vllm_version() == compat.parse_version(found)


def test_engine_kwargs_follow_the_line(line):
    """mamba_cache_mode is an engine argument on v0.26.0; on v0.33.0 it is
    deprecated without effect (prefix caching implies align), so left out."""
    from harness.equivalence import Cell, engine_kwargs, spec_config

    cell = Cell("qwen3_5", "mtp", 3, 8, "default", "align", async_sched=True)
    kw = engine_kwargs(cell, "/m", spec_config(cell))
    assert kw["enable_prefix_caching"] is True
    if line == "0.26.0":
        assert kw["mamba_cache_mode"] == "align"
    else:
        assert "mamba_cache_mode" not in kw
    plain = engine_kwargs(Cell("qwen3_5", "ngram", 5, 8), "/m", None)
    assert plain["enable_prefix_caching"] is False
    assert "mamba_cache_mode" not in plain


def test_each_engine_starts_with_the_capture_guard_on(monkeypatch):
    """A V1 engine with graphs leaves vLLM's process-wide capture guard off;
    the next in-process engine must not inherit that (see
    reset_capture_guard)."""
    from vllm.compilation import monitor

    from harness.equivalence import reset_capture_guard

    monkeypatch.setattr(monitor, "cudagraph_capturing_enabled", False)
    with pytest.raises(RuntimeError, match="inappropriate time"):
        monitor.validate_cudagraph_capturing_enabled()
    reset_capture_guard()
    monitor.validate_cudagraph_capturing_enabled()


def test_runner_selection(monkeypatch, line):
    from harness import compat
    from harness.equivalence import RUNNER_ENV, set_runner

    monkeypatch.setenv(RUNNER_ENV, "1")
    set_runner("v1")
    assert os.environ[RUNNER_ENV] == "0"
    set_runner("mrv2")
    assert os.environ[RUNNER_ENV] == "1"
    set_runner("default")
    assert RUNNER_ENV not in os.environ
    with pytest.raises(ValueError):
        set_runner("v3")
    assert compat.default_runner() == ("v1" if line == "0.26.0" else "mrv2")
    assert compat.mrv2_ngram() == (line != "0.26.0")
    module, cls = compat.mrv2_ar_speculator()
    if line == "0.26.0":
        assert (module.split(".")[-2], cls) == (
            "autoregressive", "AutoRegressiveSpeculator",
        )  # fmt: skip
    else:
        assert (module.split(".")[-2], cls) == (
            "target_dependent_ar", "TargetDependentARSpeculator",
        )  # fmt: skip


def test_ngram_gpu_spec_config():
    from harness.equivalence import Cell, spec_config

    assert spec_config(Cell("fastapply", "ngram_gpu", 64, 8)) == {
        "method": "ngram_gpu",
        "num_speculative_tokens": 64,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 10,
    }


def test_draft_length_slice_asks_for_the_acceptance_policy(line):
    """The draft-length slice's cells run n-gram with per-request draft
    lengths, which vLLM's own SpeculativeConfig of this line accepts (the
    fork's patch) on the V1 runner."""
    from vllm.config import SpeculativeConfig

    from harness.equivalence import slice_cells, spec_config

    cells = slice_cells("draft-length")
    assert cells and {c.drafter for c in cells} == {"ngram:acceptance"}
    assert {c.runner for c in cells} <= {"v1", "default"}
    for cell in cells:
        config = spec_config(cell)
        assert config["method"] == "ngram"
        assert config["draft_length_policy"] == "acceptance"
        assert SpeculativeConfig(**config).draft_length_policy == "acceptance"


def test_flashinfer_slice_asks_for_the_hopper_defaults(line):
    """The flashinfer slice's cells override the Triton kernels every other
    cell forces: FA3 or FlashInfer attention, in none and align mode, on
    both runners, and FlashInfer's GDN prefill on the Qwen3.5 fixture with
    GDN heads of 128 (the only size its kernel takes; the other fixtures'
    is 64, so their cells keep the Triton GDN prefill); the other engine
    arguments stay the harness's."""
    from harness.equivalence import (
        FASTAPPLY,
        QWEN3_5_D128,
        engine_kwargs,
        slice_cells,
        spec_config,
    )

    cells = slice_cells("flashinfer")
    assert {c.cache_mode for c in cells} == {"none", "align"}
    assert {c.runner for c in cells} >= {"v1", "default"}
    assert {c.drafter for c in cells} >= {"ngram", "mtp"}
    for cell in cells:
        kw = engine_kwargs(cell, "/m", spec_config(cell))
        want = "flashinfer" if cell.model == QWEN3_5_D128 else "triton"
        assert kw["gdn_prefill_backend"] == want
        assert kw["attention_backend"] in ("FLASHINFER", "FLASH_ATTN")
        assert kw["enable_prefix_caching"] is (cell.cache_mode == "align")
        # the Qwen3.5 fixture's own engine arguments (text only)
        assert (kw.get("language_model_only") is True) is (cell.model != "qwen3_next")
        # the cell key names the kernels: a report row says what ran
        assert cell.key()["engine"]["gdn_prefill_backend"] == want
    d128 = [c for c in cells if c.model == QWEN3_5_D128]
    assert {c.runner for c in d128} >= {"v1", "default"}
    assert {c.cache_mode for c in d128} == {"none", "align"}
    assert any(c.model == FASTAPPLY and c.cache_mode == "align" and c.chunked
               for c in cells)  # fmt: skip
    # align-mode blocks of 208 (fast-apply, k=64) and 288 tokens (GDN heads
    # of 128, k=5): v0.26.0 refuses align mode under a smaller budget,
    # v0.33.0 runs those cells at 160
    for cell in cells:
        kw = engine_kwargs(cell, "/m", spec_config(cell))
        if cell.chunked and cell.cache_mode == "align":
            big = cell.k == 64 or cell.model == QWEN3_5_D128
            if big and line == "0.26.0":
                assert kw["max_num_batched_tokens"] >= 288
            else:
                assert kw["max_num_batched_tokens"] == 160


def test_the_d128_fixture_is_qwen3_5_with_gdn_heads_of_128(tmp_path):
    """QWEN3_5_D128 cells write the Qwen3.5 fixture with GDN key and value
    heads of 128, MTP weights included; the plain Qwen3.5 keeps 64."""
    import json

    from harness.equivalence import QWEN3_5_D128, model_folder

    out = model_folder(QWEN3_5_D128, tmp_path, seed=0)
    text = json.loads((Path(out) / "config.json").read_text())["text_config"]
    assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == 128
    assert text["mtp_num_hidden_layers"] == 1
    from safetensors import safe_open

    with safe_open(str(Path(out) / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("mtp.") for n in names)
    plain = model_folder("qwen3_5", tmp_path, seed=0)
    text = json.loads((Path(plain) / "config.json").read_text())["text_config"]
    assert text["linear_key_head_dim"] == 64


def test_budget_probe_slice(line):
    from harness.equivalence import (
        BUDGET_PARTS,
        FASTAPPLY,
        engine_kwargs,
        slice_cells,
        spec_config,
    )

    cells = slice_cells("budget-probe")
    parts = [c for p in BUDGET_PARTS for c in slice_cells(f"budget-probe-{p}")]
    assert cells == parts and len(cells) == 34
    assert {c.model for c in cells} == {FASTAPPLY}
    assert all(c.chunked and c.max_tokens == 128 for c in cells)
    assert {c.drafter for c in cells} == {"ngram", "ngram_gpu", "mtp"}
    assert all(40 <= c.batch <= 128 for c in cells)
    # every key is distinct: the budget is part of it
    assert len({json.dumps(c.key(), sort_keys=True) for c in cells}) == len(cells)
    seen = set()
    for c in cells:
        kw = engine_kwargs(c, "/fa", spec_config(c))
        seen.add((c.drafter, kw["max_num_batched_tokens"], kw["max_num_seqs"],
                  kw["enable_prefix_caching"]))  # fmt: skip
        assert kw["enable_chunked_prefill"] is True
        spec = kw["speculative_config"]
        if c.drafter.startswith("ngram"):
            assert (spec["num_speculative_tokens"], spec["prompt_lookup_min"],
                    spec["prompt_lookup_max"]) == (64, 2, 10)  # fmt: skip
        else:
            assert spec == {"method": "mtp", "num_speculative_tokens": 3}
            assert c.runner == "default" and c.cache_mode == "align"
        if c.drafter == "ngram_gpu":
            assert c.async_sched
        assert kw["async_scheduling"] is c.async_sched
    for d in ("ngram", "ngram_gpu"):
        assert {s[1:] for s in seen if s[0] == d} == {
            (b, s, pc) for b in (96, 128) for s in (4, 8) for pc in (False, True)
        }
    assert {s[1:3] for s in seen if s[0] == "mtp"} == {
        (b, s) for b in (96, 128) for s in (4, 8)
    }
    assert any(c.drafter == "mtp" and c.async_sched for c in cells)
    assert any(c.drafter == "mtp" and not c.async_sched for c in cells)
    # what a user gets: the default runner and vLLM's default scheduling
    # (async_scheduling not passed: None, which EngineArgs reads as "decide")
    default = slice_cells("budget-probe-ngram_default")
    assert len(default) == 8 and {c.runner for c in default} == {"default"}
    assert {c.drafter for c in default} == {"ngram"}
    assert {c.async_sched for c in default} == {None}
    kw = engine_kwargs(default[0], "/fa", spec_config(default[0]))
    assert kw["async_scheduling"] is None
    with pytest.raises(ValueError):
        slice_cells("budget-probe-eagle")


def test_smoke033_slice_covers_the_moved_apis():
    from harness.equivalence import slice_cells

    cells = slice_cells("smoke033")
    assert 4 <= len(cells) <= 6
    assert {c.runner for c in cells} == {"v1", "mrv2", "default"}
    assert any(c.drafter.startswith("scripted:") and c.runner == "mrv2" for c in cells)
    assert any(c.drafter.startswith("scripted:") and c.runner == "v1" for c in cells)
    assert any(c.cache_mode == "align" for c in cells)
    assert any(c.drafter == "ngram_gpu" and c.async_sched for c in cells)


def test_dry_run_prints_cells_without_vllm(line, capsys):
    import sys

    from conftest import run_until_done

    from harness.equivalence import main

    main(["--slice", "budget-probe-mtp", "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    head = json.loads(lines[0])
    assert head == {"slice": "budget-probe-mtp", "cells": 6, "vllm": line,
                    "from": "env"}  # fmt: skip
    items = [json.loads(x) for x in lines[1:]]
    assert len(items) == 6
    for item in items:
        assert item["VLLM_USE_V2_MODEL_RUNNER"] is None  # the default runner
        kw = item["engine_kwargs"]
        assert kw["speculative_config"]["method"] == "mtp"
        assert ("mamba_cache_mode" in kw) == (line == "0.26.0")
    # a fresh interpreter: --help and a dry run never import vLLM
    code = (
        "import sys; from harness.equivalence import main; "
        "main(['--slice', 'smoke033', '--dry-run']); "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    repo = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (repo, env.get("PYTHONPATH", "")) if p
    )
    proc = run_until_done([sys.executable, "-c", code], env=env,
                          what="the harness import check")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.splitlines()) == 1 + 5


# ---------------------------------------------------------------------------
# module structure: no import circle, one entry point

HARNESS = Path(__file__).resolve().parent.parent / "harness"


def _harness_imports(path: Path) -> set[str]:
    """The harness modules ``path`` imports, at module level or inside a
    function (``from .x import``, ``from . import x``, ``harness.x``)."""
    import ast

    mods = {p.stem for p in HARNESS.glob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                names = [node.module.split(".")[0]]
            elif node.level == 1:
                names = [a.name for a in node.names]
            elif node.module and node.module.startswith("harness."):
                names = [node.module.split(".")[1]]
            elif node.module == "harness":
                names = [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names
                     if a.name.startswith("harness.")]  # fmt: skip
        found |= {n for n in names if n in mods and n != path.stem}
    return found


def test_harness_modules_import_no_circle():
    graph = {p.stem: _harness_imports(p) for p in HARNESS.glob("*.py")}
    # the fast-apply task generator needs neither the matrix nor training
    assert graph["fastapply_task"] <= {"models"}
    assert "fastapply" not in graph["equivalence"]

    def cycle_from(start, node, path):
        for dep in sorted(graph[node]):
            if dep == start:
                return [*path, dep]
            if dep not in path:
                found = cycle_from(start, dep, [*path, dep])
                if found:
                    return found
        return None

    for mod in sorted(graph):
        cycle = cycle_from(mod, mod, [mod])
        assert cycle is None, "import circle: " + " -> ".join(cycle)


def _run_python(*args: str):
    import sys

    from conftest import run_until_done

    repo = str(HARNESS.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (repo, env.get("PYTHONPATH", "")) if p
    )
    return run_until_done([sys.executable, *args], env=env, cwd=repo,
                          what=f"python {' '.join(args)}")  # fmt: skip


def test_python_m_harness_help_lists_the_jobs():
    from harness.__main__ import JOBS

    proc = _run_python("-m", "harness", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for job in ("equivalence", "full-matrix", "summarize", "fastapply-train",
                "fastapply-eval"):  # fmt: skip
        assert f"\n  {job} " in proc.stdout
    assert set(JOBS) <= set(proc.stdout.split())
    bad = _run_python("-m", "harness", "no-such-job")
    assert bad.returncode == 2 and "unknown job" in bad.stderr


def test_python_m_harness_dispatches_to_the_module_cli(capsys):
    from harness.__main__ import main
    from harness.full_matrix import RUNS

    assert main(["full-matrix", "slices", "1"]) == 0
    assert capsys.readouterr().out.split() == list(RUNS[1])
    with pytest.raises(SystemExit) as e:
        main(["summarize", "--help"])
    assert e.value.code == 0
    assert "python -m harness.full_matrix summarize" in capsys.readouterr().out


def test_equivalence_imports_the_task_without_the_fastapply_module():
    code = (
        "import sys, harness.equivalence as eq; "
        "assert 'harness.fastapply' not in sys.modules, 'fastapply imported'; "
        "assert 'harness.fastapply_task' in sys.modules; "
        "print(len(eq.cell_prompts('fastapply', 2, 0)))"
    )
    proc = _run_python("-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "2"


def test_mamba1_probe_rejects_every_draft_on_mamba1_and_a_mamba2_control():
    from harness.equivalence import slice_cells

    cells = slice_cells("mamba1-probe")
    rejecting = [c for c in cells if c.drafter == "scripted:all_reject"]
    assert {c.model for c in rejecting} == {"jamba", "mamba", "nemotron_h"}
    assert {c.k for c in rejecting} == {4, 8}
    assert all(c.runner == "v1" for c in cells)


def test_fa3_mtp_probe_is_the_flashinfer_cell_without_flashinfer(tmp_path):
    """fa3-mtp-probe: the flashinfer slice's chunked MTP cell, key for key,
    in a slice whose processes do not get FlashInfer (slice_path gives it to
    flashinfer* slices only), and the same cell unchunked."""
    import subprocess

    from harness.equivalence import slice_cells

    twin, unchunked = slice_cells("fa3-mtp-probe")
    fi = [c for c in slice_cells("flashinfer") if c.key() == twin.key()]
    assert len(fi) == 1 and twin.chunked and twin.drafter == "mtp"
    assert unchunked.key() == {**twin.key(), "chunked": False}
    repo = Path(__file__).resolve().parents[1]
    lines = (repo / "harness/upstream_site.sh").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("slice_path()"))
    (tmp_path / "flashinfer").mkdir()
    script = "\n".join(
        [f"FLASHINFER_DIR={tmp_path}", *lines[start : start + 4],
         'echo "$(slice_path flashinfer)|$(slice_path fa3-mtp-probe)"']
    )  # fmt: skip
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert out.stdout.strip() == f"{tmp_path}|", out.stderr


def test_chunked_mtp_probe_takes_one_part_away_per_cell():
    """chunked-mtp-probe: the chunked cell of fa3-mtp-probe with one part
    taken away per cell (graphs, async, align, the second wave's prefix
    hits, FA3, the MTP head), and every other part of its key kept."""
    from harness.equivalence import slice_cells

    twin = slice_cells("fa3-mtp-probe")[0]
    cells = slice_cells("chunked-mtp-probe")
    base = twin.key()
    keys = [c.key() for c in cells]
    changed = [
        {k for k in base.keys() | ck.keys() if base.get(k) != ck.get(k)} for ck in keys
    ]
    assert changed == [
        {"graphs"},
        {"async"},
        {"cache_mode"},
        {"turns"},
        {"engine"},
        {"drafter", "async"},
    ]
    assert all(c.chunked for c in cells)
    assert twin.cache_mode == "align" and twin.turns == 2 and cells[3].turns == 1
    assert "attention_backend" not in cells[4].extra
    assert cells[4].extra["gdn_prefill_backend"] == twin.extra["gdn_prefill_backend"]
    assert cells[5].drafter.startswith("scripted:") and cells[5].k == twin.k


def test_draft_padding_slice_turns_the_option_on_under_graphs():
    """draft-padding: every cell captures CUDA graphs on V1, leaves steps
    with mixed draft counts, and passes uniform_draft_padding into its
    speculative config beside the drafter's own options (the engine gets no
    such keyword of its own); every V1 backend of recurrent state with a
    speculative path is in it."""
    from harness.equivalence import FASTAPPLY, engine_kwargs, slice_cells, spec_config

    cells = slice_cells("draft-padding")
    assert len({json.dumps(c.key(), sort_keys=True) for c in cells}) == len(cells)
    for c in cells:
        kw = engine_kwargs(c, "/m", spec_config(c))
        assert kw["speculative_config"] == {
            **spec_config(c),
            "uniform_draft_padding": True,
        }
        assert "uniform_draft_padding" not in kw and not kw.get("enforce_eager")
        assert c.runner == "v1" and not c.async_sched
        assert c.drafter.split(":")[0] in ("scripted", "ngram")
        assert c.drafter not in ("scripted:all_zero", "scripted:all_accept")
        assert c.key()["engine"] == {
            "speculative_config": {"uniform_draft_padding": True}
        }
    assert {c.model for c in cells} >= {
        "qwen3_5", "nemotron_h", "qwen3_next", "granitemoehybrid",
        "kimi_linear", "bailing_moe_linear", FASTAPPLY}  # fmt: skip
    assert {c.graphs for c in cells} == {"full_and_piecewise", "full_decode_only"}
    assert any(c.cache_mode == "align" for c in cells)
    assert any(c.chunked for c in cells)
    # a captured graph of at most 512 tokens holds the padded batch
    assert all(c.batch * (1 + c.k) <= 512 for c in cells)


def test_zero_draft_graphs_slice_runs_steps_without_drafts_under_graphs():
    """zero-draft-graphs: every cell captures CUDA graphs on the V1 runner
    (a step without drafts can take a graph of query length 1 there) and
    leaves steps without drafts (scripted all_zero / accept_then_zero /
    heterogeneous, n-gram on the fast-apply fixture); every V1 backend of
    recurrent state with a speculative path is in it, and so are BS 1,
    FULL_DECODE_ONLY, align mode, short prefill chunks, per-request draft
    lengths, and async scheduling (GPU n-gram only: vLLM refuses it with the
    scripted drafter, so no cell asks for that)."""
    from harness.equivalence import FASTAPPLY, engine_kwargs, slice_cells, spec_config

    cells = slice_cells("zero-draft-graphs")
    assert len({json.dumps(c.key(), sort_keys=True) for c in cells}) == len(cells)
    for c in cells:
        kw = engine_kwargs(c, "/m", spec_config(c))
        assert c.graphs in ("full_and_piecewise", "full_decode_only")
        assert not kw.get("enforce_eager")
        assert kw["compilation_config"]["cudagraph_mode"] == c.graphs.upper()
        assert c.runner == "v1"
        assert c.drafter.split(":")[0] in ("scripted", "ngram", "ngram_gpu")
        # vLLM takes async scheduling with GPU n-gram, not with a custom class
        assert not c.async_sched or c.drafter == "ngram_gpu"
        if c.drafter.startswith("scripted:"):
            assert c.drafter.split(":")[1] in (
                "all_zero",
                "accept_then_zero",
                "heterogeneous",
            )
    assert {c.model for c in cells} >= {
        "qwen3_5",
        "nemotron_h",
        "qwen3_next",
        "granitemoehybrid",
        "kimi_linear",
        "bailing_moe_linear",
        FASTAPPLY,
    }
    assert {c.batch for c in cells} >= {1, 8, 16}
    assert any(c.graphs == "full_decode_only" for c in cells)
    assert any(
        c.cache_mode == "align" and c.drafter.startswith("scripted:") for c in cells
    )
    assert any(c.cache_mode == "align" and c.async_sched for c in cells)
    assert any(c.chunked for c in cells)
    assert any(c.drafter == "ngram:acceptance" for c in cells)


def test_tp2_probe_slice_tells_compilation_from_speculation():
    """NemotronH at tensor_parallel_size 2 against its eager reference: the
    target compiled without speculation (with full and piecewise graphs, and
    without graphs), n-gram compiled without graphs, with piecewise graphs
    and with both (the diverging cell)."""
    from harness.equivalence import (
        engine_kwargs,
        reference_parallel,
        slice_cells,
        spec_config,
    )

    cells = slice_cells("tp2-probe")
    assert {c.model for c in cells} == {"nemotron_h"}
    got = {(c.drafter, c.runner, c.graphs) for c in cells}
    assert ("none", "default", "full_and_piecewise") in got
    assert ("none", "default", "none") in got
    assert ("ngram", "default", "none") in got
    assert ("ngram", "default", "piecewise") in got
    assert ("ngram", "default", "full_and_piecewise") in got
    for c in cells:
        kw = engine_kwargs(c, "/m", spec_config(c))
        assert kw["tensor_parallel_size"] == 2
        assert kw["enforce_eager"] is (c.graphs == "eager")
        assert kw["compilation_config"]["cudagraph_mode"] == c.graphs.upper()
        assert (spec_config(c) is None) == (c.drafter == "none")
    # compiled with the eager run's kernels (custom ops "all"), the target
    # alone and with MTP; the MTP cell's reference compiles the same way
    allops = [
        c
        for c in cells
        if engine_kwargs(c, "/m", spec_config(c))["compilation_config"].get(
            "custom_ops"
        )
        == ["all"]
    ]
    assert sorted(c.drafter for c in allops) == ["mtp", "none"]
    assert all(c.graphs == "full_and_piecewise" for c in allops)
    (mtp,) = [c for c in allops if c.drafter == "mtp"]
    assert reference_parallel(mtp)["compilation_config"] == {"custom_ops": ["all"]}


def test_speculative_tp2_cells_take_a_reference_at_their_own_tp_and_compilation(
    tmp_path, monkeypatch
):
    """A speculative cell at tensor_parallel_size 2 is judged against the
    same target at TP=2, runner and compilation without speculation, and
    its teacher-forced pass (the drift oracle's and the tie margin's
    reference) is a prefill of that target too; the tp2-probe's drafter
    "none" cells (the base alone) keep the TP=1 eager reference, and so do
    TP=1 cells."""
    from conftest import greedy_forced

    import harness.equivalence as eq

    seen, forced_at = [], []
    real_forced = eq.teacher_forced

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        if all(cell is not c for c in cells):  # a reference (or its floor)
            seen.append((cell.runner, cell.graphs,
                         cell.extra.get("tensor_parallel_size")))  # fmt: skip
        return [fake_output([1, 2, 3], logprobs) for w in waves for _ in w], {}

    def forced(model, dtype, model_dir, seqs, kv="auto", chunked=False, par=None):
        forced_at.append((len(seqs), par))
        return greedy_forced(model, dtype, model_dir, seqs, kv)

    fake_engines(monkeypatch, fake_generate, forced)
    tp, fp = {"tensor_parallel_size": 2}, "full_and_piecewise"
    cells = [
        eq.Cell("nemotron_h", "ngram", 5, 2, "default", graphs=fp, extra=tp,
                max_tokens=3),
        eq.Cell("nemotron_h", "none", 0, 2, "default", graphs=fp, extra=tp,
                max_tokens=3),
        eq.Cell("nemotron_h", "ngram", 5, 2, max_tokens=3),
    ]  # fmt: skip
    rows = eq.run_cells(cells, tmp_path, n_prompts=2, seed=0)
    assert [r["status"] for r in rows] == ["ok"] * 3
    # each TP cell says which TP its reference ran at (the support table
    # footnotes a divergence against TP=1); a TP=1 cell says nothing
    assert [r.get("reference_tp") for r in rows] == [2, 1, None]
    # the speculative TP=2 cell's; the base's control's and the TP=1 cell's
    assert set(seen) == {("default", fp, 2), ("v1", "eager", None)}
    assert eq.reference_parallel(cells[1]) == {}
    assert eq.reference_parallel(cells[2]) == {}
    assert eq.reference_parallel(cells[0]) == {
        "tensor_parallel_size": 2, "runner": "default", "graphs": fp,
    }  # fmt: skip
    # one teacher-forced pass per reference parallelism: the TP=2 cell's
    # reference, its floor and the cell at TP=2; the rest at TP=1 eager
    # (2 prompts each: the shared TP=1 reference and its floor, the two
    # cells judged against it; the TP=2 reference, its floor, its cell)
    assert sorted(forced_at, key=lambda x: bool(x[1])) == [
        (2 + 2 + 2 * 2, {}),
        (2 + 2 + 2, eq.reference_parallel(cells[0])),
    ]
    # and that pass's engine is the TP=2 compiled target (no CUDA graphs
    # captured: the pass is prefills only)
    kw = {}

    def fake_engine(cell, model_dir):
        kw.update(eq.engine_kwargs(cell, model_dir, None), runner=cell.runner)
        raise RuntimeError("stop")

    monkeypatch.setattr(eq, "_engine", fake_engine)
    with pytest.raises(RuntimeError, match="stop"):
        real_forced("nemotron_h", "bfloat16", "/m", [([1] * 8, [2] * 4)],
                    par=eq.reference_parallel(cells[0]))  # fmt: skip
    assert kw["tensor_parallel_size"] == 2 and kw["runner"] == "default"
    assert kw["compilation_config"] == {"cudagraph_mode": "NONE"}
    assert kw["enforce_eager"] is False
    # a cell that runs its TP group without vLLM's custom all-reduce is
    # judged against a reference and a prefill that do the same
    nccl = replace(cells[0], extra={**tp, "disable_custom_all_reduce": True})
    assert eq.reference_parallel(nccl)["disable_custom_all_reduce"] is True
    with pytest.raises(RuntimeError, match="stop"):
        real_forced("nemotron_h", "bfloat16", "/m", [([1] * 8, [2] * 4)],
                    par=eq.reference_parallel(nccl))  # fmt: skip
    assert kw["disable_custom_all_reduce"] is True
    # and one with inductor options of its own keeps them beside the CUDA
    # graph mode: its own, and the pass's (prefills only, no graphs)
    ind = {"inductor_compile_config": {"combo_kernels": False}}
    nocombo = replace(cells[0], extra={**tp, "compilation_config": ind})
    assert eq.engine_kwargs(nocombo, "/m", None)["compilation_config"] == {
        "cudagraph_mode": "FULL_AND_PIECEWISE", **ind,
    }  # fmt: skip
    with pytest.raises(RuntimeError, match="stop"):
        real_forced("nemotron_h", "bfloat16", "/m", [([1] * 8, [2] * 4)],
                    par=eq.reference_parallel(nocombo))  # fmt: skip
    assert kw["compilation_config"] == {"cudagraph_mode": "NONE", **ind}


def test_tp2_slice_shards_every_recurrent_head_count():
    """The tensor-parallel cells (2 GPUs): n-gram k=64 and MTP on both
    runners and cache modes, every cell with tensor_parallel_size 2, on
    fixtures whose attention, GDN and Mamba2 head counts divide by 2;
    compiled with CUDA graphs, and NemotronH's MTP cells eager as well."""
    from harness.equivalence import FASTAPPLY, engine_kwargs, slice_cells, spec_config
    from harness.models import nemotron_h_config, qwen3_5_config

    cells = slice_cells("tp2")
    assert len(cells) == 16
    eager = [c for c in cells if c.graphs == "eager"]
    assert {(c.model, c.drafter) for c in eager} == {("nemotron_h", "mtp")}
    assert len(eager) == 4
    assert {(c.drafter, c.k) for c in cells} == {("ngram", 64), ("mtp", 3)}
    assert {(c.runner, c.cache_mode) for c in cells} == {
        (r, cm) for r in ("default", "v1") for cm in ("none", "align")
    }
    assert {c.model for c in cells} == {FASTAPPLY, "nemotron_h"}
    for c in cells:
        kw = engine_kwargs(c, "/m", spec_config(c))
        assert kw["tensor_parallel_size"] == 2
        assert kw["enforce_eager"] is (c.graphs == "eager")
    fastapply = (
        Path(__file__).resolve().parents[1] / "fixtures" / "fastapply" / "config.json"
    )
    for cfg in (
        qwen3_5_config(),
        nemotron_h_config(),
        json.loads(fastapply.read_text()),
    ):
        text = cfg.get("text_config", cfg)
        heads = {k: v for k, v in text.items() if k.endswith(("_heads", "n_groups"))}
        assert len(heads) >= 2, text
        # a group count of 1 is replicated on every rank
        assert all(v % 2 == 0 or k.endswith("n_groups") and v == 1
                   for k, v in heads.items()), heads  # fmt: skip


def test_every_variant_process_gets_its_own_compile_cache():
    """GPU scripts start a variant's process only through ``in_variant`` /
    ``variant_env`` (harness/upstream_site.sh), which give it its site and
    its own vLLM cache: vLLM's torch.compile cache key does not cover every
    patched file, and the fork once loaded upstream's compiled EAGLE-3
    backbone."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    site = repo / "harness/upstream_site.sh"
    scripts = [p for d in ("harness", "benchmarks", "serving")
               for p in (repo / d).glob("*.sh") if p != site]  # fmt: skip
    uses = 0
    for p in scripts:
        text = p.read_text()
        assert "site_pythonpath" not in text, p.name
        uses += text.count("in_variant ") + text.count("$(variant_env ")
    assert uses >= 12
    # the helpers themselves, with the site lookup stubbed
    lines = site.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("variant_cache()"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("prepare_variants()"))
    script = "\n".join(
        ['site_pythonpath() { echo "/repo:/sites/$1"; }', *lines[start:end]]
        + [
            "variant_env fork; variant_env upstream; variant_env fork /pre",
            "in_variant upstream sh -c 'echo $VLLM_CACHE_ROOT $PYTHONPATH'",
            "HS_EXTRA_PATH=/fi in_variant fork sh -c 'echo $PYTHONPATH'",
        ]
    )
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [
        "VLLM_CACHE_ROOT=/tmp/vllm-cache/fork PYTHONPATH=/repo:/sites/fork",
        "VLLM_CACHE_ROOT=/tmp/vllm-cache/upstream PYTHONPATH=/repo:/sites/upstream",
        "VLLM_CACHE_ROOT=/tmp/vllm-cache/fork PYTHONPATH=/pre:/repo:/sites/fork",
        "/tmp/vllm-cache/upstream /repo:/sites/upstream",
        "/fi:/repo:/sites/fork",
    ]


def test_only_a_flashinfer_slice_gets_flashinfer_on_its_path(tmp_path):
    """FlashInfer stays out of the shared dependency folder; a flashinfer*
    slice's processes get the folder it was moved to first on their own
    PYTHONPATH (``slice_path``, which gpu_matrix.sh puts before
    ``in_variant``), so it runs beside other slices in one call."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    lines = (repo / "harness/upstream_site.sh").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("slice_path()"))
    fi = tmp_path / "flashinfer-off"
    body = [f"FLASHINFER_DIR={fi}", *lines[start : start + 4]]
    script = "\n".join(
        [
            *body,
            "for s in flashinfer flashinfer-mrv2 families fp8; do",
            '  echo "$s=$(slice_path $s)"; done',
        ]  # fmt: skip
    )

    def run():
        return subprocess.run(["bash", "-c", script], capture_output=True,
                              text=True, check=True).stdout.split()  # fmt: skip

    # the bundle carries no FlashInfer: nobody gets the folder
    assert run() == ["flashinfer=", "flashinfer-mrv2=", "families=", "fp8="]
    (fi / "flashinfer").mkdir(parents=True)
    assert run() == [f"flashinfer={fi}", f"flashinfer-mrv2={fi}", "families=", "fp8="]
    text = (repo / "harness/gpu_matrix.sh").read_text()
    assert 'HS_EXTRA_PATH=$(slice_path "$s") on_gpu' in text


def test_sites_made_side_by_side_are_whole(tmp_path):
    """Two scripts of one GPU call making the same variant's site at once
    (``make_site``, harness/upstream_site.sh): each builds its own copy and
    renames it into place, so the site ends up whole, reversed once, with
    no half-built copy left beside it, and a third call reuses it."""
    repo = Path(__file__).resolve().parents[1]
    lines = (repo / "harness/upstream_site.sh").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("_site_dir()"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("make_upstream_site"))
    site = tmp_path / "bundle-site" / "vllm"
    site.mkdir(parents=True)
    (site / "x.py").write_text("".join(f"line {i}\n" for i in range(200)) + "fixed\n")
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-fix.patch").write_text(
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -200,2 +200,2 @@\n"
        " line 199\n-broken\n+fixed\n"
    )
    (patches / "series").write_text("0001-fix.patch\n")
    script = "\n".join(
        [
            f"BUNDLE_SITE={tmp_path / 'bundle-site'}",
            f"PATCHES={patches}",
            "BUNDLE_PATCHES=1",
            *lines[start:end],
            f'_site_dir() {{ echo "{tmp_path}/site-$1"; }}',
            "make_site upstream > /dev/null & a=$!",
            "make_site upstream > /dev/null & b=$!",
            'wait "$a" && wait "$b" && make_site upstream',
        ]
    )
    proc = run_until_done(["bash", "-c", script], what="three make_site calls")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # the third call found the site made
    made = tmp_path / "site-upstream" / "vllm" / "x.py"
    assert made.read_text().endswith("line 199\nbroken\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bundle-site", "patches", "site-upstream",
    ]  # fmt: skip


def test_stop_cells_share_their_stop_ids_with_their_own_reference(
    tmp_path, monkeypatch
):
    """A "stop" cell's requests and its non-speculative reference stop at
    the same token ids; a plain cell of the same shape has its own
    reference."""
    import harness.equivalence as eq

    seen = []

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        seen.append((cell.drafter, eq.request_kwargs(cell)))
        return [fake_output([1, 2, 3], logprobs) for w in waves for _ in w], {}

    fake_engines(monkeypatch, fake_generate)
    cells = [
        eq.Cell("qwen3_5", "ngram", 8, 2, request="stop", max_tokens=3),
        eq.Cell("qwen3_5", "ngram", 8, 2, max_tokens=3),
    ]
    rows = eq.run_cells(cells, tmp_path, n_prompts=2, seed=0)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    stop = {"stop_token_ids": list(eq.STOP_IDS["default"])}
    refs = [kw for drafter, kw in seen if drafter == "none"]
    # one reference per request shape, each with its cell's request features
    assert sorted(map(str, refs)) == sorted(map(str, [stop, {}]))
    assert ("ngram", stop) in seen and ("ngram", {}) in seen
    assert rows[0]["request"] == "stop" and "request" not in rows[1]
    assert eq.request_kwargs(eq.Cell(eq.FASTAPPLY, "mtp", 3, 8, request="stop")) == {
        "stop_token_ids": [16]
    }
    with pytest.raises(ValueError):
        eq.request_kwargs(eq.Cell("qwen3_5", "mtp", 3, 8, request="json"))
    assert {c.request for c in eq.slice_cells("requests")} == {
        "stop", "regex", "n2", "plp",
    }  # fmt: skip


def test_verify_run_judges_a_constrained_candidate_by_the_reference_run():
    from harness.compare import verify_run

    lps = [{5: -0.1, 6: -0.12, 7: -4.0}, {8: -0.1, 9: -5.0, 10: -6.0}]
    ref = [Position.from_logprobs(t, lp) for t, lp in zip((5, 8), lps, strict=True)]
    assert verify_run(ref, [5, 8], [5, 8], 0.05).status == "match"
    # 6 is within the tie margin of the reference's 5: a tie, not judged on
    assert verify_run(ref, [5, 8], [6, 1], 0.05).status == "tie"
    v = verify_run(ref, [5, 8], [5, 9], 0.05)
    assert v.status == "diverged" and v.first["margin"] == pytest.approx(4.9)
    # a token outside the reference's top-k is at least as far as the last
    assert verify_run(ref, [5, 8], [5, 99], 0.05).max_margin == pytest.approx(5.9)
    assert verify_run(ref, [5, 8], [5], 0.05).first["expected"] == "2 tokens"


def test_regex_cells_are_judged_by_their_own_reference_run(tmp_path, monkeypatch):
    """A regex (structured output) cell is compared with the reference run
    under the same grammar; that reference, whose teacher-forced logprobs do
    not see the grammar, widens neither the tie margin nor the drift floor of
    the plain cells beside it."""
    import harness.equivalence as eq

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        # under the grammar the masked greedy choice is another token
        toks = [100, 101, 102] if cell.request == "regex" else [10, 11, 12]
        if cell.drafter == "mtp":
            toks = [100, 103, 102]  # the "bug": a masked-greedy token changed
        return [fake_output(list(toks), logprobs, -6.0) for w in waves for _ in w], {}

    def fake_forced(model, dtype, model_dir, seqs, kv_cache_dtype="auto", **_):
        # unmasked teacher forcing prefers token 200, which the grammar masks
        return [
            [
                Position.top(
                    {200: -0.1, t: -9.0} if t >= 100 else {t: -0.1, 1: -3.0},
                    candidate=t,
                )
                for t in c
            ]
            for _, c in seqs
        ]

    fake_engines(monkeypatch, fake_generate, fake_forced)
    cells = [
        eq.Cell("qwen3_5", "ngram", 8, 2, request="regex", max_tokens=3),
        eq.Cell("qwen3_5", "mtp", 3, 2, request="regex", max_tokens=3),
        eq.Cell("qwen3_5", "ngram", 8, 2, max_tokens=3),
    ]
    rows = eq.run_cells(cells, tmp_path, n_prompts=2, seed=0)
    assert [r["status"] for r in rows] == ["ok", "diverged", "ok"]
    assert rows[1]["first_divergence"]["position"] == 1
    assert rows[1]["first_divergence"]["margin"] == pytest.approx(5.9)
    assert rows[0]["drift_positions"] == 0  # no drift oracle under a grammar
    # the plain cell's margin and drift floor come from the plain reference
    assert rows[2]["tie_margin"] == pytest.approx(0.05)
    assert rows[2]["drift_floor"] < 1.0


def test_constrained_cells_alone_are_judged_with_their_references_noise(
    tmp_path, monkeypatch
):
    """A group of regex cells only (as the fuzzer draws them): the tie margin
    comes from the noise of their own reference, measured where its run and
    the unmasked prefill rank the same two tokens first, not the bare
    TIE_MARGIN. A flip by one bf16 step (0.0625 at logprobs near -10) that
    the measured noise covers is a tie."""
    import harness.equivalence as eq

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        toks = list(range(100, 112))
        if cell.drafter == "mtp":
            toks[9] = 110  # where the reference has 109
        # the run's gap between its token t and t + 1: 0.0625
        return [
            fake_output(list(toks), logprobs, -0.1625) for w in waves for _ in w
        ], {}

    def fake_forced(model, dtype, model_dir, seqs, kv_cache_dtype="auto", **_):
        # the prefill ranks the same two tokens first, 0.2 apart
        return [
            [Position.top({t: -0.1, t + 1: -0.3}, candidate=t) for t in c]
            for _, c in seqs
        ]

    fake_engines(monkeypatch, fake_generate, fake_forced)
    cells = [
        eq.Cell("qwen3_5", "ngram", 8, 2, request="regex", max_tokens=12),
        eq.Cell("qwen3_5", "mtp", 3, 2, request="regex", max_tokens=12),
    ]
    rows = eq.run_cells(cells, tmp_path, n_prompts=2, seed=0)
    # noise |0.0625 - 0.2|, the tie margin twice that
    assert rows[1]["noise"] == pytest.approx(0.1375)
    assert rows[1]["tie_margin"] == pytest.approx(0.275)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert rows[1]["ties"] == 2 and rows[1]["divergences"] == 0


def test_prompt_logprobs_are_judged_against_the_reference(tmp_path, monkeypatch):
    """A "plp" cell: the candidate's prompt logprobs against the reference's,
    within the noise between the reference and its floor run (another batch
    composition); a candidate one nat off at one prompt position diverges,
    an exact one is ok."""
    from types import SimpleNamespace

    import harness.equivalence as eq

    def out(prompt, noise, bug):
        o = fake_output([10, 11, 12], True)
        o.prompt_token_ids = list(prompt)
        o.prompt_logprobs = [None] + [
            {
                t: SimpleNamespace(logprob=-1.0 + noise + (bug if i == 3 else 0.0)),
                t + 1: SimpleNamespace(logprob=-3.0),
            }
            for i, t in enumerate(prompt[1:])
        ]
        return o

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        bug = 1.0 if cell.drafter == "mtp" else 0.0
        outs = []
        for w, wave in enumerate(waves):
            # the reference's second wave is its floor run: a little noise
            noise = 0.01 if batches is not None and w == 1 else 0.0
            outs += [out(p, noise, bug) for p in wave]
        return outs, {}

    fake_engines(monkeypatch, fake_generate)
    cells = [
        eq.Cell("qwen3_5", "ngram", 8, 2, request="plp", max_tokens=3),
        eq.Cell("qwen3_5", "mtp", 3, 2, request="plp", max_tokens=3),
    ]
    rows = eq.run_cells(cells, tmp_path, n_prompts=2, seed=0)
    assert rows[0]["prompt_drift_floor"] == pytest.approx(0.01)
    assert rows[0]["prompt_drift_violations"] == 0 and rows[0]["status"] == "ok"
    assert rows[1]["prompt_drift_violations"] == 2  # position 3 of each prompt
    assert rows[1]["prompt_drift_max"] == pytest.approx(1.0)
    assert rows[1]["status"] == "diverged"
    assert eq.request_kwargs(cells[0]) == {"prompt_logprobs": eq.oracle.TOPK}


def plp_output(prompt, shift: float):
    """A fake output with prompt logprobs: the prompt's fourth scored token
    moved by ``shift`` nats."""
    from types import SimpleNamespace

    o = fake_output([10, 11, 12], True)
    o.prompt_token_ids = list(prompt)
    o.prompt_logprobs = [None] + [
        {
            t: SimpleNamespace(logprob=-1.0 + (shift if i == 3 else 0.0)),
            t + 1: SimpleNamespace(logprob=-3.0),
        }
        for i, t in enumerate(prompt[1:])
    ]
    return o


def test_a_chunked_candidates_prompt_logprobs_are_judged_by_a_chunked_prefill(
    monkeypatch, tmp_path
):
    """A "plp" reference also prefills its prompts in chunks of PLP_CHUNK
    tokens without speculation; a candidate that prefills in chunks (a
    budget) is judged within that run's difference from the reference: its
    chunked rounding (0.3 nats here) passes, a nat does not; an unchunked
    candidate is still held to the plain floor."""

    import harness.equivalence as eq

    seen = []

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        seen.append((cell.drafter, cell.extra.get("max_num_batched_tokens")))
        budget = cell.extra.get("max_num_batched_tokens")
        shift = 0.0
        if budget:  # a chunked prefill rounds otherwise
            shift = 0.3
        if cell.drafter == "mtp":  # the bug
            shift = 1.0
        return [plp_output(p, shift) for w in waves for p in w], {}

    fake_engines(monkeypatch, fake_generate)
    chunked = {"enable_chunked_prefill": True, "max_num_batched_tokens": 24}
    cells = [
        eq.Cell("qwen3_5", "ngram", 8, 2, request="plp", max_tokens=3, extra=chunked),
        eq.Cell("qwen3_5", "mtp", 3, 2, request="plp", max_tokens=3, extra=chunked),
        eq.Cell("qwen3_5", "scripted:all_zero", 4, 2, request="plp", max_tokens=3,
                extra={"max_num_batched_tokens": 24}),
    ]  # fmt: skip
    rows = eq.run_cells(cells, tmp_path, n_prompts=2, seed=0)
    # the reference's chunked run: no drafter, the smallest budget
    assert ("none", eq.PLP_CHUNK) in seen
    assert rows[0]["prompt_drift_violations"] == 0 and rows[0]["status"] == "ok"
    assert rows[1]["prompt_drift_violations"] == 2 and rows[1]["status"] == "diverged"
    # a budget without chunked prefill: judged by the plain floor
    assert not eq.chunked_prefill(rows[2])
    assert rows[2]["prompt_drift_violations"] == 2
    assert eq.chunked_prefill({"chunked": True})


def test_a_chunked_candidates_prompt_floor_takes_chunks_smaller_than_its_budget(
    monkeypatch, tmp_path
):
    """A candidate's verify rows take part of its budget, so its prompts go
    in chunks smaller than the budget: the prompt floor also prefills the
    reference's prompts in chunks of PLP_CHUNK_SMALL (max_num_seqs lowered
    to match, since vLLM takes no budget below it). Rounding that only the
    small chunks show (0.5 nats here, 0.1 at chunks of 16) passes; without
    the small-chunk run it would not."""
    import harness.equivalence as eq

    seen = []
    small = eq.PLP_CHUNK_SMALL
    shifts = {None: 0.0, eq.PLP_CHUNK: 0.1, small: 0.5}

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        budget = cell.extra.get("max_num_batched_tokens")
        seen.append((cell.drafter, budget, cell.extra.get("max_num_seqs")))
        shift = shifts.get(budget)
        if cell.drafter != "none":
            shift = 0.45  # chunks of 4-12 beside verify rows
        return [plp_output(p, shift) for w in waves for p in w], {}

    fake_engines(monkeypatch, fake_generate)
    chunked = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16}
    cell = eq.Cell("qwen3_5", "ngram", 8, 8, request="plp", max_tokens=3,
                   extra=chunked)  # fmt: skip
    (row,) = eq.run_cells([cell], tmp_path, n_prompts=8, seed=0)
    assert ("none", small, small) in seen
    assert ("none", eq.PLP_CHUNK, None) in seen
    assert row["prompt_drift_violations"] == 0 and row["status"] == "ok", row
    shapes = eq.plp_shape_cells(eq.Cell("qwen3_5", "none", 0, 8), cell)
    assert [c.extra["max_num_batched_tokens"] for c in shapes] == [16, 4]
    # the same candidate judged with the chunks of 16 alone
    monkeypatch.setattr(eq, "PLP_CHUNK_SMALL", eq.PLP_CHUNK)
    (row,) = eq.run_cells([cell], tmp_path / "b", n_prompts=8, seed=0)
    assert row["prompt_drift_violations"] > 0 and row["status"] == "diverged"


def test_a_compiled_candidates_prompt_logprobs_are_judged_by_a_compiled_prefill(
    monkeypatch, tmp_path
):
    """A compiled "plp" candidate is judged within the difference between
    the eager reference and the same prompts prefilled without speculation
    by the target compiled as the candidate is (runner and graphs): the
    compiled rounding (0.3 nats here) passes, a nat does not; an eager
    candidate gets no such run and is held to the plain floor."""

    import harness.equivalence as eq

    seen = []

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        seen.append((cell.drafter, cell.runner, cell.graphs))
        shift = 0.3 if cell.graphs != "eager" else 0.0  # compiled rounding
        if cell.drafter == "mtp":  # the bug
            shift = 1.0
        return [plp_output(p, shift) for w in waves for p in w], {}

    fake_engines(monkeypatch, fake_generate)
    fp = "full_and_piecewise"
    cells = [
        eq.Cell("qwen3_5", "ngram", 8, 2, "mrv2", graphs=fp, request="plp",
                max_tokens=3),
        eq.Cell("qwen3_5", "mtp", 3, 2, "mrv2", graphs=fp, request="plp",
                max_tokens=3),
        eq.Cell("qwen3_5", "ngram", 8, 2, request="plp", max_tokens=3),
    ]  # fmt: skip
    rows = eq.run_cells(cells, tmp_path, n_prompts=2, seed=0)
    # one compiled run without speculation, shared by both compiled cells
    assert seen.count(("none", "mrv2", fp)) == 1
    assert rows[0]["prompt_drift_violations"] == 0 and rows[0]["status"] == "ok"
    assert rows[1]["prompt_drift_violations"] == 2 and rows[1]["status"] == "diverged"
    assert rows[2]["status"] == "ok"
    assert eq.plp_shape_cells(eq.Cell("qwen3_5", "none", 0, 2), cells[2]) == []


def test_prompt_logprob_floor_and_prompts_that_went_another_way():
    """judge_prompt_lps: the floor run repeats a prefill in the same engine
    (no noise here), so the cell's own floor (decode against prefill)
    bounds it from below: a candidate engine's rounding within that floor
    passes, a nat does not. A prompt that continues an answer which went
    another way at a tie is compared up to its first other token."""
    from harness import oracle
    from harness.equivalence import judge_prompt_lps

    def lps(toks, shift=0.0, at=None):
        return [
            {t: -1.0 + (shift if at is None or i == at else 0.0), t + 1: -3.0}
            for i, t in enumerate(toks)
        ]

    toks = [5, 6, 7, 8, 9, 10]
    ref = [(toks, lps(toks))]
    floor_run = [(toks, lps(toks))]  # batch-invariant prefill: floor 0
    rounding = [(toks, lps(toks, 0.03))]
    path = oracle.Floor(token=0.05, topk=0.05, positions=200)

    strict = judge_prompt_lps(rounding, ref, floor_run, "bfloat16")
    assert strict["prompt_drift_violations"] > 0  # the floor run alone
    ok = judge_prompt_lps(rounding, ref, floor_run, "bfloat16", path_floor=path)
    assert ok["prompt_drift_violations"] == 0
    assert ok["prompt_drift_floor"] == pytest.approx(0.05)
    bug = [(toks, lps(toks, 1.0, at=2))]
    bad = judge_prompt_lps(bug, ref, floor_run, "bfloat16", path_floor=path)
    assert bad["prompt_drift_violations"] == 1
    assert bad["prompt_first_drift"]["position"] == 2

    # a later turn: the candidate's prompt carries its own answer from
    # position 3 on; its logprobs there condition on another prefix
    other = toks[:3] + [50, 51, 52]
    turn = [(other, lps(toks[:3]) + lps([50, 51, 52], 4.0))]
    got = judge_prompt_lps(turn, ref, floor_run, "bfloat16", path_floor=path)
    assert got["prompt_differs"] == 1
    assert got["prompt_drift_violations"] == 0 and got["prompt_drift_positions"] == 3


def test_the_regex_admits_exactly_the_low_half_of_the_fixture_vocabulary():
    """The "regex" request features, compiled by xgrammar (vLLM's default
    structured-output backend) over the fixtures' word-level tokenizer:
    ids 0..127 first, then also end of sequence."""
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from harness.equivalence import FASTAPPLY_DIR, REGEX

    tok = AutoTokenizer.from_pretrained(FASTAPPLY_DIR)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=256)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(REGEX))
    mask = xgr.allocate_token_bitmask(1, 256)

    def allowed():
        matcher.fill_next_token_bitmask(mask)
        return {i for i in range(256) if (int(mask[0, i // 32]) >> (i % 32)) & 1}

    assert allowed() == set(range(128))
    assert matcher.accept_token(100)
    assert allowed() == set(range(128)) | {tok.eos_token_id}
    assert not matcher.accept_token(200)


def test_multi_turn_cells_continue_each_previous_wave(tmp_path, monkeypatch):
    """turns=4 in align mode: the reference runs four waves, each wave's
    prompts the previous wave's prompts, three quarters of its answers and
    fresh tokens; the candidate gets the same four waves in one engine."""
    import harness.equivalence as eq

    calls = []

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        calls.append((cell.drafter, [len(w) for w in waves], waves))
        return [fake_output([3, 4, 5, 6], logprobs, -6.0) for w in waves for _ in w], {}

    fake_engines(monkeypatch, fake_generate)
    cell = eq.Cell("qwen3_5", "mtp", 3, 2, cache_mode="align", turns=4, max_tokens=4)
    (row,) = eq.run_cells([cell], tmp_path, n_prompts=2, seed=0)
    assert row["status"] == "ok" and row["turns"] == 4
    refs = [w for d, _, w in calls if d == "none"]
    (cand,) = [w for d, _, w in calls if d == "mtp"]
    assert len(refs) == 4 and len(cand) == 4
    for turn in range(1, 4):
        for prev, now in zip(cand[turn - 1], cand[turn], strict=True):
            # the previous prompt, 3 of the 4 answer tokens, 4 fresh ones
            assert now[: len(prev) + 3] == prev + [3, 4, 5]
            assert len(now) == len(prev) + 3 + 4
    assert row["tokens"] == 4 * 2 * 4


def test_teacher_forcing_makes_room_for_long_sequences(monkeypatch):
    import harness.equivalence as eq

    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(cell, model_dir):
        seen.update(eq.engine_kwargs(cell, model_dir, None))
        raise Stop

    monkeypatch.setattr(eq, "_engine", fake_engine)
    with pytest.raises(Stop):
        eq.teacher_forced("qwen3_5", "bfloat16", "/m", [([1] * 6500, [2] * 64)])
    assert seen["max_model_len"] == 6576
    seen.clear()
    with pytest.raises(Stop):
        eq.teacher_forced("qwen3_5", "bfloat16", "/m", [([1] * 100, [2] * 64)])
    assert seen["max_model_len"] == 2048
    cells = eq.slice_cells("multi-turn")
    assert {c.turns for c in cells} == {4, 2}
    assert any(c.prompts and c.prompts[2] >= 6000 for c in cells)


def test_n2_cells_judge_every_completion(monkeypatch):
    """request="n2": SamplingParams(n=2); generate returns one entry per
    completion in prompt order, and flat_prompts pairs each with its
    prompt."""
    import harness.equivalence as eq

    seen = {}

    class C:
        def __init__(self, toks):
            self.token_ids = toks
            self.logprobs = None

    class Out:
        def __init__(self, prompt, n):
            self.prompt_token_ids = prompt
            self.outputs = [C([prompt[0], j]) for j in range(n)]

    class LLM:
        def generate(self, prompts, sp, use_tqdm=False):
            seen["n"] = sp.n
            return [Out(p["prompt_token_ids"], sp.n) for p in prompts]

    monkeypatch.setattr(eq, "_engine", lambda cell, model_dir: LLM())
    monkeypatch.setattr(eq, "_shutdown", lambda llm: None)
    cell = eq.Cell("qwen3_5", "mtp", 3, 2, sampling="t1", request="n2", max_tokens=2)
    with pytest.raises(ValueError, match="sampled"):
        eq.request_kwargs(eq.Cell("qwen3_5", "mtp", 3, 2, request="n2"))
    assert eq.reference_request(cell) == "plain"
    waves = [[[5, 1], [6, 1]], [[7, 1]]]
    outs, _ = eq.generate(cell, "/m", waves, logprobs=None)
    assert seen["n"] == 2
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        [5, 0], [5, 1], [6, 0], [6, 1], [7, 0], [7, 1]
    ]  # fmt: skip
    assert all(len(o.outputs) == 1 for o in outs)
    assert eq.flat_prompts(waves, "n2") == [
        [5, 1], [5, 1], [6, 1], [6, 1], [7, 1], [7, 1]
    ]  # fmt: skip
    assert eq.flat_prompts(waves, "plain") == [[5, 1], [6, 1], [7, 1]]


def test_suffix_slice_runs_suffix_decoding_on_v1(line):
    """Suffix decoding (arctic-inference, built on the host by hsfork.kit):
    V1 only, the runner both lines run it on; the trained
    fast-apply fixture in none and align mode and under CUDA graphs, plus a
    GDN and a Mamba2 random-weight cell; the support table names it."""
    from harness import support_table
    from harness.equivalence import FASTAPPLY, engine_kwargs, slice_cells, spec_config

    cells = slice_cells("suffix")
    assert {c.drafter for c in cells} == {"suffix"}
    assert {c.runner for c in cells} == {"v1"}
    assert {c.model for c in cells} == {FASTAPPLY, "qwen3_5", "nemotron_h"}
    fa = [c for c in cells if c.model == FASTAPPLY]
    assert {c.cache_mode for c in fa} == {"none", "align"}
    assert {c.graphs for c in cells} == {"eager", "full_and_piecewise"}
    for cell in cells:
        spec = spec_config(cell)
        assert spec == {"method": "suffix", "num_speculative_tokens": cell.k}
        # k within the suffix tree's default depth (24): longer drafts
        # could never come
        assert cell.k <= 24
        assert engine_kwargs(cell, "/m", spec)["speculative_config"] == spec
    assert support_table.DRAFTERS["suffix"] == "suffix decoding"


def test_a_margin_that_takes_in_most_positions_judges_nothing():
    """compare.judgeable: a cell with more than a quarter of its positions
    inside the tie margin is inconclusive, whichever way it came out (its
    earlier verdict and the reason kept); a cell at or under the share, and
    an errored or refused cell, is left as it is."""
    from harness.compare import UNJUDGED_TIE_SHARE, judgeable

    assert UNJUDGED_TIE_SHARE == 0.25
    for status in ("ok", "diverged"):
        row = {"status": status, "tokens": 768, "ties": 399, "tie_margin": 14.125}
        out = judgeable(row)
        assert out["status"] == "inconclusive" and out["judged_as"] == status
        assert (
            "399 of 768 positions within the tie margin (14.125)" in out["inconclusive"]
        )
        assert row["status"] == status  # the input is not changed
    at_share = {"status": "ok", "tokens": 768, "ties": 192}
    assert judgeable(at_share) is at_share
    for row in ({"status": "error", "tokens": 0, "ties": 0},
                {"status": "rejected"}, {"status": "ok", "tokens": 0}):  # fmt: skip
        assert judgeable(row) is row


def test_run_cells_reports_an_unjudgeable_cell_as_inconclusive(tmp_path, monkeypatch):
    """A candidate whose every token is the reference's close second (a
    tie, inside the margin) matched nothing the harness can tell from
    noise: run_cells reports it inconclusive, not ok."""
    import harness.equivalence as eq

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        return [fake_output([1, 2, 3], logprobs) for w in waves for _ in w], {}

    def close_second(model, dtype, model_dir, seqs, kv="auto", **_):
        # the reference prefers token + 1 by 0.01 at every position
        return [[Position(t + 1, t, 0.01) for t in c] for _, c in seqs]

    fake_engines(monkeypatch, fake_generate, close_second)
    cells = [eq.Cell("qwen3_5", "ngram", 5, 2, max_tokens=3)]
    (row,) = eq.run_cells(cells, tmp_path, n_prompts=2, seed=0)
    assert row["ties"] == row["tokens"] == 6
    assert row["status"] == "inconclusive" and row["judged_as"] == "ok"


def test_a_tp_cell_with_compilation_options_runs_and_shards(tmp_path, monkeypatch):
    """A TP cell whose extra carries compilation options (a dict: the
    tp2-probe's inductor settings) keys its reference by them: the slice
    shards, the cell runs, and its teacher-forced pass gets the options
    back as a dict. (The reference key once held the dict itself, which
    Python cannot hash: sharding tp2-probe raised TypeError.)"""
    from conftest import greedy_forced

    import harness.equivalence as eq

    probe = eq.slice_cells("tp2-probe")
    assert sum(len(eq.shard(probe, f"{i}/6")) for i in range(1, 7)) == len(probe)
    (cell,) = [
        replace(c, max_tokens=3, batch=2)
        for c in probe
        if c.drafter == "mtp"
        and "inductor_compile_config" in c.extra.get("compilation_config", {})
    ]
    forced_par = []

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        return [fake_output([1, 2, 3], logprobs) for w in waves for _ in w], {}

    def forced(model, dtype, model_dir, seqs, kv="auto", chunked=False, par=None):
        forced_par.append(par)
        return greedy_forced(model, dtype, model_dir, seqs, kv)

    fake_engines(monkeypatch, fake_generate, forced)
    (row,) = eq.run_cells([cell], tmp_path, n_prompts=2, seed=0)
    assert row["status"] == "ok", row.get("error")
    assert forced_par and all(
        p["compilation_config"] == cell.extra["compilation_config"] for p in forced_par
    )
