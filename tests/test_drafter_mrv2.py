# SPDX-License-Identifier: Apache-2.0
"""The scripted drafter on Model Runner V2 (``harness.drafter_mrv2``): draft
planning per row, the schedules as MRV2 carries them, and the patches on the
real MRV2 classes (imported on CPU with ``VLLM_TARGET_DEVICE=empty``; the
request state needs pinned memory, so the runner and speculator are fakes
around a real ``InputBatch``)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
from types import SimpleNamespace

import pytest

from harness import drafter_mrv2 as m
from harness.drafter import SCHEDULES, Script, StepContext, drafts_for

os.environ.setdefault("VLLM_TARGET_DEVICE", "empty")
torch = pytest.importorskip("torch")

VOCAB = 256
K = 4


def _ctx(row=0, step=0, generated=0, length=40, k=K, block_size=16, seed=0):
    return StepContext(row, step, generated, length, k, block_size, seed)


def _leading(tokens, reference, start):
    c = 0
    while c < len(tokens) and start + c < len(reference):
        if tokens[c] != reference[start + c]:
            break
        c += 1
    return c


# --- planning a row -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("carry_all", [False, True])
def test_plan_row_extends_the_v1_drafts_to_k(name, carry_all):
    reference = [(7 * i + 3) % VOCAB for i in range(60)]
    sched = SCHEDULES[name]
    for row in range(4):
        for step in range(12):
            for generated in (0, 5, 30, 54, 57, 58, 59):
                ctx = _ctx(row, step, generated, 40 + generated)
                v1 = drafts_for(sched, ctx, reference, VOCAB)
                tokens, carried, correct = m.plan_row(
                    sched, ctx, reference, VOCAB, carry_all
                )
                start = generated + 1
                assert len(tokens) == K
                assert tokens[: len(v1)] == v1
                assert carried == (K if carry_all else len(v1))
                assert correct == _leading(v1, reference, start)
                assert tokens[:correct] == reference[start : start + correct]
                for j in range(correct, K):
                    if start + j < len(reference):
                        # a wrong draft is never the reference token
                        assert tokens[j] != reference[start + j]
                    else:
                        assert tokens[j] == m.FILLER
                assert all(0 <= t < VOCAB for t in tokens)


def test_wrong_token_differs_even_at_the_vocab_edge():
    reference = [VOCAB - 1] * 10
    tokens, _, correct = m.plan_row(
        SCHEDULES["all_zero"], _ctx(), reference, VOCAB, True
    )
    assert correct == 0
    assert all(t != VOCAB - 1 for t in tokens)


def test_schedules_as_mrv2_carries_them():
    reference = list(range(100, 180))

    def plan(name, carry_all, **kw):
        return m.plan_row(SCHEDULES[name], _ctx(**kw), reference, VOCAB, carry_all)

    # all_zero: synchronous scheduling carries no drafts; async carries k,
    # all rejected
    assert plan("all_zero", False)[1:] == (0, 0)
    assert plan("all_zero", True)[1:] == (K, 0)
    # all_accept: k right either way
    assert plan("all_accept", False)[1:] == (K, K)
    assert plan("all_accept", True)[1:] == (K, K)
    # accept_then_zero: k accepted, then a step without drafts (sync) or
    # with every draft rejected (async)
    assert plan("accept_then_zero", False, step=0)[1:] == (K, K)
    assert plan("accept_then_zero", False, step=1)[1:] == (0, 0)
    assert plan("accept_then_zero", True, step=1)[1:] == (K, 0)
    # boundary: the accepted drafts end on a block boundary (even steps) or
    # one past it (odd steps)
    for length in range(33, 48):
        for step in (0, 1):
            _, carried, correct = plan(
                "boundary", True, step=step, length=length, generated=length - 30
            )
            assert carried == K
            to_boundary = (-length) % 16
            want = to_boundary if step == 0 else to_boundary + 1
            if want <= K:
                assert (length + correct) % 16 == step
            else:
                assert correct == K
    # random: the accepted count is the V1 one, the drafts carried k (async)
    for step in range(20):
        ctx = _ctx(step=step, generated=3)
        n, c = SCHEDULES["random"](ctx)
        assert plan("random", True, step=step, generated=3)[1:] == (K, c)
        assert plan("random", False, step=step, generated=3)[1:] == (n, c)


# --- the per-engine state -------------------------------------------------


def _script_data(schedule="all_accept", block_size=None):
    prompts = [list(range(1, 10)), list(range(1, 12)), [200 + i for i in range(9)]]
    refs = [[50 + i for i in range(20)], [80 + i for i in range(20)], []]
    data = {
        "schedule": schedule,
        "vocab_size": VOCAB,
        "block_size": block_size,
        "requests": [
            {"prompt": p, "reference": r} for p, r in zip(prompts, refs, strict=True)
        ],
    }
    return data, prompts, refs


def _script(schedule="all_accept", block_size=None):
    data, prompts, refs = _script_data(schedule, block_size)
    return Script(data), prompts, refs


def _equivalence_count(log_path):
    """harness.equivalence's drafts_per_step count of a script log."""
    counts: dict[int, int] = {}
    for line in log_path.read_text().splitlines():
        for _, _, _, nd in json.loads(line):
            counts[nd] = counts.get(nd, 0) + 1
    return counts


def test_state_maps_rows_to_requests_by_prompt(tmp_path):
    script, prompts, refs = _script()
    log = tmp_path / "script-log.jsonl"
    st = m.MRV2Script(script, K, carry_all=False, log_path=str(log))
    st.add_request("a", prompts[1])  # the longer prompt: script row 1
    st.add_request("b", prompts[0])
    st.add_request("c", [9, 9, 9])  # unknown (e.g. MRV2's warmup)
    st.add_request("d", prompts[0])  # a partial prefill below
    # a: row 1 with 2 tokens generated and 1 more just sampled
    plans = st.plan(
        ["a", "b", "c", "d"],
        [len(prompts[1]) + 3, len(prompts[0]) + 1, 4, 5],
        [2, 1, 1, 0],
    )
    a, b, c, d = plans
    assert (c, d) == (None, None)
    assert (a.row, a.step, a.generated, a.carried, a.correct) == (1, 0, 2, K, K)
    assert list(a.tokens) == refs[1][3 : 3 + K]
    assert (b.row, b.generated) == (0, 0)
    assert list(b.tokens) == refs[0][1 : 1 + K]
    # step counts are per script row; partial prefills take no step
    st.plan(["b"], [len(prompts[0]) + 5], [5])
    assert st.steps == {1: 1, 0: 2}
    # V1 log format (equivalence's counting works) plus the correct counts
    assert _equivalence_count(log) == {K: 3}
    detail = [json.loads(x) for x in m.detail_log_path(log).read_text().splitlines()]
    assert detail[0] == [[1, 0, 2, K, K], [0, 0, 0, K, K]]
    # a new engine's state starts a new detail log
    m.MRV2Script(script, K, carry_all=False, log_path=str(log))
    assert not m.detail_log_path(log).exists()


def test_state_cuts_draft_lists_only_under_sync_scheduling():
    script, prompts, _ = _script("accept_then_zero")
    for carry_all in (False, True):
        st = m.MRV2Script(script, K, carry_all=carry_all)
        st.add_request("a", prompts[0])
        st.add_request("b", prompts[1])
        st.plan(["a", "b"], [len(prompts[0]) + 1] * 2, [1, 1])  # step 0: k
        st.plan(["a"], [len(prompts[0]) + 6], [5])  # step 1: none
        drafts = [[-1] * K, [-1] * K, [-1] * K]
        cut = st.cut(["a", "b", "x"], [list(d) for d in drafts])
        if carry_all:
            assert cut == drafts
        else:
            # a: 0 drafts; b was not in the last batch; x is unknown
            assert cut == [[], [-1] * K, [-1] * K]


def test_reference_end_limits_drafts(tmp_path):
    script, prompts, refs = _script()
    st = m.MRV2Script(script, K, carry_all=False)
    st.add_request("a", prompts[0])
    # 18 of 20 reference tokens generated: one draft left
    (p,) = st.plan(["a"], [len(prompts[0]) + 18], [1])
    assert (p.generated, p.carried, p.correct) == (17, 2, 2)
    assert list(p.tokens) == refs[0][18:20] + [m.FILLER] * (K - 2)


# --- the patches on MRV2's classes ----------------------------------------


@pytest.fixture
def mrv2():
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu import model_runner

    # AutoRegressiveSpeculator (v0.26.0), TargetDependentARSpeculator (v0.33.0)
    yield SimpleNamespace(runner=model_runner, speculator=m.speculator_class())
    m.uninstall()


def test_install_patches_the_real_mrv2_classes(mrv2):
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
    from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator

    ar = mrv2.speculator
    runner = mrv2.runner.GPUModelRunner
    orig = (
        ar.__dict__["propose"],
        runner.__dict__["add_requests"],
        runner.__dict__["take_draft_token_ids"],
    )
    m.install()
    m.install()  # idempotent: wrapped once
    patched = (
        ar.__dict__["propose"],
        runner.__dict__["add_requests"],
        runner.__dict__["take_draft_token_ids"],
    )
    for o, p in zip(orig, patched, strict=True):
        assert p is not o
        assert p._hsfork_orig is o
    # the MTP (and EAGLE) speculator inherits the patched propose
    assert MTPSpeculator.propose is patched[0]
    assert EagleSpeculator.propose is patched[0]
    # the arguments the wrapper reads are the real propose's
    params = inspect.signature(orig[0]).parameters
    for name in ("input_batch", "num_sampled", "num_rejected", "dummy_run"):
        assert name in params
    m.uninstall()
    assert ar.__dict__["propose"] is orig[0]
    assert runner.__dict__["add_requests"] is orig[1]
    assert runner.__dict__["take_draft_token_ids"] is orig[2]


def test_mrv2_proposes_after_postprocessing_the_step(mrv2):
    """The positions rely on it: propose sees the step's own accepted counts
    (and GPU state already advanced), and its output becomes the requests'
    draft tokens."""
    src = inspect.getsource(mrv2.runner.GPUModelRunner.sample_tokens)
    post = src.index("self.postprocess_sampled(")
    prop = src.index("self.speculator.propose(")
    store = src.index("self.req_states.draft_tokens[input_batch.idx_mapping] =")
    assert post < prop < store


def _vllm_config(script_path, async_sched=False, block_size=16):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            num_speculative_tokens=K, draft_sample_method="greedy"
        ),
        scheduler_config=SimpleNamespace(async_scheduling=async_sched),
        cache_config=SimpleNamespace(block_size=block_size),
    )


def _batch(req_ids, seq_lens, num_scheduled):
    """A real MRV2 InputBatch (CPU tensors) for one step."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    num_tokens = int(sum(num_scheduled))
    buffers = InputBuffers(8, 64, torch.device("cpu"))
    batch = InputBatch.make_dummy(len(req_ids), num_tokens, buffers)
    import numpy as np

    return dataclasses.replace(
        batch,
        req_ids=list(req_ids),
        num_scheduled_tokens=np.array(num_scheduled, dtype=np.int32),
        seq_lens=torch.tensor(list(seq_lens) + [0, 0], dtype=torch.int32),
    )


def _write_script(tmp_path, monkeypatch, schedule="all_accept"):
    data, prompts, refs = _script_data(schedule)
    path = tmp_path / "script.json"
    path.write_text(json.dumps(data))
    log = tmp_path / "script-log.jsonl"
    monkeypatch.setenv("HSFORK_SCRIPT", str(path))
    monkeypatch.setenv("HSFORK_SCRIPT_LOG", str(log))
    return prompts, refs, log


def _fake_propose(real):
    """Stands for the real drafter: all drafts 7, shaped as it returns them
    (a view of its [max_num_reqs, k] buffer)."""

    @functools.wraps(real)
    def propose(self, input_batch, *args, **kwargs):
        self.draft_tokens.fill_(7)
        return self.draft_tokens[: input_batch.num_reqs]

    return propose


def test_propose_overwrites_scripted_rows_at_their_positions(
    mrv2, tmp_path, monkeypatch
):
    prompts, refs, log = _write_script(tmp_path, monkeypatch)
    real = mrv2.speculator.__dict__["propose"]
    propose = m._wrap_propose(_fake_propose(real))
    m.install()
    spec = SimpleNamespace(
        vllm_config=_vllm_config(None),
        draft_tokens=torch.zeros(8, K, dtype=torch.int64),
    )
    runner = SimpleNamespace(speculator=spec)
    from vllm.v1.core.sched.output import NewRequestData

    new = [
        NewRequestData(rid, p, [], None, None, ([],), 0, None)
        for rid, p in (("r0", prompts[0]), ("r1", prompts[1]), ("w", [0, 1]))
    ]
    add = m._wrap_add_requests(lambda self, so: None)
    add(runner, SimpleNamespace(scheduled_new_reqs=new))
    assert spec._hsfork_mrv2_script.prompts["r1"] == tuple(prompts[1])

    # r0: decode step of 1 + k tokens after 4 tokens were generated, 2 drafts
    # rejected; r1: its last prefill chunk; w: a warmup request
    p0 = len(prompts[0])
    seq_lens = [p0 + 4 + K, len(prompts[1]), 2]
    batch = _batch(["r0", "r1", "w"], seq_lens, [1 + K, 5, 2])
    num_sampled = torch.tensor([K - 1, 1, 1], dtype=torch.int32)
    num_rejected = torch.tensor([2, 0, 0], dtype=torch.int32)
    out = propose(
        spec, batch, None, None, None, None, num_sampled, num_rejected,
        None, None, None, None,
    )  # fmt: skip
    # r0 holds p0 + 4 + k - 2 + 1 tokens: generated = 4 + k - 2
    g0 = 4 + K - 2
    assert out[0].tolist() == refs[0][g0 + 1 : g0 + 1 + K]
    assert out[1].tolist() == refs[1][1 : 1 + K]
    assert out[2].tolist() == [7] * K  # the real drafter's
    assert out.data_ptr() == spec.draft_tokens.data_ptr()  # in place
    assert _equivalence_count(log) == {K: 2}

    # dummy runs (profiling, DP sync) pass through without taking a step
    spec.draft_tokens.zero_()
    out = propose(
        spec, batch, None, None, None, None, num_sampled, num_rejected,
        None, None, None, None, dummy_run=True,
    )  # fmt: skip
    assert out.tolist() == [[7] * K] * 3
    assert spec._hsfork_mrv2_script.steps == {0: 1, 1: 1}


def test_take_draft_token_ids_cuts_to_scheduled_drafts(mrv2, tmp_path, monkeypatch):
    from vllm.v1.outputs import DraftTokenIds

    prompts, _, _ = _write_script(tmp_path, monkeypatch, "all_zero")
    real = mrv2.speculator.__dict__["propose"]
    propose = m._wrap_propose(_fake_propose(real))
    m.install()
    for async_sched in (False, True):
        spec = SimpleNamespace(
            vllm_config=_vllm_config(None, async_sched=async_sched),
            draft_tokens=torch.zeros(8, K, dtype=torch.int64),
        )
        handler = SimpleNamespace(
            get_draft_tokens=lambda: DraftTokenIds(["r0", "w"], [[-1] * K] * 2)
        )
        runner = SimpleNamespace(speculator=spec, draft_tokens_handler=handler)
        m._wrap_add_requests(lambda self, so: None)(
            runner,
            SimpleNamespace(
                scheduled_new_reqs=[
                    SimpleNamespace(req_id="r0", prompt_token_ids=prompts[0])
                ]
            ),
        )
        batch = _batch(["r0", "w"], [len(prompts[0]), 2], [len(prompts[0]), 2])
        ones = torch.ones(2, dtype=torch.int32)
        propose(spec, batch, None, None, None, None, ones, ones * 0,
                None, None, None, None)  # fmt: skip
        take = m._wrap_take_draft_token_ids(
            mrv2.runner.GPUModelRunner.take_draft_token_ids._hsfork_orig
        )
        out = take(runner)
        # all_zero: no drafts under sync scheduling, k (all wrong) under async
        assert out.draft_token_ids == (
            [[-1] * K] * 2 if async_sched else [[], [-1] * K]
        )


def test_engines_made_after_uninstall_are_not_scripted(mrv2, tmp_path, monkeypatch):
    _write_script(tmp_path, monkeypatch)
    m.install()
    scripted = SimpleNamespace(vllm_config=_vllm_config(None))
    assert isinstance(m.state_of(scripted), m.MRV2Script)
    m.uninstall()
    plain = SimpleNamespace(vllm_config=_vllm_config(None))
    assert m.state_of(plain) is None
    # an engine keeps what it was made with
    assert isinstance(m.state_of(scripted), m.MRV2Script)


def test_probabilistic_draft_sampling_is_refused(tmp_path, monkeypatch):
    _write_script(tmp_path, monkeypatch)
    cfg = _vllm_config(None)
    cfg.speculative_config.draft_sample_method = "probabilistic"
    with pytest.raises(ValueError, match="greedy"):
        m.new_state(cfg)


def test_script_block_size_defaults_to_the_engines(tmp_path, monkeypatch):
    _write_script(tmp_path, monkeypatch)
    st = m.new_state(_vllm_config(None, async_sched=True, block_size=64))
    assert (st.script.block_size, st.k, st.carry_all) == (64, K, True)
    assert m.spec_config(3) == {"method": "mtp", "num_speculative_tokens": 3}


def test_propose_can_skip_the_real_drafter(mrv2, tmp_path, monkeypatch):
    prompts, refs, _ = _write_script(tmp_path, monkeypatch)
    real = mrv2.speculator.__dict__["propose"]
    calls = []

    @functools.wraps(real)
    def drafter(self, input_batch, *args, **kwargs):
        calls.append(kwargs.get("dummy_run", False))
        return self.draft_tokens[: input_batch.num_reqs]

    propose = m._wrap_propose(drafter)
    m.install(run_drafter=False)
    spec = SimpleNamespace(
        vllm_config=_vllm_config(None),
        draft_tokens=torch.full((8, K), 5, dtype=torch.int64),
        num_speculative_steps=K,
    )
    m.state_of(spec).add_request("r0", prompts[0])
    batch = _batch(["r0", "w"], [len(prompts[0]), 2], [len(prompts[0]), 2])
    ones = torch.ones(2, dtype=torch.int32)
    args = (None, None, None, None, ones, ones * 0, None, None, None, None)
    out = propose(spec, batch, *args)
    assert calls == []
    assert out.tolist() == [refs[0][1 : 1 + K], [5] * K]
    propose(spec, batch, *args, dummy_run=True)  # profiling still runs it
    assert calls == [True]
