# SPDX-License-Identifier: Apache-2.0
"""``serving.soak`` against fake OpenAI-compatible servers
(``serving.fake_server``): the mixed load with every request feature, the
comparison with the reference, a decisive divergence, a crash that loses
requests, and the engine-core kill with its restart. Runs stop by request
count, never by time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import free_port, run_until_done, subprocess_env

from serving import soak

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
FAKE = f"{PY} -m serving.fake_server --fake-mode fastapply"
# a model with near-ties (the fast-apply fake has none)
TIES = f"{PY} -m serving.fake_server --fake-mode model"


def _soak(tmp_path, *args):
    out = tmp_path / "soak"
    argv = [
        "--model", str(REPO / "fixtures" / "fastapply"), "--out", str(out),
        "--server", "ref=none", "--server", "cand=ngram",
        "--clients", "8", "--duration", "0", "--requests", "80", "--pool", "16",
        "--max-tokens", "40", "--port", str(free_port()), "--engine-args", "",
        "--kv-bytes", "",
        # samples at the start and the end only: host memory is not judged
        # (how many periodic samples fit depends on the machine's speed)
        "--sample-s", "100000",
        "--vllm-cmd", FAKE, *args,
    ]  # fmt: skip
    proc = run_until_done(
        [PY, "-m", "serving.soak", *argv],
        what="the soak against fake servers",
        cwd=REPO,
        env=subprocess_env(),
    )
    return proc, json.loads((out / "soak.json").read_text()), out


def test_mixed_load_passes_against_a_right_candidate(tmp_path):
    proc, r, out = _soak(tmp_path, "--bad-requests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["verdict"] == "PASS" and all(r["checks"].values())
    assert r["started"] == 80
    # every feature was sent and came back as it should
    pf = r["per_feature"]
    assert set(pf) == {"plain", "stop", "n2", "regex", "disconnect"}
    assert pf["disconnect"] == {"disconnected": 8}
    assert pf["n2"] == {"ok": 8} and r["n2_incomplete"] == []
    assert r["outcomes"] == {"ok": 72, "disconnected": 8}
    # every greedy request that completed was compared with the reference
    assert r["compared"] == 64 and r["comparison"]["match"] == 64
    assert r["spec_metrics"]["accepted"] <= r["spec_metrics"]["draft_tokens"]
    assert r["memory"]["judged"] is False
    # every sample read the candidate's /metrics (a run cut before its
    # summary still has the preemption counter in its log)
    assert r["samples"] and all("preemptions" in s for s in r["samples"])
    assert "[soak] t=" in proc.stdout + proc.stderr
    assert (out / "soak.png").stat().st_size > 0
    assert "# Soak: PASS" in (out / "soak.md").read_text()
    # the malformed requests after the load: each a 4xx, the server alive
    assert r["checks"]["malformed_requests_4xx"] is True
    assert r["bad_requests"]["healthy_after"] is True
    assert "# Malformed requests: PASS" in (out / "bad_requests.md").read_text()


def test_a_request_sent_many_times_is_replayed_once(tmp_path):
    """The load cycles through its prompt pool: the reference answers each
    distinct greedy request once, and every copy is compared with it."""
    proc, r, _ = _soak(tmp_path, "--pool", "8")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # prompt i % 8, feature by i % 10: the plain ones are the 8 prompts,
    # the stop and regex ones (i % 10 == 3, 7) 4 prompts each
    assert r["compared"] == 64 and r["comparison"]["match"] == 64
    assert r["replayed_distinct"] == 16
    # the noise is measured on each distinct reference answer once (the
    # structured-output ones are judged apart: 8 plain and 4 stop answers)
    assert r["tie_margin"]["measured_on"] == 12


def test_the_reference_answers_during_the_load(tmp_path):
    """The candidate holds its answers until the reference is up (the
    fake's --fake-hold-until, a condition, not a delay): every greedy request
    completes while the reference is up, which answers each distinct one
    during the load, so nothing is left to replay after it. With
    --no-ref-during-load everything is replayed after the load."""
    port = free_port()
    hold = f"cand=--fake-hold-until http://127.0.0.1:{port + 1}/health"
    proc, r, _ = _soak(tmp_path, "--port", str(port), "--server-args", hold)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["compared"] == 64 and r["comparison"]["match"] == 64
    n = r["replayed_distinct"]
    assert n > 0 and r["ref_answered_during_load"] == n
    assert r["ref_replayed_after_load"] == 0
    proc, r, _ = _soak(
        tmp_path, "--port", str(port), "--server-args", hold, "--no-ref-during-load"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["comparison"]["match"] == 64
    assert r["ref_answered_during_load"] == 0
    assert r["ref_replayed_after_load"] == n


def test_a_candidate_that_answers_malformed_requests_with_5xx_fails(tmp_path):
    proc, r, out = _soak(
        tmp_path, "--bad-requests", "--requests", "16",
        "--server-args", "cand=--fake-no-validation",
    )  # fmt: skip
    assert proc.returncode == 1
    assert r["checks"]["malformed_requests_4xx"] is False
    assert r["checks"]["no_divergence"] is True
    assert "5xx **unexpected**" in (out / "bad_requests.md").read_text()


def test_a_decisive_divergence_fails_the_soak(tmp_path):
    proc, r, _ = _soak(tmp_path, "--server-args", "cand=--fake-perturb decisive")
    assert proc.returncode == 1
    assert r["verdict"] == "FAIL" and r["checks"]["no_divergence"] is False
    assert r["comparison"]["diverged"] > 0
    assert all(row["status"] in ("diverged", "tie") for row in r["rows"])


def test_a_server_that_dies_loses_requests_and_fails(tmp_path):
    proc, r, _ = _soak(tmp_path, "--server-args", "cand=--fake-crash-on-request")
    assert proc.returncode == 1
    assert r["checks"]["no_request_lost"] is False
    assert r["checks"]["alive_at_end"] is False
    assert r["outcomes"].get("lost", 0) > 0


def test_killing_the_engine_core_mid_load(tmp_path):
    """--fault kill-engine: the engine-core child is killed after 30
    completed requests; requests in flight end, /health fails, the
    candidate is launched again and answers earlier requests identically."""
    proc, r, _ = _soak(
        tmp_path,
        "--server-args", "cand=--fake-engine-child",
        "--fault", "kill-engine", "--kill-after", "30", "--replay", "12",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    f = r["fault"]
    assert len(f["engine_pids"]) == 1
    assert f["in_flight_ended"] and f["health_failed"] and f["restarted"]
    assert f["replayed"] == 12 and f["identical_after_restart"] == 12
    assert r["checks"]["restart_identical"] and r["verdict"] == "PASS"
    # no new request after the kill
    assert r["started"] < 80


def test_ties_pass_the_soak_structured_output_included(tmp_path):
    """A candidate that takes the other side of every near-tie: each differing
    request is a tie, those with structured output judged at their first
    difference from the reference run's own top-2."""
    proc, r, _ = _soak(
        tmp_path, "--server-args", "cand=--fake-perturb ties", "--vllm-cmd", TIES
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["verdict"] == "PASS" and r["comparison"]["diverged"] == 0
    assert r["comparison"]["tie"] > 0
    judged = {row["judged"] for row in r["rows"] if row["feature"] == "regex"}
    assert judged == {"structured output: first difference"}


def test_the_tie_margin_is_twice_the_noise_measured_on_the_reference(tmp_path):
    """A reference whose prefill gaps differ from its decode gaps by 0.2
    nats (kernel-path noise, as the harness measures it): the candidate's
    near-tie choices, 0.21 below the top choice teacher-forced, are ties
    under the measured margin (0.4), not divergences under the bf16 floor
    (0.05); a decisive divergence (2 nats) still fails."""
    noisy = "ref=--fake-prefill-noise 0.2"
    proc, r, out = _soak(
        tmp_path, "--server-args", noisy,
        "--server-args", "cand=--fake-perturb ties", "--vllm-cmd", TIES,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = r["tie_margin"]
    assert m["noise"] == pytest.approx(0.2) and m["margin"] == pytest.approx(0.4)
    assert m["measured_on"] > 0 and m["floor"] == pytest.approx(0.05)
    assert r["comparison"]["diverged"] == 0 and r["comparison"]["tie"] > 0
    forced = [row for row in r["rows"] if row.get("judged") == "teacher-forced"]
    assert forced and all(
        t["gap"] == pytest.approx(0.21) for row in forced for t in row["ties"]
    )
    assert "Tie margin 0.4 nats" in (out / "soak.md").read_text()
    proc, r, _ = _soak(
        tmp_path, "--server-args", noisy,
        "--server-args", "cand=--fake-perturb decisive", "--vllm-cmd", TIES,
    )  # fmt: skip
    assert proc.returncode == 1 and r["comparison"]["diverged"] > 0


def _restart(tmp_path, perturb):
    marker = tmp_path / "started"
    return _soak(
        tmp_path,
        "--server-args",
        f"cand=--fake-engine-child --fake-restart-perturb {perturb} {marker}",
        "--fault", "kill-engine", "--kill-after", "30", "--replay", "12",
        "--vllm-cmd", TIES,
    )  # fmt: skip


def test_a_restart_that_answers_on_the_other_side_of_ties_passes(tmp_path):
    proc, r, _ = _restart(tmp_path, "ties")
    f = r["fault"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f["identical_after_restart"] < f["replayed"] == 12
    assert f["restart_judged"]["tie"] > 0 and f["restart_judged"]["diverged"] == 0
    assert r["checks"]["restart_identical"] is True


def test_a_restart_that_answers_otherwise_fails(tmp_path):
    proc, r, _ = _restart(tmp_path, "decisive")
    assert proc.returncode == 1
    assert r["fault"]["restart_judged"]["diverged"] > 0
    assert r["checks"]["restart_identical"] is False


def test_memory_is_judged_on_enough_samples_only():
    flat = [{"rss_mib": 100.0 + (i % 2)} for i in range(9)]
    assert soak.memory_flat(flat, 0.05)["flat"] is True
    grows = [{"rss_mib": 100.0 * (1.1**i)} for i in range(9)]
    assert soak.memory_flat(grows, 0.05)["flat"] is False
    assert soak.memory_flat(flat[:5], 0.05) == {"judged": False, "samples": 5}


def test_request_features_rotate_by_index():
    from serving.prompts import build_requests

    pool = build_requests("fastapply", 4, 0, 32)
    feats = [soak.soak_request(pool, i, "fastapply").feature for i in range(10)]
    assert feats[3] == "stop" and feats[5] == "n2" and feats[7] == "regex"
    assert feats[9] == "disconnect" and feats.count("plain") == 6
    body = soak.soak_payload(soak.soak_request(pool, 5, "fastapply"), "m")
    assert body["n"] == 2 and body["temperature"] == 1.0 and body["seed"] == 5
    body = soak.soak_payload(soak.soak_request(pool, 7, "fastapply"), "m")
    assert "regex" in body["structured_outputs"]
    # structured output only with the fixture's words
    text = build_requests("text", 4, 0, 32)
    assert soak.soak_request(text, 7, "text").feature == "plain"
    # long answers (--long-tokens) only when asked for, at i % 10 == 1
    assert feats[1] == "plain"
    long = soak.soak_request(pool, 11, "fastapply", long_tokens=900)
    assert long.feature == "long" and long.greedy
    body = soak.soak_payload(long, "m")
    assert body["max_tokens"] == 900 and body["ignore_eos"] is True
    assert "ignore_eos" not in soak.soak_payload(soak.soak_request(pool, 0, "x"), "m")


def _gpu_soak(tmp_path, what: str, soak_args: str, **env: str):
    """serving/gpu_soak.sh's n-gram soak and MTP fault runs on this machine
    (no bundle), results in tmp_path/out."""
    return run_until_done(
        ["bash", "serving/gpu_soak.sh"],
        what=f"serving/gpu_soak.sh {what}",
        cwd=REPO,
        env=subprocess_env(
            PYTHON=PY,
            OUT=str(tmp_path / "out"),
            SOAK_WORK=str(tmp_path / "work"),
            SOAK_BUNDLE_ENV="none",
            SOAK_ARGS=soak_args,
            **{"SOAK_RUNS": "soak-ngram fault-mtp", **env},
        ),  # fmt: skip
    )


def test_gpu_soak_script_dry_run(tmp_path):
    """serving/gpu_soak.sh end to end against fake servers: the n-gram soak
    with the malformed requests, and the MTP fault run, each with its
    reference; a summary and one archive per run in $OUT."""
    out = tmp_path / "out"
    extra = (
        "--duration 0 --requests 60 --pool 12 --max-tokens 30 --kv-bytes '' "
        "--sample-s 100000 --kill-after 24 --replay 8 "
        f"--vllm-cmd '{FAKE}' "
        "--server-args 'cand=--fake-engine-child --fake-preempt-every 5'"
    )
    # a deadline far out: the runs end by request count, however slow the
    # machine (the script's deadline is tested below with a server that
    # never starts). The two runs overlap in time, so each takes its own
    # ports from SOAK_PORT_BASE (one --port for both once collided: "address
    # already in use")
    proc = _gpu_soak(
        tmp_path, "against fake servers", extra,
        SOAK_CLIENTS="4", SOAK_DEADLINE="100000",
        SOAK_PORT_BASE=str(free_port()),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = (out / "SOAK.md").read_text()
    assert summary.count("# Soak: PASS") == 2
    assert "| preempted | ok |" in summary
    assert "| malformed_requests_4xx | ok |" in summary
    assert "| restart_identical | ok |" in summary
    assert {p.name for p in out.iterdir()} == {
        "SOAK.md", "soak-ngram.tgz", "fault-mtp.tgz",
    }  # fmt: skip


def _soak_runs(tmp_path, what: str, extra: str, runs: list[str]):
    """gpu_soak.sh with ``runs`` side by side against fake servers, by
    request count: (SOAK.md, each run's soak.json config)."""
    import json
    import tarfile

    out = tmp_path / "out"
    proc = _gpu_soak(
        tmp_path, what, extra,
        SOAK_RUNS=" ".join(runs), SOAK_CLIENTS="2",
        SOAK_DEADLINE="100000", SOAK_STAGGER="0",
        SOAK_PORT_BASE=str(free_port()),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    configs = {}
    for spec in runs:
        run = spec.replace("@", "-")
        with tarfile.open(out / f"{run}.tgz") as tar:
            configs[run] = json.load(tar.extractfile(f"{run}/soak.json"))["config"]
    return (out / "SOAK.md").read_text(), configs


def test_gpu_soak_script_runs_pool_sizes_side_by_side(tmp_path):
    """RUN@BYTES: the same soak with two pool sizes at once, each on its own
    ports, with its own folder, archive and summary section, and its
    servers given that pool."""
    extra = (
        "--duration 0 --requests 12 --pool 6 --max-tokens 20 "
        "--sample-s 100000 --replay 4 "
        f"--vllm-cmd '{FAKE}' "
        "--server-args 'cand=--fake-engine-child --fake-preempt-every 5'"
    )
    summary, configs = _soak_runs(
        tmp_path, "two pool sizes", extra, ["soak-ngram@1e8", "soak-ngram@2e8"]
    )
    assert "## soak-ngram-1e8" in summary and "## soak-ngram-2e8" in summary
    assert summary.count("# Soak: PASS") == 2
    ports = set()
    for size in ("1e8", "2e8"):
        cfg = configs[f"soak-ngram-{size}"]
        assert str(cfg["kv_bytes"]) == size
        # the n-gram candidate's step budget (SOAK_NGRAM_BUDGET) and long
        # answers (SOAK_LONG_TOKENS), so that its pool runs out
        assert "cand=--max-num-batched-tokens=1024" in cfg["server_args"]
        assert cfg["long_tokens"] == 3072
        ports.add(cfg["port"])
    assert len(ports) == 2


def test_gpu_soak_script_data_parallel_runs(tmp_path):
    """dp2-ngram and dp2-mtp: the candidate server with
    --data-parallel-size 2 against the reference at DP=1, by request count,
    each on its own ports and with a fixed pool (engines share the GPUs)."""
    extra = (
        "--requests 12 --pool 6 --max-tokens 20 --sample-s 100000 --replay 4 "
        f"--vllm-cmd '{FAKE}'"
    )
    summary, configs = _soak_runs(
        tmp_path, "data parallel", extra, ["dp2-ngram", "dp2-mtp"]
    )
    assert summary.count("# Soak: PASS") == 2
    for cfg in configs.values():
        assert "cand=--data-parallel-size=2" in cfg["server_args"]
        assert cfg["duration"] == 0 and str(cfg["kv_bytes"]) == "4e8"


def test_gpu_soak_script_ends_by_its_deadline_when_a_server_never_starts(tmp_path):
    """A candidate that never answers /health: every run ends by
    SOAK_DEADLINE (counted from the script's start, a run started later
    included) and the script still writes its summary and archives, so that
    a GPU call's own limit never cuts it off. The hang guard below only
    catches a script that ignores its deadline."""
    out = tmp_path / "out"
    # a result an earlier call left in the work folder (it keeps the compile
    # caches between calls) must not stand in for this run's
    stale = tmp_path / "work" / "soak-ngram"
    stale.mkdir(parents=True)
    (stale / "soak.md").write_text("# Soak: PASS (an earlier call)\n")
    extra = (
        f"--requests 20 --kv-bytes '' --port {free_port()} --vllm-cmd '{FAKE}' "
        "--server-args 'cand=--fake-startup-s 100000'"
    )
    proc = _gpu_soak(
        tmp_path, "with a server that never starts", extra,
        SOAK_CLIENTS="2", SOAK_DEADLINE="64",
    )  # fmt: skip
    assert proc.returncode == 1
    summary = (out / "SOAK.md").read_text()
    assert "not ready: cand" in summary
    assert "an earlier call" not in summary
    # the fault run waited for the soak's candidate, then had no time left
    assert "fault-mtp: no time left, not started" in proc.stdout
    assert (out / "soak-ngram.tgz").exists()


def test_long_answers_are_rescored_apart(monkeypatch):
    """rescore_apart: structured output is not teacher-forced, long answers
    (ignore_eos) are judged with their own measured noise, the rest
    together; the soak and the restart check both go through it."""
    from types import SimpleNamespace

    calls = []

    async def fake_rescore(url, model, rows, refs, cands, margin, deadline):
        calls.append([r["feature"] for r in rows])
        return {"margin": margin, "rows": len(rows)}

    monkeypatch.setattr(soak, "rescore", fake_rescore)
    rows = [{"feature": f} for f in ("plain", "regex", "long", "stop", "long")]
    a = SimpleNamespace(tie_margin=0.05)
    judged = soak.rescore_apart("u", "m", rows, [], [], a, 0.0)
    assert calls == [["plain", "stop"], ["long", "long"]]
    assert judged["rows"] == 2 and judged["long"]["rows"] == 2
    calls.clear()
    assert "long" not in soak.rescore_apart("u", "m", rows[:2], [], [], a, 0.0)
    assert calls == [["plain"]]


def test_unscored_long_answers_are_judged_with_the_long_margin():
    """A long answer whose teacher-forced rescoring failed (a timeout) is
    judged at its first difference with the long answers' measured margin;
    a plain one with the plain margin."""
    rows = [
        {"feature": f, "status": "differs", "first": {"gap": g, "tie": False}}
        for f, g in (("long", 1.5), ("plain", 1.5), ("long", 4.0), ("plain", 0.2))
    ]
    soak.finalize_apart(rows, {"margin": 0.5, "long": {"margin": 3.0}})
    assert [r["status"] for r in rows] == ["tie", "diverged", "diverged", "tie"]
    assert all(r["judged"] == "first-difference" for r in rows)


def test_rescoring_sends_the_candidates_first_and_caps_the_noise_sample(
    monkeypatch,
):
    """``serving.compare.rescore`` teacher-forces every differing candidate
    answer, those requests first (the verdict needs each of them), and at
    most NOISE_SAMPLE reference answers for the noise, differing ones first:
    a soak's hundreds of long answers once left differing rows unscored at
    the deadline."""
    import asyncio
    import math

    import aiohttp

    from serving import compare

    sent = []

    class Response:
        status = 200

        def __init__(self, body):
            self.body = body

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def json(self):
            n = len(self.body["prompt"])
            plp = [None] + [{str(t): {"logprob": 0.0}} for t in self.body["prompt"][1:]]
            assert len(plp) == n
            return {"choices": [{"prompt_logprobs": plp}]}

    class Session:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        def post(self, url, json, timeout):
            sent.append(tuple(json["prompt"]))
            return Response(json)

    monkeypatch.setattr(aiohttp, "ClientSession", Session)
    monkeypatch.setattr(compare, "NOISE_SAMPLE", 4)
    n = 10
    ref = [
        {"prompt_token_ids": [1, i], "token_ids": [7, 7], "top": []} for i in range(n)
    ]
    cand = [
        {"prompt_token_ids": [1, i], "token_ids": [8, 8], "top": []} for i in range(n)
    ]
    rows = [{"idx_pos": i, "status": "differs" if i < 6 else "match"} for i in range(n)]
    # no deadline (math.inf): the stub answers at once
    judged = asyncio.run(compare.rescore("u", "m", rows, ref, cand, 0.05, math.inf))
    cand_prompts = {(1, i, 8, 8) for i in range(6)}
    assert set(sent[:6]) == cand_prompts  # every candidate, first
    assert len(sent) == 6 + 4 and judged["measured_on"] == 4
    assert set(sent[6:]) == {(1, i, 7, 7) for i in range(4)}  # differing first
