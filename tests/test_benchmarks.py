# SPDX-License-Identifier: Apache-2.0
"""The decode benchmark's own logic, on a CPU: step classification and
aggregation, the scripted drafter's schedule, argument parsing, the
side-by-side driver (with a fake benchmark process) and the ratio report."""

from __future__ import annotations

import difflib
import json
import os
import stat
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import decode_latency as dl
from benchmarks import plot, scripted
from benchmarks import side_by_side as sbs
from benchmarks.decode_latency import StepRecord, step_record, summarize

# --- scripted drafter -------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("rate", [0.0, 0.3, 0.7, 1.0])
def test_prefix_probability_hits_rate(k, rate):
    p = scripted.prefix_probability(rate, k)
    assert 0.0 <= p <= 1.0
    assert scripted.expected_rate(p, k) == pytest.approx(rate, abs=1e-9)


def test_prefix_probability_rejects_bad_input():
    with pytest.raises(ValueError):
        scripted.prefix_probability(1.5, 4)
    with pytest.raises(ValueError):
        scripted.prefix_probability(0.5, 0)
    with pytest.raises(ValueError):
        scripted.prefix_probability(0.5, scripted.MAX_K + 1)
    assert scripted.accepted_prefix(0, 1, 2, scripted.MAX_K, 1.0) == scripted.MAX_K


def test_accepted_prefix_is_deterministic_and_near_the_rate():
    k = 4
    p = scripted.prefix_probability(0.7, k)
    draws = [scripted.accepted_prefix(0, row, step, k, p) for row in range(64)
             for step in range(64)]  # fmt: skip
    assert all(0 <= c <= k for c in draws)
    assert draws == [scripted.accepted_prefix(0, row, step, k, p)
                     for row in range(64) for step in range(64)]  # fmt: skip
    assert np.mean(draws) / k == pytest.approx(0.7, abs=0.02)
    assert scripted.accepted_prefix(1, 0, 0, k, 1.0) == k
    assert scripted.accepted_prefix(1, 0, 0, k, 0.0) == 0


def _batch(rows: list[list[int]], width: int = 64):
    tok = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        tok[i, : len(r)] = r
    return tok, np.array([len(r) for r in rows], dtype=np.int32)


def _plan(rate=0.7, k=4):
    prompts = [list(range(100, 110)), list(range(200, 212))]
    refs = [list(range(1000, 1040)), list(range(2000, 2040))]
    return scripted.make_plan(prompts, refs, rate, k, seed=0, vocab_size=5000), (
        prompts,
        refs,
    )


def test_propose_rows_follows_reference_and_schedule():
    plan, (prompts, refs) = _plan()
    # row 0 has generated 3 tokens (the newest is refs[0][2]); row 1 one token
    rows = [prompts[0] + refs[0][:3], prompts[1] + refs[1][:1], [7] * 9]
    tok, n = _batch(rows)
    out = scripted.propose_rows(plan, 4, [[1], [1], [1]], n, tok)
    assert out[2] == []  # not a scripted request
    for i, (row, g) in enumerate([(0, 2), (1, 0)]):
        c = scripted.accepted_prefix(0, row, 0, 4, plan.p)
        ref = refs[row][g + 1 : g + 5]
        assert len(out[i]) == 4
        assert out[i][:c] == ref[:c]
        assert all(d != r for d, r in zip(out[i][c:], ref[c:], strict=True))
    assert plan.proposed == 8
    assert plan.steps == {0: 1, 1: 1}
    assert plan.diverged == set()
    assert plan.calls == 1


def test_propose_rows_counts_steps_per_request_and_divergence():
    plan, (prompts, refs) = _plan(rate=1.0)
    tok, n = _batch([prompts[0] + refs[0][:2]])
    first = scripted.propose_rows(plan, 4, [[1]], n, tok)
    assert first == [refs[0][2:6]]
    tok, n = _batch([prompts[0] + refs[0][:6]])
    second = scripted.propose_rows(plan, 4, [[1]], n, tok)
    assert second == [refs[0][6:10]]
    assert plan.steps[0] == 2
    assert plan.intended == plan.proposed == 8
    # the newest token is off the reference: the row is marked diverged
    tok, n = _batch([prompts[0] + refs[0][:6] + [4999]])
    scripted.propose_rows(plan, 4, [[1]], n, tok)
    assert plan.diverged == {0}


def test_propose_rows_without_plan_or_sample_or_reference_left():
    plan, (prompts, refs) = _plan(rate=1.0)
    tok, n = _batch([prompts[0] + refs[0][:1]])
    assert scripted.propose_rows(None, 4, [[1]], n, tok) == [[]]
    assert scripted.propose_rows(plan, 4, [[]], n, tok) == [[]]
    tok, n = _batch([prompts[0] + refs[0][:38]])
    # only one reference token left after the newest
    assert scripted.propose_rows(plan, 4, [[1]], n, tok) == [refs[0][38:]]


def test_make_plan_needs_distinct_heads():
    with pytest.raises(ValueError):
        scripted.make_plan([[1] * 9, [1] * 10], [[2], [3]], 0.7, 4, 0, 100)
    with pytest.raises(ValueError):
        scripted.make_plan([[1, 2, 3]], [[2]], 0.7, 4, 0, 100)


def test_rate_proposer_uses_the_active_plan():
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4))
    prop = scripted.RateProposer(cfg)
    assert prop in scripted.INSTANCES
    plan, (prompts, refs) = _plan(rate=1.0)
    tok, n = _batch([prompts[1] + refs[1][:1]])
    try:
        scripted.activate(None)
        assert prop.propose([[1]], n, tok) == [[]]
        scripted.activate(plan)
        assert prop.propose([[1]], n, tok, slot_mappings=None) == [refs[1][1:5]]
    finally:
        scripted.activate(None)
        scripted.INSTANCES.remove(prop)


# --- step records ------------------------------------------------------------


def _new(rid, plen):
    return SimpleNamespace(req_id=rid, prompt_token_ids=list(range(plen)))


def _sched(n_sched, new=(), cached=(), spec=None):
    """cached: [(rid, num_computed_tokens)]"""
    return SimpleNamespace(
        num_scheduled_tokens=dict(n_sched),
        total_num_scheduled_tokens=sum(n_sched.values()),
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            num_computed_tokens=[c[1] for c in cached],
        ),
        scheduled_spec_decode_tokens=spec or {},
    )


def _outs(*items):
    """items: (rid, n_new, finished)"""
    return SimpleNamespace(
        outputs=[
            SimpleNamespace(
                request_id=rid,
                new_token_ids=[1] * n,
                finish_reason="length" if fin else None,
            )
            for rid, n, fin in items
        ]
    )


def test_step_record_classifies_prefill_mixed_and_decode():
    lens: dict[str, int] = {}
    # step 1: both prompts start; b is chunked
    r1 = step_record(
        0.05, _sched({"a": 100, "b": 60}, new=[_new("a", 100), _new("b", 200)]),
        _outs(("a", 1, False)), lens,
    )  # fmt: skip
    assert (r1.rows, r1.prefill_rows, r1.tokens, r1.decode) == (2, 2, 160, False)
    assert lens == {"a": 100, "b": 200}
    # step 2: a decodes with 4 drafts, b's last chunk: mixed
    r2 = step_record(
        0.04, _sched({"a": 5, "b": 140}, cached=[("a", 100), ("b", 60)],
                     spec={"a": [1, 2, 3, 4]}),
        _outs(("a", 3, False), ("b", 1, False)), lens,
    )  # fmt: skip
    assert (r2.prefill_rows, r2.decode, r2.drafts) == (1, False, 4)
    assert (r2.live_drafts, r2.accepted, r2.out_tokens) == (4, 2, 4)
    # step 3: pure decode, a finishes (its acceptance is not counted)
    r3 = step_record(
        0.01, _sched({"a": 5, "b": 5}, cached=[("a", 103), ("b", 200)],
                     spec={"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}),
        _outs(("a", 2, True), ("b", 5, False)), lens,
    )  # fmt: skip
    assert (r3.prefill_rows, r3.decode, r3.finished) == (0, True, 1)
    assert (r3.drafts, r3.live_drafts, r3.accepted) == (8, 4, 4)


def test_step_record_counts_placeholders_as_no_drafts():
    """A step whose drafts were padded with placeholders (-1, the fork's
    uniform_draft_padding) counts only the real drafts; the rows are still
    decodes of 1 + k scheduled tokens."""
    lens: dict[str, int] = {}
    rec = step_record(
        0.01, _sched({"a": 5, "b": 5}, cached=[("a", 500), ("b", 500)],
                     spec={"a": [1, 2, -1, -1], "b": [-1, -1, -1, -1]}),
        _outs(("a", 2, False), ("b", 1, False)), lens,
    )  # fmt: skip
    assert (rec.decode, rec.tokens, rec.drafts) == (True, 10, 2)
    assert (rec.live_drafts, rec.accepted, rec.out_tokens) == (2, 1, 3)


def test_step_record_without_known_prompt_uses_token_counts():
    lens: dict[str, int] = {}
    dec = step_record(0.01, _sched({"x": 3}, cached=[("x", 500)], spec={"x": [1, 2]}),
                      _outs(("x", 1, False)), lens)  # fmt: skip
    assert dec.decode
    chunk = step_record(0.01, _sched({"x": 64}, cached=[("x", 500)]), _outs(), lens)
    assert not chunk.decode
    empty = step_record(0.0, _sched({}), None, lens)
    assert not empty.decode and empty.rows == 0


def _rec(ms, rows, prefill=0, drafts=0, out=None, live=0, acc=0, fin=0):
    return StepRecord(ms / 1e3, rows, prefill, rows + drafts, drafts,
                      rows if out is None else out, live, acc, fin)  # fmt: skip


def test_summarize_excludes_prefill_and_uses_full_batch_steps():
    recs = [
        _rec(300.0, 4, prefill=4),  # prefill
        _rec(200.0, 4, prefill=1),  # mixed
        _rec(10.0, 4),
        _rec(12.0, 4),
        _rec(11.0, 4),
        _rec(5.0, 2),  # tail: fewer rows than the batch
    ]
    s = summarize(recs, bs=4)
    assert (s["steps_total"], s["prefill_steps"], s["decode_steps"]) == (6, 2, 4)
    assert s["full_batch_decode_steps"] == 3
    assert s["latency_basis"] == "full_batch"
    assert s["median_ms"] == pytest.approx(11.0)
    assert s["mean_ms"] == pytest.approx(11.0)
    assert (s["min_ms"], s["max_ms"]) == (pytest.approx(10.0), pytest.approx(12.0))
    assert s["p10_ms"] == pytest.approx(10.2)
    # throughput over all decode steps, tail included
    assert s["decode_tokens"] == 14
    assert s["tokens_per_s"] == pytest.approx(14 / 0.038)
    assert s["acceptance"] is None and s["drafts_scheduled"] == 0


def test_summarize_acceptance_and_fallback_basis():
    recs = [
        _rec(50.0, 2, prefill=2),
        _rec(20.0, 1, drafts=4, out=4, live=4, acc=3),
        _rec(22.0, 1, drafts=4, out=2, live=4, acc=1),
        _rec(21.0, 1, drafts=4, out=3, live=0, acc=0, fin=1),
    ]
    s = summarize(recs, bs=2)  # no full-batch decode step: all decode steps
    assert s["latency_basis"] == "decode"
    assert s["median_ms"] == pytest.approx(21.0)
    assert s["drafts_scheduled"] == 12 and s["drafts_verified"] == 8
    assert s["acceptance"] == pytest.approx(0.5)
    assert s["tokens_per_step"] == pytest.approx(3.0)


def test_summarize_without_decode_steps():
    s = summarize([_rec(100.0, 3, prefill=3)], bs=3)
    assert s["median_ms"] is None and s["decode_steps"] == 0
    assert s["tokens_per_s"] is None


def test_compact_steps():
    assert dl.compact_steps([_rec(1.23456, 2, drafts=1, acc=1)]) == [
        [1.2346, 2, 0, 1, 1, 2]
    ]


# --- the step meter on a fake in-process engine -------------------------------


class InprocClient:  # the name is what StepMeter checks
    def __init__(self, core):
        self.engine_core = core

    def get_output(self):
        so = self.engine_core.scheduler.schedule(False)
        return _outs(*[(rid, 1, False) for rid in so.num_scheduled_tokens])


def test_step_meter_records_only_while_started():
    steps = iter(
        [
            _sched({"a": 10}, new=[_new("a", 10)]),
            _sched({"a": 1}, cached=[("a", 10)]),
            _sched({"b": 10}, new=[_new("b", 10)]),
            _sched({"b": 1}, cached=[("b", 10)]),
        ]
    )
    core = SimpleNamespace(
        scheduler=SimpleNamespace(schedule=lambda *_a, **_k: next(steps))
    )
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=InprocClient(core)))
    meter = dl.StepMeter(llm)
    client = llm.llm_engine.engine_core
    client.get_output()  # not recorded
    client.get_output()
    meter.start()
    client.get_output()
    client.get_output()
    recs = meter.stop()
    assert [r.decode for r in recs] == [False, True]
    assert all(r.dt >= 0 for r in recs)
    assert meter.records is None


def test_step_meter_needs_the_inproc_client():
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=object()))
    with pytest.raises(RuntimeError, match="in-process"):
        dl.StepMeter(llm)


# --- arguments, engine config, prompts, model files ---------------------------


def test_parse_args_defaults_and_engine_kwargs():
    a = dl.parse_args(["--mode", "none", "--out", "x.json"])
    assert a.batch_sizes == [1, 8, 32, 64] and a.tokens == 128
    assert dl.sampling_kind(a) == "random" and dl.spec_config(a) is None
    kw = dl.engine_kwargs(a, "/m")
    assert kw["load_format"] == "dummy" and kw["attention_backend"] == "FLASH_ATTN"
    assert kw["language_model_only"] is True
    assert kw["limit_mm_per_prompt"] == {"image": 0, "video": 0}
    assert kw["gdn_prefill_backend"] == "triton"
    assert kw["enforce_eager"] is False and "compilation_config" not in kw
    assert kw["max_num_seqs"] == 64 and kw["gpu_memory_utilization"] == 0.85
    assert "speculative_config" not in kw


def test_parse_args_spec_modes():
    a = dl.parse_args(
        ["--mode", "ngram_nomatch", "--out", "x", "--ngram-k", "5",
         "--attention-backend", "TRITON_ATTN", "--eager", "--batch-sizes", "2,4"]
    )  # fmt: skip
    assert dl.spec_config(a) == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 10,
    }
    assert dl.sampling_kind(a) == "random"
    kw = dl.engine_kwargs(a, "/m")
    assert kw["enforce_eager"] and kw["attention_backend"] == "TRITON_ATTN"
    assert a.batch_sizes == [2, 4]
    s = dl.parse_args(["--mode", "scripted70", "--out", "x", "--capture-sizes", "8,1"])
    assert dl.sampling_kind(s) == "greedy"
    assert dl.spec_config(s) == {
        "method": "custom_class",
        "model": "benchmarks.scripted.RateProposer",
        "num_speculative_tokens": 4,
    }
    assert dl.engine_kwargs(s, "/m")["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 8]
    }


def test_fixed_fusion_keeps_combo_kernels_and_stops_their_timing():
    """--fixed-fusion: horizontal fusion stays on, chosen without timing
    (vLLM sets both inductor keys only where neither is given), beside the
    capture sizes; an eager engine compiles nothing and takes neither."""
    fixed = {"combo_kernels": True, "benchmark_combo_kernel": False}
    a = dl.parse_args(["--mode", "mtp", "--out", "x", "--fixed-fusion"])
    assert dl.engine_kwargs(a, "/m")["compilation_config"] == {
        "inductor_compile_config": fixed
    }
    a = dl.parse_args(
        ["--mode", "mtp", "--out", "x", "--fixed-fusion", "--capture-sizes", "4,1"]
    )
    assert dl.engine_kwargs(a, "/m")["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 4],
        "inductor_compile_config": fixed,
    }
    a = dl.parse_args(["--mode", "mtp", "--out", "x", "--fixed-fusion", "--eager"])
    assert "compilation_config" not in dl.engine_kwargs(a, "/m")


@pytest.mark.parametrize(
    "argv",
    [
        ["--mode", "none", "--out", "x", "--batch-sizes", "128"],
        ["--mode", "none", "--out", "x", "--batch-sizes", "0"],
        ["--mode", "none", "--out", "x", "--batch-sizes", "a"],
        ["--mode", "scripted70", "--out", "x", "--sampling", "random"],
        ["--mode", "scripted70", "--out", "x", "--ref-iters", "0"],
        ["--mode", "scripted70", "--out", "x", "--scripted-k", "33"],
        ["--mode", "scripted70", "--out", "x", "--accept-rate", "1.2"],
        ["--mode", "ngram_nomatch", "--out", "x", "--prompt-lookup-min", "11"],
        ["--mode", "none", "--out", "x", "--max-model-len", "512"],
        ["--mode", "none", "--out", "x", "--prompt-len", "600,300"],
        ["--mode", "bogus", "--out", "x"],
        ["--mode", "none"],
        ["--mode", "none", "--out", "x", "--uniform-draft-padding"],
        ["--mode", "mtp", "--out", "x", "--uniform-draft-padding"],
    ],
)
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        dl.parse_args(argv)


def test_uniform_draft_padding_joins_the_speculative_config():
    """--uniform-draft-padding: the fork's option in the speculative config of
    the scripted and n-gram modes, and nowhere else; recorded in the JSON."""
    for mode in ("scripted70", "ngram_nomatch"):
        a = dl.parse_args(["--mode", mode, "--out", "x", "--uniform-draft-padding"])
        spec = dl.engine_kwargs(a, "/m")["speculative_config"]
        assert spec == {**dl.spec_config(a), "uniform_draft_padding": True}
        plain = dl.parse_args(["--mode", mode, "--out", "x"])
        assert (
            "uniform_draft_padding"
            not in dl.engine_kwargs(plain, "/m")["speculative_config"]
        )


def test_make_prompts_distinct_tokens():
    ps = dl.make_prompts(64, 256, 512, seed=3)
    assert len(ps) == 64 and all(256 <= len(p) <= 512 for p in ps)
    flat = [t for p in ps for t in p]
    assert len(flat) == len(set(flat))  # no token, so no n-gram, recurs
    assert min(flat) >= dl.PROMPT_LO and max(flat) < dl.PROMPT_HI
    assert max(flat) < min(dl.SPECIALS)
    assert dl.make_prompts(64, 256, 512, seed=3) == ps
    assert dl.make_prompts(64, 256, 512, seed=4) != ps
    assert len({tuple(p[:8]) for p in ps}) == 64
    assert dl.prompt_seed(0, 8, 1) != dl.prompt_seed(0, 8, 2)


def test_model_dir_is_the_9b_shape_with_a_full_vocab_tokenizer(tmp_path):
    d = dl.write_model_dir(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    text = cfg["text_config"]
    assert (text["hidden_size"], text["num_hidden_layers"]) == (4096, 32)
    assert text["layer_types"].count("full_attention") == 8
    assert text["vocab_size"] == dl.model_vocab() == 248320
    tok = json.loads((d / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == 248320
    assert tok["model"]["vocab"]["<|endoftext|>"] == dl.EOS_ID
    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    dl.write_model_dir(tmp_path / "m")  # idempotent: nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == mtimes
    import tokenizers

    t = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    assert t.get_vocab_size() == 248320
    assert t.decode([5, 6]) == "t5 t6"


def test_write_json_is_atomic(tmp_path):
    p = tmp_path / "a" / "b.json"
    dl.write_json(p, {"x": 1})
    dl.write_json(p, {"x": 2})
    assert json.loads(p.read_text()) == {"x": 2}
    assert [f.name for f in p.parent.iterdir()] == ["b.json"]


# --- ratio report -------------------------------------------------------------


def _result(bs, median, tps=1000.0, acc=None, drafts=0):
    return {
        "bs": bs,
        "median_ms": median,
        "mean_ms": median * 1.01,
        "p10_ms": median * 0.99,
        "p90_ms": median * 1.02,
        "tokens_per_s": tps,
        "acceptance": acc,
        "drafts_scheduled": drafts,
        "decode_steps": 128,
        "full_batch_decode_steps": 128,
        "prefill_steps": 1,
    }


def _doc(mode, variant, results, repeat=0):
    return {
        "schema": dl.SCHEMA,
        "mode": mode,
        "variant": variant,
        "repeat": repeat,
        "status": "ok",
        "device": "FAKE GPU",
        "vllm_version": "0.26.0",
        "fork_patches": variant == "fork",
        "started": "2026-11-21T00:00:00+00:00",
        "engine_start_s": 90.0,
        "config": {
            "engine": {
                "attention_backend": "FLASH_ATTN",
                "enforce_eager": False,
                "speculative_config": {"method": "ngram"}
                if mode == "ngram_nomatch"
                else None,
            },
            "sampling": "random",
            "tokens": 128,
            "prompt_len": [256, 512],
            "rounds": 1,
        },  # fmt: skip
        "results": results,
        "skipped_batch_sizes": [],
    }


def _docs():
    return [
        _doc("none", "fork", [_result(1, 10.05), _result(8, 12.0)]),
        _doc("none", "upstream", [_result(1, 10.0), _result(8, 12.0)]),
        _doc("ngram_nomatch", "fork", [_result(1, 10.2), _result(8, 12.0)]),
        _doc(
            "ngram_nomatch", "upstream", [_result(1, 10.0), _result(8, 12.0, drafts=3)]
        ),
        _doc("scripted70", "upstream", [_result(1, 14.0, 2000.0, 0.69)]),
        _doc("scripted70", "fork", [_result(1, 14.7, 1900.0, 0.71)]),
    ]


def test_ratio_rows_and_verdicts():
    rows = {(r["mode"], r["bs"]): r for r in plot.ratio_rows(_docs())}
    assert list(rows) == [("none", 1), ("none", 8), ("ngram_nomatch", 1),
                          ("ngram_nomatch", 8), ("scripted70", 1)]  # fmt: skip
    assert rows["none", 1]["ratio"] == pytest.approx(1.005)
    assert rows["none", 1]["verdict"] == "pass"
    assert rows["ngram_nomatch", 1]["verdict"] == "FAIL"
    assert rows["ngram_nomatch", 8]["verdict"] == "invalid (ngram matched)"
    s = rows["scripted70", 1]
    assert s["verdict"] == "report"
    assert s["ratio"] == pytest.approx(1.05)
    assert s["tokens_per_s_ratio"] == pytest.approx(0.95)
    assert s["fork"]["acceptance"] == pytest.approx(0.71)


def test_ratio_rows_average_repeats_and_flag_incomplete():
    docs = [
        _doc("none", "fork", [_result(1, 10.0)], repeat=0),
        _doc("none", "fork", [_result(1, 10.4)], repeat=1),
        _doc("none", "upstream", [_result(1, 10.1)], repeat=0),
        _doc("none", "upstream", [_result(1, 10.3)], repeat=1),
        _doc("ngram_nomatch", "fork", [_result(8, 10.0)]),
    ]
    rows = plot.ratio_rows(docs)
    assert rows[0]["fork"]["repeats"] == 2
    assert rows[0]["ratio"] == pytest.approx(10.2 / 10.2)
    assert rows[1]["verdict"] == "incomplete" and rows[1]["ratio"] is None


def test_pair_rows_keep_each_abba_pair_and_the_same_code_shift(tmp_path):
    """Averaging the repeats first hides a whole run's shift; the pairs
    table keeps each pair's own ratio and each variant's run-to-run shift."""
    docs = [
        _doc("mtp", "fork", [_result(8, 11.0)], repeat=0),
        _doc("mtp", "upstream", [_result(8, 10.0)], repeat=0),
        _doc("mtp", "upstream", [_result(8, 12.0)], repeat=1),
        _doc("mtp", "fork", [_result(8, 12.0)], repeat=1),
        _doc("mtp", "fork", [_result(8, 11.0)], repeat=2),  # partner missing
        _doc("none", "fork", [_result(1, 10.0)]),  # one repeat: no pairs row
        _doc("none", "upstream", [_result(1, 10.0)]),
    ]
    (row,) = plot.pair_rows(docs)
    assert (row["mode"], row["bs"]) == ("mtp", 8)
    assert row["pair_ratios"] == pytest.approx([1.1, 1.0])
    assert row["median"] == pytest.approx(1.05)
    assert (row["low"], row["high"]) == (pytest.approx(1.0), pytest.approx(1.1))
    assert row["shift"]["upstream"] == pytest.approx(1.2)
    assert row["shift"]["fork"] == pytest.approx(12.0 / 11.0)
    for i, d in enumerate(docs):
        (tmp_path / f"d{i}.json").write_text(json.dumps(d))
    paths = plot.write_report([tmp_path], tmp_path / "rep", "p")
    md = paths["md"].read_text()
    assert "## ABBA pairs" in md
    assert "| mtp | 8 | 1.100, 1.000 | 1.050 | 1.000 – 1.100 | 1.091 | 1.200 |" in md
    got = json.loads(paths["json"].read_text())["pairs"][0]
    assert got["median"] == pytest.approx(1.05)
    # one run per side: no pairs table
    one = plot.write_report([tmp_path / "d5.json", tmp_path / "d6.json"],
                            tmp_path / "rep1", "q")  # fmt: skip
    assert "ABBA pairs" not in one["md"].read_text()


def test_ratio_ci_is_over_the_steps_behind_the_medians():
    """The 95 % interval of the ratio resamples the full-batch decode steps
    (prefill and partial-batch steps are not samples): a fork 10 % slower
    has an interval above 1 holding 1.1, equal sides one holding 1."""
    import random

    rng = random.Random(0)

    def res(bs, center, n=200):
        steps = [[center + rng.gauss(0, 0.3), bs, 0, 0, 0, bs] for _ in range(n)]
        steps.append([99.0, bs, 3, 0, 0, 0])  # a step with prefill rows
        steps.append([50.0, bs - 1, 0, 0, 0, bs - 1])  # a partial batch
        return {"bs": bs, "median_ms": center, "mean_ms": center, "steps": steps}

    samples = plot.step_samples(res(8, 10.0))
    assert len(samples) == 200 and max(samples) < 20
    lo, hi = plot.ratio_ci(plot.step_samples(res(8, 11.0)),
                           plot.step_samples(res(8, 10.0)))  # fmt: skip
    assert 1.0 < lo < 1.1 < hi
    lo, hi = plot.ratio_ci(samples, plot.step_samples(res(8, 10.0)))
    assert lo < 1.0 < hi
    rows = plot.ratio_rows([_doc("none", "fork", [res(8, 11.0)]),
                            _doc("none", "upstream", [res(8, 10.0)])])  # fmt: skip
    assert rows[0]["ratio_ci95"][0] > 1.0
    line = next(x for x in plot.markdown([], rows, "r", 1.01).splitlines()
                if x.startswith("| none | 8 |"))  # fmt: skip
    lo, hi = rows[0]["ratio_ci95"]
    assert line.split("|")[6].strip() == f"{lo:.3f} – {hi:.3f}"
    assert plot.ratio_ci([1.0] * 5, [1.0] * 5) is None


def test_write_report_from_json_files(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for d in _docs():
        (src / f"{d['mode']}-{d['variant']}-r0.json").write_text(json.dumps(d))
    (src / "unrelated.json").write_text('{"x": 1}')
    (src / "broken.json").write_text("{")
    paths = plot.write_report([src], tmp_path / "rep", "t1", copy_raw=True)
    md = paths["md"].read_text()
    assert "| none | 1 | 10.050 | 10.000 | 1.0050 |" in md
    assert "**none**: largest ratio 1.0050 at BS 1; all within 1.01." in md
    assert "**ngram_nomatch**: largest ratio 1.0200 at BS 1; NOT all within" in md
    assert "FAKE GPU" in md
    data = json.loads(paths["json"].read_text())
    assert len(data["rows"]) == 5
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list((tmp_path / "rep" / "t1").glob("*.json"))) == 6
    assert plot.main([str(src), "--out", str(tmp_path / "rep2"), "--run", "t2"]) == 0
    assert (tmp_path / "rep2" / "t2.md").exists()
    assert plot.main([str(tmp_path / "nothing"), "--run", "t3"]) == 1


def test_report_handles_errors_and_partial_docs():
    err = _doc("none", "fork", [])
    err.update(status="error", error="RuntimeError: boom\n")
    md = plot.markdown([err], plot.ratio_rows([err]), "r", 1.01)
    assert "error: RuntimeError: boom" in md


# --- side-by-side driver -------------------------------------------------------


def test_side_by_side_args_and_plan():
    a = sbs.parse_args(["--modes", "none,scripted70", "--repeats", "2", "--",
                        "--tokens", "64", "--eager"])  # fmt: skip
    assert a.modes == ["none", "scripted70"] and a.extra == [
        "--tokens",
        "64",
        "--eager",
    ]
    with pytest.raises(SystemExit):
        sbs.parse_args(["--modes", "fast"])
    p = sbs.plan(["none", "ngram_nomatch"], ["fork", "upstream"], 2)
    assert p == [
        ("none", 0, ["fork", "upstream"]),
        ("none", 1, ["upstream", "fork"]),
        ("ngram_nomatch", 0, ["upstream", "fork"]),
        ("ngram_nomatch", 1, ["fork", "upstream"]),
    ]


def test_variant_pythonpath():
    pp = "/tmp/hybridspec/site:/tmp/hybridspec/deps:/tmp/hybridspec/repo"
    fork = sbs.variant_pythonpath(pp, "fork", "/r", "/tmp/hybridspec/site/", "/u")
    assert fork == "/r:/tmp/hybridspec/site:/tmp/hybridspec/deps:/tmp/hybridspec/repo"
    up = sbs.variant_pythonpath(pp + ":/r", "upstream", "/r", "/tmp/hybridspec/site",
                                "/tmp/upstream-site")  # fmt: skip
    assert up == "/r:/tmp/upstream-site:/tmp/hybridspec/deps:/tmp/hybridspec/repo"
    with pytest.raises(sbs.BenchError, match="env.sh"):
        sbs.variant_pythonpath("/x", "fork", "/r", "/tmp/hybridspec/site", "/u")
    env = sbs.child_env({"A": "1"}, up)
    assert env["PYTHONPATH"] == up and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


UPSTREAM_UTILS = "import torch\n\n\ndef other():\n    return 1\n"
FORK_UTILS = (
    "import numpy as np\nimport torch\n\n\ndef mark_zero_draft_decodes(x):\n"
    "    return x\n\n\ndef other():\n    return 1\n"
)


def _git_patch(path: str, old: str, new: str) -> str:
    diff = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=f"a/{path}",
        tofile=f"b/{path}",
    )
    return f"diff --git a/{path} b/{path}\n" + "".join(diff)


def _sites(tmp_path):
    site = tmp_path / "site"
    (site / "vllm/v1/spec_decode").mkdir(parents=True)
    (site / "vllm/v1/spec_decode/utils.py").write_text(FORK_UTILS)
    (site / "vllm/other.py").write_text("X = 2\n")
    patches = tmp_path / "patches"
    patches.mkdir()
    p1 = _git_patch("vllm/v1/spec_decode/utils.py", UPSTREAM_UTILS, FORK_UTILS)
    p1 += _git_patch("tests/test_new.py", "", "def test():\n    pass\n")
    (patches / "0001-a.patch").write_text(p1)
    (patches / "0002-b.patch").write_text(
        _git_patch("vllm/other.py", "X = 1\n", "X = 2\n")
    )
    (patches / "series").write_text("0001-a.patch\n0002-b.patch\n")
    return site, patches


def test_series_and_vllm_sections(tmp_path):
    _, patches = _sites(tmp_path)
    names = [p.name for p in sbs.series(patches)]
    assert names == ["0001-a.patch", "0002-b.patch"]
    text = sbs.vllm_sections((patches / "0001-a.patch").read_text())
    assert "vllm/v1/spec_decode/utils.py" in text and "tests/" not in text


def test_ensure_upstream_site_reverses_the_series(tmp_path):
    site, patches = _sites(tmp_path)
    up = tmp_path / "upstream-site"
    assert sbs.ensure_upstream_site(str(site), str(up), sbs.series(patches)) == "made"
    assert (up / "vllm/v1/spec_decode/utils.py").read_text() == UPSTREAM_UTILS
    assert (up / "vllm/other.py").read_text() == "X = 1\n"
    assert sbs.has_fingerprint(site) and not sbs.has_fingerprint(up)
    assert (site / "vllm/other.py").read_text() == "X = 2\n"  # fork untouched
    assert sbs.ensure_upstream_site(str(site), str(up), sbs.series(patches)) == "reused"
    # a changed series makes it again
    (patches / "0002-b.patch").write_text(
        _git_patch("vllm/other.py", "X = 3\n", "X = 2\n")
    )
    assert sbs.ensure_upstream_site(str(site), str(up), sbs.series(patches)) == "made"
    assert (up / "vllm/other.py").read_text() == "X = 3\n"


def test_ensure_upstream_site_errors(tmp_path):
    site, patches = _sites(tmp_path)
    with pytest.raises(sbs.BenchError, match="no patches"):
        sbs.ensure_upstream_site(str(site), str(tmp_path / "u"), [])
    (site / "vllm/v1/spec_decode/utils.py").write_text(UPSTREAM_UTILS)
    with pytest.raises(sbs.BenchError, match="lacks"):
        sbs.ensure_upstream_site(str(site), str(tmp_path / "u"), sbs.series(patches))
    (site / "vllm/v1/spec_decode/utils.py").write_text(FORK_UTILS + "# drift\n")
    (site / "vllm/other.py").write_text("X = 5\n")
    with pytest.raises(sbs.BenchError, match="failed"):
        sbs.ensure_upstream_site(str(site), str(tmp_path / "u"), sbs.series(patches))


def test_check_variant():
    assert sbs.check_variant(None, "fork") is None
    assert sbs.check_variant({"fork_patches": None}, "fork") is None
    assert sbs.check_variant({"fork_patches": True}, "fork") is None
    assert sbs.check_variant({"fork_patches": False}, "upstream") is None
    assert "upstream run" in sbs.check_variant({"fork_patches": True}, "upstream")


FAKE_BENCH = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
assert args[:2] == ["-m", "benchmarks.decode_latency"], args
opt = dict(zip(args[2::2], args[3::2]))
variant, mode = opt["--variant"], opt["--mode"]
site = "upstream" if "upstream-site" in os.environ["PYTHONPATH"] else "fork"
assert site == variant, (site, variant)
assert os.environ["PYTHONPATH"].split(":")[0] == {repo!r}
base = {{"none": 10.0, "ngram_nomatch": 10.0, "scripted70": 14.0}}[mode]
slow = 1.005 if variant == "fork" else 1.0
res = [dict(bs=bs, median_ms=base * slow * (1 + bs / 64), mean_ms=base,
            tokens_per_s=1000.0, acceptance=0.7 if mode == "scripted70" else None,
            drafts_scheduled=0) for bs in (1, 8)]
doc = dict(schema="hsfork-decode-latency/1", mode=mode, variant=variant,
           repeat=int(opt["--repeat"]), status="ok", fork_patches=variant == "fork",
           results=res, config={{}}, extra=args)
json.dump(doc, open(opt["--out"], "w"))
print("fake", variant, mode, flush=True)
"""


def test_side_by_side_main_with_a_fake_benchmark(tmp_path, monkeypatch, capsys):
    site, patches = _sites(tmp_path)
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_BENCH.format(python=sys.executable, repo=str(sbs.REPO)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}/deps")
    out = tmp_path / "out"
    argv = [
        "--modes", "none,ngram_nomatch", "--out", str(out), "--run", "r",
        "--fork-site", str(site), "--upstream-site", str(tmp_path / "upstream-site"),
        "--patches", str(patches), "--python", str(fake), "--deadline", "0",
        "--engine-estimate", "5", "--", "--tokens", "64",
    ]  # fmt: skip
    assert sbs.main(argv) == 0
    got = sorted(p.name for p in out.glob("*.json"))
    assert got == ["ngram_nomatch-fork-r0.json", "ngram_nomatch-upstream-r0.json",
                   "none-fork-r0.json", "none-upstream-r0.json", "r.json"]  # fmt: skip
    doc = json.loads((out / "none-fork-r0.json").read_text())
    assert doc["extra"][-2:] == ["--tokens", "64"]
    assert "--deadline" in doc["extra"]
    md = (out / "r.md").read_text()
    assert "| none | 1 | 10.207 | 10.156 | 1.0050 |" in md
    assert (out / "r.png").exists()
    assert (out / "logs" / "none-upstream-r0.log").read_text().startswith("fake")
    text = capsys.readouterr().out
    assert "start none-fork-r0" in text and "start none-upstream-r0" in text
    order = [ln.split()[-3] for ln in text.splitlines() if "] start " in ln]
    assert order == ["none-fork-r0", "none-upstream-r0", "ngram_nomatch-upstream-r0",
                     "ngram_nomatch-fork-r0"]  # fmt: skip


def test_side_by_side_skips_pairs_past_the_deadline(tmp_path, monkeypatch, capsys):
    site, patches = _sites(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(site))
    argv = [
        "--modes", "none", "--out", str(tmp_path / "out"), "--fork-site", str(site),
        "--upstream-site", str(tmp_path / "up"), "--patches", str(patches),
        "--deadline", "100", "--engine-estimate", "60", "--python", "/nonexistent",
    ]  # fmt: skip
    assert sbs.main(argv) == 0
    assert "skip none repeat 0" in capsys.readouterr().out


def test_run_estimate_takes_a_modes_latest_run_not_its_cold_first():
    # a first run that compiled (268 s), then one that read the cache (81 s)
    walls: dict[str, float] = {}
    assert sbs.run_estimate(walls, "mtp", 300.0) == 300.0
    walls["mtp"] = 268.0
    assert sbs.run_estimate(walls, "mtp", 300.0) == 268.0
    walls["mtp"] = 81.0
    assert sbs.run_estimate(walls, "mtp", 300.0) == 81.0
    # a mode not run yet may compile: the longest latest run seen
    walls["none"] = 120.0
    assert sbs.run_estimate(walls, "scripted70", 300.0) == 120.0


def test_side_by_side_stops_on_a_wrong_install(tmp_path, monkeypatch):
    site, patches = _sites(tmp_path)
    fake = tmp_path / "fake-python"
    fake.write_text(
        FAKE_BENCH.format(python=sys.executable, repo=str(sbs.REPO)).replace(
            'fork_patches=variant == "fork"', "fork_patches=True"
        )
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PYTHONPATH", str(site))
    argv = [
        "--modes", "none", "--out", str(tmp_path / "out"), "--fork-site", str(site),
        "--upstream-site", str(tmp_path / "upstream-site"), "--patches", str(patches),
        "--python", str(fake), "--deadline", "0", "--engine-estimate", "1",
    ]  # fmt: skip
    assert sbs.main(argv) == 2


def test_side_by_side_dry_run_and_missing_env(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert sbs.main(["--dry-run", "--out", str(tmp_path / "o")]) == 2
    assert "env.sh" in capsys.readouterr().out
    monkeypatch.setenv("PYTHONPATH", "/tmp/hybridspec/site")
    assert sbs.main(["--dry-run", "--out", str(tmp_path / "o")]) == 0
    assert "plan: scripted70 repeat 0: fork then upstream" in capsys.readouterr().out


def test_decode_latency_main_records_an_engine_failure(tmp_path, monkeypatch):
    """Without a GPU the engine cannot start: the JSON still says so."""
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "vllm" and args and args[2] and "LLM" in args[2]:
            raise RuntimeError("no engine here")
        return real_import(name, *args, **kwargs)

    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER",
                "VLLM_USE_FLASHINFER_SAMPLER", "HF_HUB_OFFLINE"):  # fmt: skip
        monkeypatch.setenv(var, "1")  # restored after the test
    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(dl, "install_info", lambda: {"fork_patches": None})
    out = tmp_path / "r.json"
    rc = dl.main(["--mode", "none", "--out", str(out), "--model-dir",
                  str(tmp_path / "m")])  # fmt: skip
    assert rc == 1
    doc = json.loads(out.read_text())
    assert doc["status"] == "error" and "no engine here" in doc["error"]
    assert doc["config"]["engine"]["model"] == str(tmp_path / "m")
    assert doc["mode"] == "none" and doc["results"] == []
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


# --- the measurement flow on a fake in-process engine --------------------------


def _truth(row: int, pos: int, offset: int) -> int:
    """The fake model's greedy token at output position ``pos`` of request
    ``row``; computed inside a verify chunk (offset > 0) some positions come
    out differently, like a bf16 near-tie that flips with the kernel path."""
    base = 3000 + (row * 7919 + pos * 104729) % 200000
    return base + 1 if (offset > 0 and pos % 11 == 5) else base


class FakeLLM:
    """Just enough of ``vllm.LLM`` (in-process) for ``measure_*``: one
    prefill step for all requests, then decode steps verifying the drafts of
    ``benchmarks.scripted`` (the active plan) against ``_truth``."""

    def __init__(self, k: int = 0, use_scripted: bool = False):
        self.k = k
        self.use_scripted = use_scripted
        self.pending = None
        meter_self = self

        class InprocClient:
            def __init__(self):
                self.engine_core = SimpleNamespace(
                    scheduler=SimpleNamespace(
                        schedule=lambda *a, **kw: None, max_num_running_reqs=64
                    )
                )

            def get_output(self):
                so = self.engine_core.scheduler.schedule(False)
                return meter_self._execute(so)

        self.llm_engine = SimpleNamespace(engine_core=InprocClient())
        self.client = self.llm_engine.engine_core
        self.client.engine_core.scheduler.schedule = self._schedule

    def _schedule(self, *_a, **_kw):
        reqs = self.reqs
        # the scheduler's admission limit: running requests first (they were
        # submitted first), new ones while there is room
        cap = self.client.engine_core.scheduler.max_num_running_reqs
        n_sched, spec, new, cached = {}, {}, [], []
        for rid, r in reqs.items():
            if r["done"]:
                continue
            if not r["out"] and len(n_sched) >= cap:
                continue
            if not r["out"]:
                n_sched[rid] = len(r["prompt"])
                new.append(_new(rid, len(r["prompt"])))
            else:
                n_sched[rid] = 1 + len(r["drafts"])
                if r["drafts"]:
                    spec[rid] = list(r["drafts"])
                cached.append((rid, len(r["prompt"]) + len(r["out"]) - 1))
        return _sched(n_sched, new=new, cached=cached, spec=spec)

    def _execute(self, so):
        outs = []
        for rid in so.num_scheduled_tokens:
            r = self.reqs[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            emitted = []
            for j in range(len(drafts) + 1):
                t = _truth(r["row"], len(r["out"]) + j, j)
                emitted.append(t)
                if j == len(drafts) or drafts[j] != t:
                    break
            room = r["max"] - len(r["out"])
            emitted = emitted[:room]
            r["out"] += emitted
            r["done"] = len(r["out"]) >= r["max"]
            outs.append(
                SimpleNamespace(
                    request_id=rid,
                    new_token_ids=emitted,
                    finish_reason="length" if r["done"] else None,
                )
            )
        live = [rid for rid in so.num_scheduled_tokens if not self.reqs[rid]["done"]]
        if self.use_scripted and live:
            rows = [self.reqs[rid]["prompt"] + self.reqs[rid]["out"] for rid in live]
            tok, n = _batch(rows, width=max(len(x) for x in rows))
            drafts = scripted.propose_rows(
                scripted.active(), self.k, [[1]] * len(live), n, tok
            )
            for rid, d in zip(live, drafts, strict=True):
                self.reqs[rid]["drafts"] = d
        return SimpleNamespace(outputs=outs)

    def generate(self, prompts, sp, use_tqdm=False):
        self.reqs = {
            str(i): {"row": i, "prompt": list(p["prompt_token_ids"]), "out": [],
                     "drafts": [], "max": sp.max_tokens, "done": False}
            for i, p in enumerate(prompts)
        }  # fmt: skip
        while not all(r["done"] for r in self.reqs.values()):
            self.llm_engine.engine_core.get_output()
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=r["out"])])
            for r in self.reqs.values()
        ]


def _args(mode, *extra):
    base = ["--out", "x", "--prompt-len", "16,24", "--tokens", "40"]
    return dl.parse_args(["--mode", mode, *base, "--warmup-tokens", "4", *extra])


def test_measure_plain_on_a_fake_engine():
    llm = FakeLLM()
    meter = dl.StepMeter(llm)
    a = _args("ngram_nomatch", "--rounds", "2")
    row = dl.measure_plain(llm, meter, a, bs=3)
    assert row["bs"] == 3 and row["sampling"] == "random"
    assert row["steps_total"] == 2 * 40  # two rounds: 1 prefill + 39 decode each
    assert (row["prefill_steps"], row["decode_steps"]) == (2, 78)
    assert row["full_batch_decode_steps"] == 78
    assert row["decode_tokens"] == 2 * 3 * 39
    assert row["out_len_ok"] and row["nomatch_ok"]
    assert row["drafts_scheduled"] == row["warmup_drafts_scheduled"] == 0
    assert len(row["steps"]) == 80 and row["median_ms"] >= 0


def test_measure_scripted_on_a_fake_engine():
    k = 4
    llm = FakeLLM(k=k, use_scripted=True)
    scripted.INSTANCES.append("placeholder")  # the engine made its proposer
    try:
        meter = dl.StepMeter(llm)
        a = _args("scripted70", "--rounds", "1", "--ref-iters", "6")
        row = dl.measure_scripted(llm, meter, a, bs=4)
    finally:
        scripted.INSTANCES.remove("placeholder")
    assert scripted.active() is None
    assert row["reference_pass_drafts"] == 0
    hist = row["reference_iterations"]
    assert hist[0]["mismatched_rows"] > 0  # the verify path flips some tokens
    assert row["reference_converged"] and hist[-1]["mismatched_rows"] == 0
    prop = row["proposer"][0]
    assert prop["mismatched_rows"] == 0 and prop["diverged_rows"] == 0
    # the measured acceptance is the scheduled one
    assert row["acceptance"] == pytest.approx(prop["intended_rate"], abs=0.05)
    assert 0.5 < row["acceptance"] < 0.9
    assert row["out_len_ok"] and row["drafts_scheduled"] > 0
    assert row["prefill_steps"] == 1 and row["tokens_per_step"] > 2.0


def test_refill_keeps_bs_requests_in_flight_and_restores_the_cap():
    from benchmarks import configs_report as cr

    llm = FakeLLM()
    meter = dl.StepMeter(llm)
    a = _args("none", "--rounds", "2", "--refill")
    row = dl.measure_plain(llm, meter, a, bs=3)
    # 6 requests, at most 3 running: 40 steps each wave (1 prefill + 39
    # decode), the second wave admitted when the first has finished
    steps = row["steps"]
    assert max(s[1] for s in steps) == 3 and len(steps) == 80
    assert row["in_flight_steps"] == 41
    assert row["decode_tokens"] == 6 * 39 and row["out_len_ok"]
    doc = {"schema": dl.SCHEMA, "mode": "none", "variant": "fork", "status": "ok",
           "config": {"engine": {}, "refill": True}, "results": [row]}  # fmt: skip
    md = cr.markdown(cr.rows([doc], None), [doc], None, "t")
    assert "refilled runs (`--refill`)" in md
    sched = llm.client.engine_core.scheduler
    assert sched.max_num_running_reqs == 64  # restored after the run
    # without the flag: 2 closed batches of 3, no in-flight figure
    row = dl.measure_plain(llm, meter, _args("none", "--rounds", "2"), bs=3)
    assert "in_flight_steps" not in row


def test_refill_with_scripted_drafts_admits_requests_beside_running_ones():
    k = 4
    llm = FakeLLM(k=k, use_scripted=True)
    scripted.INSTANCES.append("placeholder")
    try:
        meter = dl.StepMeter(llm)
        a = _args("scripted70", "--rounds", "2", "--ref-iters", "6", "--refill")
        row = dl.measure_scripted(llm, meter, a, bs=4)
    finally:
        scripted.INSTANCES.remove("placeholder")
    steps = row["steps"]
    assert max(s[1] for s in steps) == 4
    # rows accept differently and finish apart: a newcomer's prefill row
    # runs beside decode rows (a mixed step), which closed batches never do
    assert any(s[2] and s[1] > s[2] for s in steps)
    assert row["reference_converged"] and row["proposer"][0]["mismatched_rows"] == 0
    assert row["out_len_ok"] and len(row["proposer"]) == 1
    window = steps[: row["in_flight_steps"]]
    assert row["tokens_per_s"] == pytest.approx(
        sum(s[5] for s in window) * 1e3 / sum(s[0] for s in window), rel=0.02
    )


def test_measure_scripted_needs_the_proposer():
    with pytest.raises(RuntimeError, match="not instantiated"):
        dl.measure_scripted(FakeLLM(), None, _args("scripted70"), bs=1)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in ``vllm`` module whose LLM is :class:`FakeLLM`."""
    import types

    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER",
                "VLLM_USE_FLASHINFER_SAMPLER", "HF_HUB_OFFLINE"):  # fmt: skip
        monkeypatch.setenv(var, "1")  # restored after the test
    made: list[dict] = []

    def make_llm(**kw):
        made.append(kw)
        spec = kw.get("speculative_config") or {}
        k = spec.get("num_speculative_tokens", 0)
        custom = spec.get("method") == "custom_class"
        if custom:
            scripted.RateProposer(
                SimpleNamespace(
                    speculative_config=SimpleNamespace(num_speculative_tokens=k)
                )
            )
        return FakeLLM(k=k, use_scripted=custom)

    mod = types.ModuleType("vllm")
    mod.__version__ = "0.0-fake"
    mod.LLM = make_llm
    mod.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    mod.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    n_instances = len(scripted.INSTANCES)
    yield made
    del scripted.INSTANCES[n_instances:]
    scripted.activate(None)


@pytest.mark.parametrize("mode", dl.MODES)
def test_decode_latency_run_on_a_fake_vllm(mode, fake_vllm, tmp_path):
    out = tmp_path / f"{mode}.json"
    argv = ["--mode", mode, "--variant", "fork", "--out", str(out), "--model-dir",
            str(tmp_path / "m"), "--batch-sizes", "1,3", "--tokens", "24",
            "--prompt-len", "16,24", "--warmup-tokens", "4"]  # fmt: skip
    assert dl.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["status"] == "ok" and doc["schema"] == dl.SCHEMA
    assert doc["vllm_version"] == "0.0-fake" and doc["fork_patches"] is None
    assert [r["bs"] for r in doc["results"]] == [1, 3]
    for r in doc["results"]:
        assert r["out_len_ok"] and r["median_ms"] is not None
        assert r["full_batch_decode_steps"] > 0
    kw = fake_vllm[0]
    assert kw["model"] == str(tmp_path / "m") and kw["load_format"] == "dummy"
    if mode == "scripted70":
        r = doc["results"][-1]
        assert r["reference_converged"] and 0.4 < r["acceptance"] < 0.95
    else:
        assert all(r["drafts_scheduled"] == 0 for r in doc["results"])
    # a plot of one variant only: incomplete rows, still a report
    rows = plot.ratio_rows([doc])
    assert {r["verdict"] for r in rows} == {"incomplete"}


def test_decode_latency_deadline_skips_batch_sizes(fake_vllm, tmp_path):
    out = tmp_path / "d.json"
    argv = ["--mode", "none", "--out", str(out), "--model-dir", str(tmp_path / "m"),
            "--batch-sizes", "1,3", "--deadline", "0.001"]  # fmt: skip
    assert dl.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["status"] == "partial" and doc["skipped_batch_sizes"] == [1, 3]


def test_side_by_side_skips_the_partner_of_a_failed_process(tmp_path, monkeypatch):
    site, patches = _sites(tmp_path)
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(3)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PYTHONPATH", str(site))
    out = tmp_path / "out"
    argv = [
        "--modes", "none", "--out", str(out), "--fork-site", str(site),
        "--upstream-site", str(tmp_path / "upstream-site"), "--patches", str(patches),
        "--python", str(fake), "--deadline", "0", "--engine-estimate", "1",
    ]  # fmt: skip
    assert sbs.main(argv) == 1
    assert [p.name for p in (out / "logs").iterdir()] == ["none-fork-r0.log"]


def test_parse_args_mtp_runner_and_turboquant():
    a = dl.parse_args(["--mode", "mtp", "--out", "x", "--runner", "mrv2"])
    assert dl.spec_config(a) == {"method": "mtp", "num_speculative_tokens": 3}
    assert dl.sampling_kind(a) == "greedy" and a.label == "mtp" and a.runner == "mrv2"
    assert "kv_cache_dtype" not in dl.engine_kwargs(a, "/m")
    t = dl.parse_args(
        ["--mode", "mtp", "--out", "x", "--mtp-k", "1", "--label", "tq_fix",
         "--kv-cache-dtype", "turboquant_k8v4", "--tq-cudagraph", "downgrade"]
    )  # fmt: skip
    assert dl.spec_k(t) == 1 and t.label == "tq_fix"
    tkw = dl.engine_kwargs(t, "/m")
    assert tkw["kv_cache_dtype"] == "turboquant_k8v4" and "attention_backend" not in tkw
    for bad in (["--mtp-k", "0"], ["--tq-cudagraph", "downgrade"]):
        with pytest.raises(SystemExit):
            dl.parse_args(["--mode", "mtp", "--out", "x", *bad])


def test_decode_latency_label_names_the_mode_and_mrv2_sets_the_runner(
    fake_vllm, tmp_path
):
    out = tmp_path / "m.json"
    argv = ["--mode", "mtp", "--label", "mtp_mrv2", "--runner", "mrv2", "--out",
            str(out), "--model-dir", str(tmp_path / "m"), "--batch-sizes", "1",
            "--tokens", "8", "--prompt-len", "16,24",
            "--warmup-tokens", "2"]  # fmt: skip
    assert dl.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "mtp_mrv2" and doc["spec_mode"] == "mtp"
    assert doc["config"]["runner"] == "mrv2"
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert fake_vllm[0]["speculative_config"]["method"] == "mtp"
    assert "mtp_mrv2" in plot.GATED


def test_method_timer_times_counts_and_passes_through():
    from benchmarks import step_profile as sp

    class Obj:
        def f(self, x):
            return x == 1

    o, t = Obj(), sp.MethodTimer()
    assert t.wrap(o, "f", "obj", count_results=True)
    assert not t.wrap(o, "missing", "obj")
    assert o.f(1) is True and t.calls == {}  # off: not timed
    t.on = True
    assert [o.f(1), o.f(1), o.f(2)] == [True, True, False]
    s = t.summary(steps=3)["obj.f"]
    assert s["calls"] == 3 and s["results"] == {"True": 2, "False": 1}
    assert s["total_ms"] >= 0 and s["us_per_step"] == s["total_ms"] * 1e3 / 3
    t.reset()
    assert t.summary(steps=1) == {}


def test_step_profile_compare(tmp_path):
    from benchmarks import step_profile as sp

    paths = []
    for v, us in (("fork", 30.0), ("upstream", 20.0)):
        doc = {"variant": v, "results": [{"bs": 1, "median_ms": us / 10, "methods": {
            "runner.x": {"calls": 2, "total_ms": 1, "us_per_step": us,
                         "results": {"True": 2} if v == "fork" else {}}}}]}  # fmt: skip
        p = tmp_path / f"{v}.json"
        p.write_text(json.dumps(doc))
        paths.append(str(p))
    text = sp.compare(paths)
    assert "| runner.x µs/step | 30.0 | 20.0 |" in text
    assert "| median ms/step | 3.000 | 2.000 |" in text
    assert "runner.x returned: {'True': 2}" in text
    # one install profiled in two modes: a column each, not the last alone
    for mode, us in (("none", 1.0), ("scripted70", 8.0)):
        row = {"bs": 1, "median_ms": us, "methods": {"runner.x": {"us_per_step": us}}}
        doc = {"variant": "fork", "mode": mode, "results": [row]}
        (tmp_path / f"{mode}.json").write_text(json.dumps(doc))
    text = sp.compare([str(tmp_path / f"{m}.json") for m in ("none", "scripted70")])
    assert "| | fork/none | fork/scripted70 |" in text
    assert "| runner.x µs/step | 1.0 | 8.0 |" in text
    assert sp.compare([paths[0], paths[0]]).count("| | fork #1 | fork #2 |") == 1


def test_configs_report_rows_and_files(tmp_path):
    from benchmarks import configs_report as cr

    for label, ms in (("tq_fix", 10.0), ("tq_eager", 40.0), ("tq_fix", 12.0)):
        doc = {"schema": dl.SCHEMA, "mode": label, "variant": "fork", "status": "ok",
               "config": {"engine": {"enforce_eager": label == "tq_eager"}},
               "results": [{"bs": 1, "median_ms": ms, "tokens_per_s": 1e3 / ms,
                            "tokens_per_step": 1.0, "acceptance": 0.0}]}  # fmt: skip
        (tmp_path / f"{label}-{ms}.json").write_text(json.dumps(doc))
    res = cr.write([tmp_path], tmp_path / "out", "t", baseline="tq_eager")
    by = {r["config"]: r for r in res["rows"]}
    assert by["tq_fix"]["runs"] == 2 and by["tq_fix"]["median_ms"] == 11.0
    assert by["tq_eager"]["speedup_vs_baseline"] == 1.0
    assert by["tq_fix"]["speedup_vs_baseline"] == pytest.approx(
        (100 + 1e3 / 12) / 2 / 25
    )
    md = (tmp_path / "out" / "t.md").read_text()
    assert "| tq_fix | 1 | 11.000 |" in md and "speedup: tok/s over `tq_eager`" in md
    with pytest.raises(SystemExit):
        cr.write([tmp_path / "out" / "t.md"], tmp_path / "o2", "t", None)


def test_configs_report_takes_each_variants_speedup_over_its_own_baseline(tmp_path):
    from benchmarks import configs_report as cr

    # fork and upstream of one side-by-side replay: none and scripted70 each
    for variant, none_ms, spec_ms in (("fork", 10.0, 5.0), ("upstream", 20.0, 8.0)):
        for label, ms in (("none", none_ms), ("scripted70", spec_ms)):
            # wall: the batch's time; steps: [ms, rows, ...] (the spec run
            # held 6 of its 8 requests at most)
            rows = 8 if label == "none" else 6
            row = {"bs": 8, "median_ms": ms, "tokens_per_s": 1e3 / ms,
                   "wall_s": ms / 10, "steps": [[ms, rows]]}  # fmt: skip
            doc = {"schema": dl.SCHEMA, "mode": label, "variant": variant,
                   "status": "ok", "config": {"engine": {}},
                   "results": [row]}  # fmt: skip
            (tmp_path / f"{label}-{variant}.json").write_text(json.dumps(doc))
    res = cr.write([tmp_path], tmp_path / "o", "t", "none")
    by = {r["config"]: r for r in res["rows"]}
    assert set(by) == {"none/fork", "none/upstream", "scripted70/fork",
                       "scripted70/upstream"}  # fmt: skip
    assert by["scripted70/fork"]["speedup_vs_baseline"] == pytest.approx(2.0)
    assert by["scripted70/upstream"]["speedup_vs_baseline"] == pytest.approx(2.5)
    assert by["none/upstream"]["speedup_vs_baseline"] == pytest.approx(1.0)
    assert by["scripted70/upstream"]["e2e_speedup_vs_baseline"] == pytest.approx(2.5)
    assert by["scripted70/fork"]["peak_rows"] == 6 and by["none/fork"]["peak_rows"] == 8
    md = (tmp_path / "o" / "t.md").read_text()
    assert (
        "| scripted70/fork | 8 | 5.000 | 200 |" in md
        and "| 6 | 0.50 | 2.00x | 2.00x |" in md
    )


def test_configs_report_full_batch_throughput_leaves_the_closed_batchs_tail_out(
    tmp_path,
):
    from benchmarks import configs_report as cr

    # BS 4. No speculation: 4 full steps of 10 ms, 4 tokens each. The replay:
    # 2 full steps of 20 ms emitting 12 tokens each (one request accepts
    # everything), then the one request that accepts nothing runs alone for
    # 8 steps of 10 ms: the closed batch waits for it. A prefill step and a
    # full step with a prefill row count in neither full-batch figure.
    none = [[5.0, 4, 4, 0, 0, 0]] + [[10.0, 4, 0, 0, 0, 4]] * 4
    spec = [[5.0, 4, 4, 0, 0, 0], [30.0, 4, 1, 8, 8, 12]]
    spec += [[20.0, 4, 0, 8, 8, 12]] * 2 + [[10.0, 1, 0, 0, 0, 1]] * 8
    for label, steps in (("none", none), ("scripted70", spec)):
        decode = [s for s in steps if not s[2]]
        ms = sum(s[0] for s in decode)
        toks = sum(s[5] for s in decode)
        row = {"bs": 4, "median_ms": 10.0, "tokens_per_s": toks * 1e3 / ms,
               "wall_s": ms / 1e3, "steps": steps}  # fmt: skip
        doc = {"schema": dl.SCHEMA, "mode": label, "variant": "fork",
               "status": "ok", "config": {"engine": {}}, "results": [row]}  # fmt: skip
        (tmp_path / f"{label}.json").write_text(json.dumps(doc))
    res = cr.write([tmp_path], tmp_path / "o", "t", "none")
    by = {r["config"]: r for r in res["rows"]}
    # closed batch: 16 tokens in 40 ms against 32 in 120 ms
    assert by["scripted70"]["speedup_vs_baseline"] == pytest.approx(
        (32 / 120) / (16 / 40)
    )
    # full batch: 24 tokens in 40 ms against 16 in 40 ms
    assert by["none"]["full_batch_tokens_per_s"] == pytest.approx(400.0)
    assert by["scripted70"]["full_batch_tokens_per_s"] == pytest.approx(600.0)
    assert by["scripted70"]["full_batch_speedup_vs_baseline"] == pytest.approx(1.5)
    md = (tmp_path / "o" / "t.md").read_text()
    assert "| 600 | 1.50x |" in md and "full-batch tok/s" in md
    # records without steps (older JSONs): no full-batch figure
    assert cr.full_batch_tokens_per_s({"bs": 4}, 4) is None


def test_align_mode_turns_prefix_caching_on_and_names_the_mode_where_taken(
    monkeypatch,
):
    from harness import compat

    a = dl.parse_args(["--mode", "mtp", "--out", "x.json"])
    assert dl.engine_kwargs(a, "/m")["enable_prefix_caching"] is False
    a = dl.parse_args(["--mode", "mtp", "--out", "x.json", "--cache-mode", "align"])
    monkeypatch.setattr(compat, "passes_mamba_cache_mode", lambda: True)  # v0.26.0
    kw = dl.engine_kwargs(a, "/m")
    assert kw["enable_prefix_caching"] is True and kw["mamba_cache_mode"] == "align"
    monkeypatch.setattr(compat, "passes_mamba_cache_mode", lambda: False)  # v0.33.0
    assert "mamba_cache_mode" not in dl.engine_kwargs(a, "/m")
