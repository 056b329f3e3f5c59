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

from conftest import free_port, run_until_done, subprocess_env

from serving import soak

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
FAKE = f"{PY} -m serving.fake_server --fake-mode fastapply"


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
    proc, r, out = _soak(tmp_path)
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
    assert (out / "soak.png").stat().st_size > 0
    assert "# Soak: PASS" in (out / "soak.md").read_text()


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
