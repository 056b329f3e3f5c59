# SPDX-License-Identifier: Apache-2.0
"""Serving end to end (issue 7), the CPU side: the trained BPE tokenizer,
the 9B-shaped checkpoint writer (a shrunk config with the real layout and
vocabulary), the fast-apply chat round trip through vLLM's own renderer and
detokenizer, ``serve_check`` against fake OpenAI-compatible servers
(``serving.fake_server``: right, wrong, tie-flipping, failing and crashing
candidates), the lm-eval task, and ``gpu_serve.sh`` as a dry run."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, run_until_done, subprocess_env, wait_until_healthy

from harness import fastapply as fa
from serving import CheckError, client, lmeval, metrics, prompts
from serving import compare as cmp
from serving import make_model as mm
from serving import serve_check as sc
from serving import servers as sv
from serving import tokenizer as tk

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
FAKE = f"{PY} -m serving.fake_server"


def _run_result(argv: list[str], cwd: Path = REPO, **env):
    """Run ``argv`` (a script printing ``RESULT <json>``) with
    ``subprocess_env(**env)``; the JSON of its last ``RESULT`` line."""
    proc = run_until_done(
        argv, what=f"{argv[1:3]} (prints RESULT)", cwd=cwd, env=subprocess_env(**env)
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-4000:]
    return json.loads(lines[-1][7:])


# -- tokenizer -------------------------------------------------------------


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    info = tk.write(out, seed=0)
    return out, info


def test_tokenizer_is_deterministic_and_padded(tok_dir):
    from tokenizers import Tokenizer

    out, info = tok_dir
    # seconds, same bytes from the same seed
    again = tk.padded_json(tk.train(0))
    text = json.dumps(again, ensure_ascii=False, separators=(",", ":"))
    assert hashlib.sha256(text.encode()).hexdigest() == info["tokenizer_json_sha256"]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == tk.VOCAB == 248320
    assert 20000 < info["bpe_vocab"] <= tk.BPE_VOCAB
    for i, s in tk.SPECIALS.items():
        assert tok.token_to_id(s) == i
        assert tok.id_to_token(i) == s
    # every id decodes (a random model emits any of them); pads are text
    assert tok.decode([100000]) == "[pad100000]"
    assert tok.decode([tk.VOCAB - 1]) == f"[pad{tk.VOCAB - 1}]"
    # code and prose round-trip, never through a padding entry
    docs = tk.corpus(seed=9, n_docs=40) + ["ünïcode 🙂 tabs\there\r\n"]
    for d in docs:
        ids = tok.encode(d).ids
        assert max(ids) < info["bpe_vocab"]
        assert tok.decode(ids) == d
    # a special token in the text is the special token
    ids = tok.encode("a<|im_end|>b").ids
    assert tk.IM_END_ID in ids


def test_tokenizer_chat_template_and_qwen_class(tok_dir, tmp_path):
    """transformers loads the directory (alone, and beside a qwen3_5
    config.json, where transformers 5 picks Qwen3_5Tokenizer) with the same
    ids and the ChatML template."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    out, _ = tok_dir
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    both = tmp_path / "with-config"
    both.mkdir()
    for f in out.iterdir():
        (both / f.name).write_bytes(f.read_bytes())
    (both / "config.json").write_text(json.dumps(mm.tiny_config()))
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def f(x):\n    return x"},
    ]
    want_text = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\ndef f(x):\n    return x<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    for d in (out, both):
        t = AutoTokenizer.from_pretrained(str(d))
        assert len(t) == tk.VOCAB
        assert t.eos_token_id == tk.IM_END_ID
        got = t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert got == want_text
        for doc in tk.corpus(seed=3, n_docs=10):
            assert t.encode(doc, add_special_tokens=False) == raw.encode(doc).ids


# -- checkpoint ------------------------------------------------------------


def test_tensor_plan_of_the_9b_shape():
    """The 9B plan: ~9.7 B parameters (vision tower and MTP included), the
    published layout and inits, shards of at most 4 GiB."""
    import math

    cfg = mm.qwen9b_config()
    t = cfg["text_config"]
    assert (t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]) == (
        4096,
        32,
        248320,
    )
    assert t["layer_types"].count("linear_attention") == 24
    assert t["mtp_num_hidden_layers"] == 1
    plan = mm.tensor_plan(cfg)
    names = {n: (s, k, std) for n, s, k, std in plan}
    params = sum(math.prod(s) for _, s, _, _ in plan)
    assert 9.5e9 < params < 9.9e9
    assert names["model.language_model.embed_tokens.weight"][0] == (248320, 4096)
    assert names["lm_head.weight"][0] == (248320, 4096)
    assert names["mtp.fc.weight"][0] == (4096, 8192)
    assert names["mtp.layers.0.self_attn.q_proj.weight"][0] == (8192, 4096)
    p0 = "model.language_model.layers.0."
    assert names[p0 + "linear_attn.A_log"][1] == "a_log"
    assert names[p0 + "linear_attn.dt_bias"][1] == "ones"
    assert names[p0 + "linear_attn.norm.weight"][1] == "ones"
    assert names[p0 + "input_layernorm.weight"][1] == "zeros"
    assert names[p0 + "mlp.down_proj.weight"][2] == pytest.approx(0.02 / 8)
    shards = mm.shard_plan(plan)
    assert all(
        sum(math.prod(s) * 2 for _, s, _, _ in sh) <= mm.SHARD_BYTES for sh in shards
    )
    assert sum(len(sh) for sh in shards) == len(plan)


def test_sharded_checkpoint_reads_back(tmp_path):
    """Sharded files and the index as transformers writes them; every
    tensor readable, bf16, with the planned init."""
    import torch
    from safetensors import safe_open

    cfg = mm.tiny_config()
    res = mm.write_random_checkpoint(
        cfg, tmp_path, device="cpu", seed=1, shard_bytes=8 << 20, log=lambda s: None
    )
    assert res["shards"] > 2
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    plan = {n: (s, k) for n, s, k, _ in mm.tensor_plan(cfg)}
    assert set(idx["weight_map"]) == set(plan)
    assert idx["metadata"]["total_size"] == res["bytes"]
    for fname in set(idx["weight_map"].values()):
        with safe_open(str(tmp_path / fname), "pt") as f:
            for k in f.keys():  # noqa: SIM118
                t = f.get_tensor(k)
                assert idx["weight_map"][k] == fname
                assert t.dtype == torch.bfloat16 and tuple(t.shape) == plan[k][0]
                kind = plan[k][1]
                if kind == "zeros":
                    assert not t.any()
                elif kind == "ones":
                    assert (t == 1).all()
                elif kind == "a_log":
                    assert (t.float() >= 0).all() and (t.float() <= 2.78).all()
                elif t.numel() > 1000:
                    assert 0.001 < t.float().std() < 0.05


@pytest.fixture(scope="module")
def tiny9(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny9") / "m"
    mm.write_qwen9b(out, device="cpu", cfg=mm.tiny_config(), log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def fastapply_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fa") / "m"
    mm.write_fastapply(out)
    return out


def test_tiny_9b_dir_loads_in_transformers(tiny9):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    files = {p.name for p in tiny9.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    } <= files
    gen = json.loads((tiny9 / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tk.IM_END_ID, tk.ENDOFTEXT_ID]
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(tiny9), dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]


VLLM_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
from vllm.config import DeviceConfig, ModelConfig, VllmConfig
from vllm.renderers.params import ChatParams
from vllm.renderers.registry import renderer_from_config
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from harness import fastapply as fa
from serving.make_model import prompt_text

fa_dir, tiny9 = sys.argv[1], sys.argv[2]
out = {}

def renderer(model, tok):
    mc = ModelConfig(model=model, tokenizer=tok, language_model_only=True,
                     limit_mm_per_prompt={"image": 0, "video": 0},
                     max_model_len=2048)
    return renderer_from_config(
        VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu")))

gen = ChatParams(chat_template_kwargs={"add_generation_prompt": True})
for name, tok in (("subdir", fa_dir + "/tokenizer"), ("model_dir", fa_dir)):
    r = renderer(fa_dir, tok)
    rows = []
    for p, ans in fa.make_eval_set(6, 0):
        text = prompt_text(p)
        _, chat = r.render_chat([[{"role": "user", "content": text}]], gen)
        parts = [{"type": "text", "text": text}]
        _, chat2 = r.render_chat([[{"role": "user", "content": parts}]], gen)
        cmpl = r.render_cmpl([{"prompt": text}])
        req = SimpleNamespace(request_id="x", prompt_token_ids=list(p),
                              sampling_params=SamplingParams(max_tokens=200))
        det = IncrementalDetokenizer.from_new_request(r.get_tokenizer(), req)
        for i, t in enumerate(ans):
            det.update([t], stop_terminated=i == len(ans) - 1)
        rows.append({
            "chat": chat[0]["prompt_token_ids"] == list(p),
            "chat_parts": chat2[0]["prompt_token_ids"] == list(p),
            "cmpl": cmpl[0]["prompt_token_ids"] == list(p),
            "text": det.get_next_output_text(True, False)
                    == " " + prompt_text(ans[:-1]),
        })
    out[name] = rows
r = renderer(tiny9, tiny9)
msgs = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def f(x):\n    return x"}]
_, chat = r.render_chat([msgs], gen)
out["tiny9_chat"] = chat[0]["prompt_token_ids"]
out["tiny9_cmpl"] = r.render_cmpl([{"prompt": "Hello world"}])[0]["prompt_token_ids"]
print("RESULT " + json.dumps(out), flush=True)
"""


def test_vllm_request_path_round_trips(fastapply_dir, tiny9, tmp_path):
    """vLLM's own renderer (what the API server runs before the engine)
    maps a fast-apply prompt sent as text, over completions and over chat
    (string or OpenAI parts), to exactly the prompt's ids, and vLLM's
    detokenizer turns the answer's ids into `` t<id> ...`` text, when the
    tokenizer is served from ``OUT/tokenizer``. From the model directory
    itself transformers 5 loads Qwen3_5Tokenizer and every word is lost
    (why gpu_serve.sh passes ``--tokenizer``). The 9B-shaped directory's
    chat prompt is the ChatML text encoded by our BPE."""
    from tokenizers import Tokenizer

    script = tmp_path / "check.py"
    script.write_text(VLLM_SCRIPT)
    res = _run_result(
        [PY, str(script), str(fastapply_dir), str(tiny9)],
        CUDA_VISIBLE_DEVICES="",
        VLLM_LOGGING_LEVEL="ERROR",
    )
    for row in res["subdir"]:
        assert row == {"chat": True, "chat_parts": True, "cmpl": True, "text": True}
    assert not any(r["cmpl"] or r["chat"] for r in res["model_dir"])
    raw = Tokenizer.from_file(str(tiny9 / "tokenizer.json"))
    want = raw.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "def f(x):\n    return x<|im_end|>\n<|im_start|>assistant\n"
    ).ids
    assert res["tiny9_chat"] == want
    assert res["tiny9_cmpl"] == raw.encode("Hello world").ids


def test_vllm_loads_every_tiny_9b_parameter(tiny9):
    """vLLM's Qwen3_5ForConditionalGeneration and Qwen3_5MTP, built on the
    CPU, take every tensor of the written checkpoint (the harness's load
    check, tests/test_harness_models_more.py, run as its subprocess)."""
    specs = [
        ["q", str(tiny9), arch, "bfloat16"]
        for arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MTP")
    ]
    res = _run_result(
        [PY, str(REPO / "tests" / "test_harness_models_more.py"), json.dumps(specs)],
        HSFORK_CPU_TESTBED="0",
        CUDA_VISIBLE_DEVICES="",
        VLLM_LOGGING_LEVEL="ERROR",
    )
    for r in res:
        if r["skip"]:
            pytest.skip(r["skip"])
        assert r["error"] is None, r
        assert r["unloaded"] == r["unexpected"] == r["nan"] == [], r


# -- serve_check ---------------------------------------------------------------


def test_parse_metrics_and_delta():
    lab = 'engine="0",model_name="m"'
    pp = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    text = f"""
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{{{lab}}} 10.0
vllm:spec_decode_num_drafts_created{{{lab}}} 1.7e9
vllm:spec_decode_num_draft_tokens_total{{{lab}}} 30.0
vllm:spec_decode_num_accepted_tokens_total{{{lab}}} 18.0
{pp}{{{lab},position="0"}} 9.0
{pp}{{{lab},position="1"}} 6.0
{pp}{{{lab},position="2"}} 3.0
vllm:generation_tokens_total{{{lab}}} 99.0
"""
    after = metrics.parse_metrics(text)
    assert after["found"] and after["drafts"] == 10 and after["accepted"] == 18
    before = metrics.parse_metrics(text.replace("10.0", "4.0").replace("18.0", "6.0"))
    d = metrics.metrics_delta(before, after)
    assert d["drafts"] == 6 and d["accepted"] == 12
    assert d["mean_acceptance_length"] == 3.0
    assert metrics.metrics_delta(None, metrics.parse_metrics("vllm:x_total 1")) is None


def _res(ids, text=None, finish="length", top=None):
    r = client.new_result()
    r.update(
        token_ids=ids,
        text=text or " ".join(map(str, ids)),
        finish_reason=finish,
        top=top or [],
    )
    return r


def test_compare_judges_first_difference():
    reqs = prompts.build_requests("fastapply", 4, 0, 128)
    ref = [
        _res(
            [1, 2, 3],
            top=[[[1, -0.1], [9, -3]], [[2, -0.1], [7, -0.12]], [[3, -0.1], [4, -2]]],
        )
        for _ in reqs
    ]
    cand = [
        _res([1, 2, 3]),  # match
        _res([1, 7, 5]),  # second choice at a 0.02 gap: tie
        _res([1, 2, 4]),  # second choice at a 1.9 gap: divergence
        _res([1, 2, 3], text="1 2 3 extra"),  # same ids, other text
    ]
    rows = cmp.compare(reqs, ref, cand, 0.05)
    cmp.finalize(rows)
    assert [r["status"] for r in rows] == ["match", "tie", "diverged", "diverged"]
    assert rows[1]["first"]["gap"] == pytest.approx(0.02)
    s = cmp.summarize(rows, 4)
    assert s["verdict"] == "FAIL" and s["diverged"] == 2
    assert cmp.summarize(rows[:2], 2)["verdict"] == "PASS-TIES"
    assert cmp.summarize(rows[:1], 2)["verdict"] == "FAIL"  # one missing


def test_first_difference_is_judged_from_the_reference_top_k():
    """A candidate that took the reference's third choice, 0.03 below its
    first, is a tie; one outside the returned top-k is at least as far as
    the last of them (harness.compare.verify_run); a margin measured later
    (finalize's) replaces the one compare judged with."""
    reqs = prompts.build_requests("fastapply", 3, 0, 128)
    top = [[[5, -0.5], [6, -0.51], [7, -0.53], [8, -3.0]]]
    ref = [_res([5], top=top) for _ in reqs]
    cand = [_res([7]), _res([9]), _res([8])]
    rows = cmp.compare(reqs, ref, cand, 0.05)
    firsts = [r["first"] for r in rows]
    assert [f["gap"] for f in firsts] == pytest.approx([0.03, 2.5, 2.5])
    assert [f["tie"] for f in firsts] == [True, False, False]
    cmp.finalize(rows, margin=3.0)
    assert [r["status"] for r in rows] == ["tie", "tie", "tie"]
    assert prompts.TOP_K >= 4


def test_teacher_forced_judgement_of_a_differing_answer():
    """Every candidate token the reference prefill's choice: a tie when the
    two answers have the same length and finish and the reference's own run
    differed at a near-tie (its run broke the tie the other way); diverged
    when one stopped early or the reference was sure of its own token."""

    def row(first_gap, ref_tokens=8, cand_tokens=8, same_finish=True):
        return {
            "status": "differs",
            "ref_tokens": ref_tokens,
            "cand_tokens": cand_tokens,
            "same_finish": same_finish,
            "first": {"pos": 3, "gap": first_gap},
        }

    consistent = [(j, 0.0) for j in range(8)]
    margin = 0.5
    r = row(0.125)
    cmp.judge_forced(r, consistent, margin)
    assert r["status"] == "tie" and "near-tie" in r["reason"]
    for r in (row(0.125, cand_tokens=5), row(0.125, same_finish=False), row(0.9)):
        cmp.judge_forced(r, consistent, margin)
        assert r["status"] == "diverged", r
        assert r["reason"] == "greedy-consistent tokens, different length or stop"
    r = row(0.0)
    cmp.judge_forced(r, [(0, 0.0), (1, 0.3), (2, None)], margin)
    assert r["status"] == "diverged" and r["ties"] == [{"pos": 1, "gap": 0.3}]
    assert r["divergences"] == [{"pos": 2, "gap": None}]
    r = row(0.0)
    cmp.judge_forced(r, [(0, 0.0), (1, 0.3)], margin)
    assert r["status"] == "tie" and "reason" not in r


def test_request_sets_are_heterogeneous_and_fixed():
    a = prompts.build_requests("text", 64, 0, 128)
    assert [asdict_(r) for r in a] == [asdict_(r) for r in prompts.text_requests(64, 0)]
    kinds = {r.kind for r in a}
    assert kinds == {
        "completions-full",
        "completions-stream",
        "chat-full",
        "chat-stream",
    }
    assert len({r.max_tokens for r in a}) > 10
    assert any(r.stop for r in a)
    assert any(r.messages and len(r.messages) == 4 for r in a)
    f = prompts.build_requests("fastapply", 8, 0, 128)
    p, ans = fa.make_eval_set(8, 0)[3]
    assert (f[3].prompt or f[3].messages[0]["content"]) == mm.prompt_text(p)
    assert f[3].expected == mm.prompt_text(ans[:-1])


def asdict_(r):
    from dataclasses import asdict

    return asdict(r)


def _serve_check(tmp_path, *args, prompts="text", mode="model", n=16):
    out = tmp_path / "out"
    argv = [
        "--model",
        str(tmp_path / "model"),
        "--out",
        str(out),
        "--prompts",
        prompts,
        "--n",
        str(n),
        "--concurrency",
        "8",
        "--max-tokens",
        "40",
        # no deadline: each step waits for its condition (tests of the
        # deadline pass their own after these)
        "--deadline",
        "0",
        "--stagger",
        "0",
        "--port",
        str(free_port()),
        "--engine-args",
        "",
        "--vllm-cmd",
        f"{FAKE} --fake-mode {mode}",
        *args,
    ]
    proc = run_until_done(
        [PY, "-m", "serving.serve_check", *argv],
        what="serve_check against fake servers",
        cwd=REPO,
        env=subprocess_env(),
    )
    report = json.loads((out / "serve_check.json").read_text())
    return proc, report, out


def test_serve_check_against_fake_servers(tmp_path):
    """Launch, health, 16 requests x 4 servers over both endpoints and both
    stream modes, metrics, teacher-forced judging, report, shutdown: a right
    candidate passes, one that flips only near-ties passes with ties, one
    that emits a decisive wrong token fails, and the exit status says so."""
    proc, report, out = _serve_check(
        tmp_path,
        "--server",
        "ref=none",
        "--server",
        "good=ngram",
        "--server",
        "ties=mtp",
        "--server",
        "bad=ngram8",
        "--server-args",
        "ties=--fake-perturb ties",
        "--server-args",
        "bad=--fake-perturb decisive",
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    cands = report["candidates"]
    assert cands["good"]["summary"]["verdict"] == "PASS"
    assert cands["good"]["summary"]["match"] == 16
    assert cands["ties"]["summary"]["verdict"] == "PASS-TIES"
    assert cands["ties"]["summary"]["tie"] > 0
    bad = cands["bad"]["summary"]
    assert bad["verdict"] == "FAIL" and bad["diverged"] > 0 and bad["error"] == 0
    for row in cands["bad"]["rows"]:
        if row["status"] == "diverged":
            assert row["judged"] == "teacher-forced"
            assert row["divergences"][0]["pos"] == 5
    servers = {s["name"]: s for s in report["servers"]}
    assert servers["ref"]["spec_metrics"] is None
    m = servers["good"]["spec_metrics"]
    assert m["mean_acceptance_length"] == 4.0 and m["drafts"] > 0
    assert all(
        s["errors"] == 0 and s["exit_code"] is not None for s in servers.values()
    )
    # each kind of request went to every server and came back whole
    for r in servers["ref"]["results"]:
        assert r["token_ids"] and r["prompt_token_ids"] and r["finish_reason"]
        assert r["top"] and len(r["top"]) == len(r["token_ids"])
    streamed = [
        r
        for q, r in zip(report["requests"], servers["good"]["results"], strict=True)
        if q["stream"]
    ]
    assert streamed and all(r["chunks"] > 1 for r in streamed)
    md = (out / "serve_check.md").read_text()
    assert "Verdict: **FAIL**" in md and "| bad |" in md
    assert (out / "logs" / "ref.log").exists()


def test_serve_check_fastapply_failures_and_exact_match(tmp_path):
    """Fast-apply prompts: the oracle fake answers every request right
    (exact match 1.0, PASS); a candidate answering HTTP 500 to some
    requests fails; a candidate that crashes at its first request fails,
    one that dies before it is healthy is reported as failed to start, and
    the others are still compared."""
    proc, report, _ = _serve_check(
        tmp_path,
        "--server",
        "ref=none",
        "--server",
        "good=ngram",
        "--server",
        "flaky=mtp",
        "--server",
        "crash=mtp",
        "--server-args",
        "flaky=--fake-perturb fail",
        "--server-args",
        "crash=--fake-crash-on-request",
        "--server",
        "early=mtp",
        "--server-args",
        "early=--fake-startup-s 30 --fake-exit-s 0.2",
        "--max-tokens",
        "128",
        prompts="fastapply",
        mode="fastapply",
    )
    assert proc.returncode == 1
    servers = {s["name"]: s for s in report["servers"]}
    assert servers["ref"]["exact_match"] == 1.0
    assert servers["good"]["exact_match"] == 1.0
    c = report["candidates"]
    assert c["good"]["summary"]["verdict"] == "PASS"
    assert c["flaky"]["summary"]["verdict"] == "FAIL"
    assert c["flaky"]["summary"]["error"] > 0
    # died at its first request: every request an error
    assert c["crash"]["summary"]["verdict"] == "FAIL"
    assert c["crash"]["summary"]["error"] > 0
    # died before it was healthy: reported as failed to start
    assert "early" in report["failed"]


def test_serve_check_usage_errors(tmp_path):
    proc = run_until_done(
        [PY, "-m", "serving.serve_check", "--model", "x", "--out", str(tmp_path)]
        + ["--server", "ref=none"],
        what="serve_check with one server (a usage error)",
        cwd=REPO,
        env=subprocess_env(),
    )
    assert proc.returncode == 2 and "candidate" in proc.stderr
    with pytest.raises(CheckError):
        sv.parse_spec("ngrm")
    assert sv.parse_spec('{"method": "mtp", "num_speculative_tokens": 2}')["method"]
    assert sv.parse_spec("none") is None


# -- lm-eval ---------------------------------------------------------------

TASK = REPO / "serving" / "lm_eval_task"


def test_lm_eval_task_data():
    """The JSONL is the generator's (64 held-out examples, seed 0), its
    prompts and answers encode to the example's ids with the fixture's
    tokenizer, and the YAML names the data loader and the metric."""
    import yaml
    from tokenizers import Tokenizer

    sys.path.insert(0, str(TASK))
    try:
        import utils as task_utils  # the task's own module
    finally:
        sys.path.remove(str(TASK))
    rows = task_utils.read()
    assert rows == task_utils.rows(64, 0)
    tok = Tokenizer.from_file(str(REPO / "fixtures" / "fastapply" / "tokenizer.json"))
    for row, (p, ans) in zip(rows, fa.make_eval_set(64, 0), strict=True):
        assert tok.encode(row["prompt"]).ids == p
        assert tok.encode(row["answer"]).ids == ans[:-1]

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: node.value)
    cfg = yaml.load((TASK / "fastapply.yaml").read_text(), Loader=Loader)
    assert cfg["task"] == "fastapply" and cfg["output_type"] == "generate_until"
    assert cfg["custom_dataset"] == "utils.load_fastapply"
    assert cfg["metric_list"][0]["metric"] == "exact_match"
    assert cfg["generation_kwargs"]["max_gen_toks"] >= max(
        r["answer_tokens"] for r in rows
    )


@pytest.fixture(scope="module")
def fake_fastapply_servers():
    procs, urls = [], {}
    for name, perturb in (("good", "none"), ("bad", "decisive")):
        port = free_port()
        procs.append(
            subprocess.Popen(
                [
                    PY,
                    "-m",
                    "serving.fake_server",
                    "m",
                    "--port",
                    str(port),
                    "--fake-mode",
                    "fastapply",
                    "--fake-perturb",
                    perturb,
                    "--served-model-name",
                    "model",
                ],
                cwd=REPO,
                env=subprocess_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        urls[name] = f"http://127.0.0.1:{port}"
    for (name, url), p in zip(urls.items(), procs, strict=True):
        wait_until_healthy(url, p, what=f"fake fast-apply server {name!r}")
    yield urls
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.parametrize(
    "server,chat,want",
    [("good", False, 1.0), ("good", True, 1.0), ("bad", False, None)],
)
def test_lm_eval_runs_the_task(fake_fastapply_servers, tmp_path, server, chat, want):
    """lm-eval (a test bed requirement, the version the GPU host installs)
    runs the task with its local-completions / local-chat-completions models
    against the fake fast-apply oracle: exact match 1.0 (the server's leading
    space ignored), below 1.0 for a wrong server."""
    env = subprocess_env()
    a = sc.parse_args(
        [
            "--model",
            "m",
            "--lm-eval",
            str(TASK),
            "--lm-eval-cmd",
            f"{PY} -m lm_eval",
            "--lm-eval-concurrency",
            "8",
        ]
    )
    srv = sv.ServerSpec("x", None, url=fake_fastapply_servers[server])
    cmd = lmeval.lm_eval_command(a, srv, tmp_path, chat)
    proc = run_until_done(
        cmd, what=f"lm-eval against the {server!r} fake", cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = lmeval.read_lm_eval(tmp_path, "fastapply")
    assert res["sample_len"] == 64
    em = res["exact_match,none"]
    if want is None:
        assert 0.5 < em < 1.0
    else:
        assert em == want


# -- the GPU script, dry --------------------------------------------------------


def test_install_lm_eval_pins_the_tested_versions():
    """The wheels install_lm_eval.sh pins for the GPU host are the versions
    the test bed installed (tests/requirements-cpu.txt's lm_eval and what it
    resolved to), so the host runs the lm-eval tested here; and, where the
    ignored .whl-lmeval folder was downloaded, exactly those wheels."""
    from importlib.metadata import version

    text = (REPO / "serving" / "install_lm_eval.sh").read_text()
    pins = [ln.strip() for ln in text.split("WHEELS=(", 1)[1].split(")", 1)[0].split()]
    assert "lm_eval==0.4.13" in pins
    want = {p.split("==")[0]: p.split("==")[1] for p in pins}
    assert {name: version(name) for name in want} == want

    def norm(s):
        return s.lower().replace("-", "_")

    whl = REPO / ".whl-lmeval"
    if whl.is_dir():
        have = {
            (norm(f.name.split("-")[0]), f.name.split("-")[1])
            for f in whl.glob("*.whl")
        }
        assert have == {(norm(k), v) for k, v in want.items()}


@pytest.mark.parametrize("step", ["fastapply", "qwen9b"])
def test_gpu_serve_dry_run(tmp_path, step):
    """gpu_serve.sh with fake servers, the CPU and the shrunk 9B config:
    the step's three result files land in $OUT and the exit status is 0."""
    out = tmp_path / "out"
    mode = "fastapply" if step == "fastapply" else "model"
    env = subprocess_env(
        SERVE_BUNDLE_ENV="none",
        SERVE_VLLM_CMD=f"{FAKE} --fake-mode {mode}",
        PYTHON=PY,
        OUT=str(out),
        SERVE_WORK=str(tmp_path / "work"),
        SERVE_MODEL_DIR=str(tmp_path / "model"),
        SERVE_DEVICE="cpu",
        SERVE_TINY="1",
        SERVE_BUDGET="0",  # no budget: the dry run waits for each step
        SERVE_ARGS=f"--port {free_port()} --n 16 --stagger 0",
    )
    proc = run_until_done(
        ["bash", str(REPO / "serving" / "gpu_serve.sh"), step],
        what=f"gpu_serve.sh {step} (dry run)",
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{step}.md", f"{step}.json", f"{step}-logs.tgz"]
    )
    assert "Verdict: **PASS**" in (out / f"{step}.md").read_text()


def test_serve_check_reference_not_ready(tmp_path):
    """A reference that never becomes healthy: status 3, the report says
    ERROR, and the servers are gone."""
    proc, report, out = _serve_check(
        tmp_path,
        "--server",
        "ref=none",
        "--server",
        "cand=ngram",
        "--server-args",
        "ref=--fake-startup-s 1000",
        "--deadline",
        "8",
    )
    assert proc.returncode == 3
    assert report["verdict"] == "ERROR" and "ref" in report["failed"]
    assert "Verdict: **ERROR**" in (out / "serve_check.md").read_text()


def test_serve_check_negative_controls(tmp_path):
    """``--control``: a candidate expected to fail (upstream v0.26.0 on the
    GPU host) is reported as such and does not decide the exit status; a
    control that passes is flagged; ``--server-cmd`` runs it from another
    command."""
    proc, report, out = _serve_check(
        tmp_path,
        "--server",
        "ref=none",
        "--server",
        "good=ngram",
        "--server",
        "up=ngram",
        "--server",
        "up2=ngram",
        "--server-args",
        "up=--fake-perturb decisive",
        "--server-cmd",
        f"up2=env SERVE_TEST_MARK=1 {FAKE} --fake-mode model",
        "--control",
        "up",
        "--control",
        "up2",
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    c = report["candidates"]
    assert c["up"]["control"] and c["up"]["summary"]["verdict"] == "FAIL"
    assert c["up"]["summary"]["control_outcome"] == "expected-fail"
    assert c["up2"]["summary"]["control_outcome"].startswith("unexpected-pass")
    assert report["verdict"] == "PASS"
    assert "env SERVE_TEST_MARK=1" in (out / "logs" / "up2.log").read_text()
    assert "| up (control) |" in (out / "serve_check.md").read_text()


def test_vllm_serve_cli_accepts_the_flags(qwen35_serve_flags, parse_serve_args):
    """The ``vllm serve`` command lines gpu_serve.sh makes (the Qwen3.5
    flags of serving/host_env.sh, each attention backend, each speculative
    preset) parse with the fork's own serve parser."""
    qwen35 = qwen35_serve_flags
    cmds, want = [], []
    for attn, spec, extra in (
        ("TRITON_ATTN", "ngram", "--tokenizer /m/tokenizer"),
        ("FLASH_ATTN", "ngram8", "--enforce-eager"),
        ("FLASH_ATTN", "mtp", ""),
        ("TRITON_ATTN", "none", ""),
    ):
        engine = (
            f"{qwen35} --disable-uvicorn-access-log {extra} --attention-backend {attn}"
        )
        a = sc.parse_args(
            ["--model", "/m", "--engine-args", engine, "--vllm-cmd", "vllm"]
        )
        cmd = sv.server_command(a, sv.ServerSpec("x", sv.parse_spec(spec), port=8100))
        assert cmd[:3] == ["vllm", "serve", "/m"]
        cmds.append(cmd[2:])
        want.append((attn, sv.PRESETS[spec]))
    res = parse_serve_args(
        cmds,
        ["model_tag", "attention_backend", "gdn_prefill_backend",
         "language_model_only", "limit_mm_per_prompt", "kv_cache_memory_bytes",
         "speculative_config", "served_model_name", "disable_uvicorn_access_log"],
    )  # fmt: skip
    for got, (attn, spec) in zip(res, want, strict=True):
        assert got["model_tag"] == "/m"
        assert got["attention_backend"].endswith(attn)
        assert got["gdn_prefill_backend"] == "triton"
        assert got["language_model_only"] is True
        assert got["limit_mm_per_prompt"] == {"image": 0, "video": 0}
        assert got["kv_cache_memory_bytes"] == 4_000_000_000
        assert got["speculative_config"] == spec
        assert got["served_model_name"] == ["model"]
        assert got["disable_uvicorn_access_log"] is True


# -- the package's entry point ----------------------------------------------


@pytest.mark.parametrize("package", ["serving", "benchmarks"])
def test_package_entry_point_lists_and_dispatches_every_job(package, capsys):
    """``python -m PACKAGE --help`` names every job with its module; each
    job's module has the ``main`` it dispatches to; a job's ``--help`` is
    that module's own; an unknown job is a usage error."""
    import importlib

    # benchmarks/__main__.py guards its sys.exit; serving's is serving.cli's
    cli = importlib.import_module(
        "serving.cli" if package == "serving" else "benchmarks.__main__"
    )
    assert "--help" in importlib.import_module(package).__doc__
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for job in cli.JOBS:
        assert f"  {job.name} " in text and f"[{job.module}]" in text.replace(
            "\n      ", " "
        )
        mod = importlib.import_module(job.module)
        assert callable(mod.main), job.module
    assert cli.main([]) == 2
    assert cli.main(["no-such-job"]) == 2
    assert "unknown job 'no-such-job'" in capsys.readouterr().err
    first = cli.JOBS[0]
    try:
        rc = cli.main([first.name, "--help"])
    except SystemExit as e:  # argparse's --help
        rc = e.code
    assert rc == 0
    assert first.module.split(".")[-1] in capsys.readouterr().out
    proc = run_until_done(
        [PY, "-m", package, "--help"],
        what=f"python -m {package} --help",
        cwd=REPO,
        env=subprocess_env(),
    )
    assert proc.returncode == 0 and proc.stdout == text


def test_shell_scripts_name_modules_and_functions_that_exist():
    """Every ``python -m serving.X`` / ``benchmarks.X`` and every ``from
    serving.X import Y`` in the GPU scripts (whose GPU paths no CPU test
    runs) names a module that has a ``main`` or the imported names."""
    import importlib
    import re

    scripts = [
        p
        for d in ("serving", "benchmarks", "harness", "hsfork")
        for p in sorted((REPO / d).glob("*.sh"))
    ]
    seen = 0
    for path in scripts:
        text = path.read_text()
        for mod in re.findall(r"-m ((?:serving|benchmarks)\.\w+)", text):
            assert callable(importlib.import_module(mod).main), (path.name, mod)
            seen += 1
        pat = r"from ((?:serving|benchmarks)\.\w+) import ([\w, ]+)"
        for mod, names in re.findall(pat, text):
            m = importlib.import_module(mod)
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(m, name), (path.name, mod, name)
                seen += 1
    assert seen, "no module named in the scripts: the patterns are stale"
