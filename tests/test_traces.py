# SPDX-License-Identifier: Apache-2.0
"""harness.traces (per-request draft/acceptance traces of a real drafter)
and their replay through the benchmark's scripted drafter."""

from __future__ import annotations

from types import SimpleNamespace

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
