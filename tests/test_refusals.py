"""serving/refusals.py: the table of speculative configurations refused for
hybrid models. The table writer on made-up results (no vLLM), and one real
refusal (a recurrent draft model) in a child process of the CPU test bed."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

from conftest import REPO, run_until_done, subprocess_env

from serving import refusals
from serving.refusals import CASES, LINES, MODEL


def test_cases_are_well_formed():
    seen = set()
    for c in CASES:
        assert c.lines and set(c.lines) <= set(LINES), c.id
        re.compile(c.alternative)
        for line in c.lines:
            assert (line, c.id) not in seen, c.id
            seen.add((line, c.id))
    # the fork's refusals of each line are all in the table (v0.26.0: patches
    # 0009, 0010, 0011, 0013, 0020 twice; 0012's refusal of Kimi-Linear was
    # lifted by 0024, which gives its KDA layers a spec path; v0.33.0: 0004,
    # 0009 twice; 0020 and 0009 refuse a recurrent draft model, and one
    # whose model type maps to an MTP drafter; 0028 and 0021 refuse Mamba1
    # models, 0029 LFM2 and Plamo2)
    ours = {
        (line, c.id) for c in CASES if c.source.startswith("fork") for line in c.lines
    }
    assert len([k for k in ours if k[0] == "v0.26.0"]) == 8
    assert len([k for k in ours if k[0] == "v0.33.0"]) == 4


def test_cli_args_are_what_a_user_types():
    kw = {
        "model": "/m",
        "enable_prefix_caching": True,
        "enable_chunked_prefill": False,
        "block_size": 32,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
    }
    assert refusals.cli_args(kw) == [
        "/m",
        "--enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--block-size",
        "32",
        "--speculative-config",
        '{"method":"mtp","num_speculative_tokens":2}',
    ]
    c = next(c for c in CASES if c.id == "mrv2-mamba-all-spec")
    line = refusals.shell_line(c)
    assert line.startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve FIXTURES/nemotron_h")
    assert "--mamba-cache-mode all" in line


def test_core_message_takes_off_the_pydantic_wrapper():
    text = (
        "1 validation error for VllmConfig\n  Assertion failed, Chunked prefill "
        "is required. [type=assertion_error, input_value=...]\n    For further "
        "information visit https://errors.pydantic.dev/2/v/assertion_error"
    )
    assert refusals.core_message(text) == "Chunked prefill is required."
    assert refusals.inner_exception("ValidationError", text) == (
        "ValidationError (assertion)"
    )
    assert refusals.core_message("plain") == "plain"


def _api(msg=None, **kw):
    if msg is None:
        return {"status": "accepted"} | kw
    return {
        "status": "refused",
        "exception": "ValidationError (value)",
        "exception_lines": 3,
        "message": msg,
        "where": "create_engine_config",
    } | kw


def test_table_writer(tmp_path):
    err = "Traceback (most recent call last):\n  x\nValueError: boom\n"
    tb = refusals.summarize_cli(1, "exited", 12.5, err, "")
    assert tb["tracebacks"] == 1 and tb["last_error"] == "ValueError: boom"
    draft_msg = "does not support ... Use the target's MTP layers (method='mtp')."
    results = {
        ("fork", "draft-model-recurrent"): {
            "api": _api(draft_msg),
            "cli": refusals.summarize_cli(
                1,
                "exited",
                30.0,
                f"Traceback (most recent call last):\n{draft_msg}\n",
                "",
            ),
        },
        ("upstream", "draft-model-recurrent"): {"api": _api()},
        ("fork", "async-ngram-v1"): {"api": _api("Async scheduling is not supported.")},
        ("fork", "align-k-ge-mamba-block"): {
            "api": _api(
                "Use fewer speculative tokens or a larger --block-size.",
                where="executor (update_block_size_for_backend)",
            )
        },
    }
    rows = refusals.rows_for("v0.33.0", results)
    assert [r["id"] for r in rows] == [c.id for c in refusals.cases_for("v0.33.0")]
    by = {r["id"]: r for r in rows}
    draft = by["draft-model-recurrent"]
    assert draft["one_line"] and draft["names_alternative"]
    assert draft["fork_cli"]["shows_refusal"] and "text" not in draft["fork_cli"]
    assert any("1 traceback" in f for f in draft["findings"])
    assert any(
        "names no supported alternative" in f for f in by["async-ngram-v1"]["findings"]
    )
    assert any(
        "not refused at config time" in f
        for f in by["align-k-ge-mamba-block"]["findings"]
    )
    out = refusals.write_report("v0.33.0", rows, tmp_path, "python -m serving refusals")
    md = (out / "README.md").read_text()
    assert "| 1 | `draft-model-recurrent` |" in md
    assert "rc 1, 30.0 s" in md and "Needs a GPU host" in md
    data = json.loads((out / "refusals.json").read_text())
    assert data["line"] == "v0.33.0" and data["rows"][0]["id"] == rows[0]["id"]


def test_a_recurrent_draft_model_is_refused_at_config_time(tmp_path):
    """One real refusal: the fork's check, through create_engine_config as
    LLM(...) runs it, in a child process on vLLM's CPU platform (configs
    and tokenizers only, no weights)."""
    if importlib.util.find_spec("vllm") is None:
        import pytest

        pytest.skip("vLLM is not installed in this interpreter")
    from harness.models import _write_tokenizer, granite_h_config, nemotron_h_config

    for name, cfg in (
        ("nemotron_h", nemotron_h_config()),
        ("granite", granite_h_config()),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        _write_tokenizer(tmp_path / name, cfg["vocab_size"])
    case = {
        "id": "draft",
        "env": {},
        "executor_step": False,
        "kwargs": {
            "model": str(tmp_path / "nemotron_h"),
            "max_model_len": 1024,
            "speculative_config": {
                "method": "draft_model",
                "model": str(tmp_path / "granite"),
                "num_speculative_tokens": 2,
            },
        },
    }
    (tmp_path / "cases.json").write_text(json.dumps([case]))
    p = run_until_done(
        [
            sys.executable,
            "-m",
            "serving.refusals",
            "child",
            str(tmp_path / "cases.json"),
        ],
        what="the refusals child",
        cwd=REPO,
        env=subprocess_env(
            HSFORK_CPU_TESTBED="1", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR"
        ),
    )
    got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert got, p.stderr[-3000:]
    (r,) = json.loads(got[0][len("RESULTS ") :])
    if "fork" not in r["vllm"]:
        import pytest

        pytest.skip(f"not the fork's vLLM: {r['vllm']}")
    assert r["status"] == "refused", r
    assert r["where"] == "create_engine_config"
    assert "does not support draft models with recurrent state" in r["message"]
    assert "method='mtp'" in r["message"] and "\n" not in r["message"]
    assert MODEL not in r["message"]
