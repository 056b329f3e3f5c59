# SPDX-License-Identifier: Apache-2.0
"""``serving.bad_requests`` against a fake ``vllm serve``
(``serving.fake_server``, which refuses malformed requests as vLLM does, or
answers them with HTTP 500 with ``--fake-no-validation``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, run_until_done, subprocess_env, wait_until_healthy

from serving import bad_requests as br

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


@pytest.fixture
def fake(request):
    procs = []

    def start(*flags):
        port = free_port()
        p = subprocess.Popen(
            [PY, "-m", "serving.fake_server", "model", "--port", str(port),
             "--served-model-name", "m", "--max-model-len", "512", *flags],
            cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(p)
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, p, what="the fake server")
        return url

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _run(url, tmp_path):
    out = tmp_path / "bad"
    proc = run_until_done(
        [PY, "-m", "serving.bad_requests", "--url", url, "--model", "m",
         "--max-model-len", "512", "--out", str(out)],
        what="bad_requests against the fake server", cwd=REPO, env=subprocess_env(),
    )  # fmt: skip
    return proc, json.loads((out / "bad_requests.json").read_text()), out


def test_every_malformed_request_gets_a_4xx_and_the_server_lives(fake, tmp_path):
    proc, rep, out = _run(fake(), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert rep["verdict"] == "PASS" and rep["healthy_after"]
    assert rep["well_formed_after"]["status"] == 200
    by = {r["case"]: r for r in rep["rows"]}
    assert len(by) == len(br.cases("m", 512))
    assert by["unknown model"]["status"] == 404
    assert by["negative max_tokens"]["status"] == 400
    assert "maximum context length" in by["prompt over max_model_len"]["error"]
    # vLLM ignores request fields it does not know: accepted, not an error
    spec = by["speculative config in a request"]
    assert spec["verdict"] == "accepted" and spec["ok"]
    assert "| negative max_tokens |" in (out / "bad_requests.md").read_text()


def test_a_5xx_answer_fails(fake, tmp_path):
    proc, rep, _ = _run(fake("--fake-no-validation"), tmp_path)
    assert proc.returncode == 1 and rep["verdict"] == "FAIL"
    assert any(r["verdict"] == "5xx" and not r["ok"] for r in rep["rows"])
