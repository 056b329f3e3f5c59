# SPDX-License-Identifier: Apache-2.0
"""harness.traces (per-request draft/acceptance traces of a real drafter)
and their replay through the benchmark's scripted drafter."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import scripted
from harness import traces
from harness.drafter import StepContext


def _step(spec: dict, sampled: dict):
    ids = list(sampled)
    return (
        SimpleNamespace(scheduled_spec_decode_tokens=spec),
        SimpleNamespace(
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids],
        ),
    )


def test_recorder_takes_drafts_and_accepts_per_request():
    rec = traces.Recorder()
    # a: 4 drafts, 2 accepted (3 sampled); b: no drafts; c: a partial prefill
    rec.observe(*_step({"a": [5, 6, 7, 8]}, {"a": [1, 2, 3], "b": [9], "c": []}))
    # a: all 4 accepted; b: 2 drafts, one a placeholder (-1), none accepted
    rec.observe(*_step({"a": [1, 2, 3, 4], "b": [4, -1]}, {"a": [1] * 5, "b": [3]}))
    assert rec.traces == {"a": [[4, 2], [4, 4]], "b": [[0, 0], [1, 0]]}


def test_record_wraps_the_in_process_scheduler_and_restores_it():
    seen = []

    class Scheduler:
        def update_from_output(self, so, mro):
            seen.append("engine")
            return "result"

    sched = Scheduler()
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(
            engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=sched))
        )
    )
    with traces.record(llm) as rec:
        assert sched.update_from_output(*_step({"a": [1, 2]}, {"a": [1, 2]})) == (
            "result"
        )
    assert seen == ["engine"] and rec.traces == {"a": [[2, 1]]}
    assert "update_from_output" not in vars(sched)  # the original again


def test_write_load_summary_round_trip(tmp_path):
    path = tmp_path / "t.jsonl"
    traces.write({"a": [[4, 2], [0, 0]], "b": [[4, 4]]}, path, {"drafter": "ngram"})
    meta, got = traces.load(path)
    assert meta == {"drafter": "ngram"} and got == [[[4, 2], [0, 0]], [[4, 4]]]
    s = traces.summary(got)
    assert s["drafted"] == 8 and s["accepted"] == 6
    assert s["acceptance_rate"] == 0.75 and s["steps_without_drafts"] == 0.3333


def test_step_classes_of_closed_batches(capsys, tmp_path):
    """Steps where no row drafts, and no row accepted a draft the step
    before, are plain; steps where every row carries k drafts are verify
    steps; any other step (mixed counts, k > d > 0 also at BS 1, no drafts
    right after an accepted one) runs piecewise; a row that ended leaves
    the batch; a trailing round smaller than the batch is left out."""
    rows = [
        [[0, 0], [4, 4], [2, 1]],
        [[0, 0], [4, 0]],
        [[4, 1], [4, 2], [0, 0], [0, 0]],
        [[0, 0], [0, 0], [0, 0], [0, 0]],
        [[4, 4]],
    ]
    one = traces.step_classes(rows, 4, 1)
    # row 2's first step without drafts follows an accepted draft
    assert one["steps"] == 14 and one["plain"] == round(7 / 14, 4)
    assert one["verify"] == round(5 / 14, 4) and one["piecewise"] == round(2 / 14, 4)
    # rounds (rows 0, 1) and (2, 3); row 4 is left out
    two = traces.step_classes(rows, 4, 2)
    assert two["steps"] == 7
    assert (two["plain"], two["verify"], two["piecewise"]) == (
        round(2 / 7, 4), round(1 / 7, 4), round(4 / 7, 4))  # fmt: skip
    empty = traces.step_classes(rows, 4, 8)
    assert empty["steps"] == 0 and empty["plain"] is None
    path = tmp_path / "t.jsonl"
    traces.write({str(i): r for i, r in enumerate(rows)}, path, {"k": 4})
    traces.main(["summary", str(path), "--batch-sizes", "1,2"])
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out[1] == one and out[2] == two


def test_replay_follows_the_recorded_steps():
    plan = scripted.Plan(
        script=None, rate=0.7, p=0.5, by_head={}, traces=[[[4, 2], [0, 0]], [[8, 8]]]
    )

    def ctx(row, step, k=6):
        return StepContext(row, step, 0, 10, k, 16, 0)

    assert plan.schedule(ctx(0, 0)) == (4, 2)
    assert plan.schedule(ctx(0, 1)) == (0, 0)
    assert plan.schedule(ctx(0, 2)) == (4, 2)  # the trace again
    assert plan.schedule(ctx(1, 0)) == (6, 6)  # capped at k
    assert plan.schedule(ctx(2, 1)) == (0, 0)  # row 2 replays trace 0


class _HalfPolicy:
    """Keeps half of each row's drafts; records what it is shown."""

    def __init__(self):
        self.seen = []

    def observe(self, req_ids, drafts, sampled, scheduled):
        self.seen.append((list(req_ids), dict(drafts), list(sampled), scheduled))

    def num_drafts(self, req_id, n):
        return n // 2


def test_replay_cuts_drafts_by_a_policy_fed_with_its_own_rows():
    import numpy as np

    prompts = [list(range(100, 110)), list(range(200, 210))]
    refs = [list(range(1000, 1100)), list(range(2000, 2100))]
    policy = _HalfPolicy()
    # k=64 with a trace: no hash draws, so any k up to the trace's lengths
    plan = scripted.make_plan(
        prompts, refs, 0.7, 64, 0, 5000, traces=[[[64, 3]], [[8, 8]]], policy=policy
    )
    tokens = np.zeros((2, 200), dtype=np.int64)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        tokens[i, len(p)] = refs[i][0]
    n = [len(p) + 1 for p in prompts]  # prompt + the first sampled token
    first = scripted.propose_rows(plan, 64, [[1], [1]], n, tokens)
    assert [len(d) for d in first] == [32, 4]  # halved
    assert first[0][:3] == refs[0][1:4] and first[1] == refs[1][1:5]
    # row 0 accepted its 3 correct drafts (4 sampled), row 1 all 4 (5 sampled)
    scripted.propose_rows(plan, 64, [[1] * 4, [1] * 5], n, tokens)
    assert policy.seen[0] == (["0", "1"], {"0": 0, "1": 0}, [1, 1], 2)
    assert policy.seen[1] == (["0", "1"], {"0": 32, "1": 4}, [4, 5], 2 + 32 + 4)
    assert plan.proposed == 2 * (32 + 4) and plan.intended == 2 * (3 + 4)


def test_a_trace_replay_takes_draft_lengths_above_the_hash_limit():
    with pytest.raises(ValueError):
        scripted.make_plan([list(range(8))], [[1, 2]], 0.7, 64, 0, 100)
    plan = scripted.make_plan(
        [list(range(8))], [[1, 2]], 0.7, 64, 0, 100, traces=[[[64, 10]]]
    )
    assert plan.schedule(StepContext(0, 0, 0, 9, 64, 16, 0)) == (64, 10)


def test_a_trace_offset_moves_every_row_to_later_traces():
    plan = scripted.Plan(
        script=None,
        rate=0.7,
        p=0.0,
        by_head={},
        traces=[[[4, 1]], [[5, 2]], [[6, 3]]],
        trace_offset=2,
    )
    ctx = [StepContext(r, 0, 0, 10, 8, 16, 0) for r in range(3)]
    assert [plan.schedule(c) for c in ctx] == [(6, 3), (4, 1), (5, 2)]
