# SPDX-License-Identifier: Apache-2.0
"""The fast-apply fixture: task generator, curriculum, n-gram replay,
checkpoint layout (transformers on the CPU)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import fastapply as fa
from harness.models import EOS_ID, FIRST_SPECIAL_ID

TINY = fa.ModelSize(hidden=64, intermediate=128, layers=2, heads=2, head_dim=32)


def _parse(prompt):
    """(renames, span) read back from a prompt."""
    mapping = {}
    i = 0
    while prompt[i] == fa.RENAME:
        mapping[prompt[i + 1]] = prompt[i + 2]
        i += 3
    assert prompt[i] == fa.FILE
    span = prompt[prompt.index(fa.SPAN) + 1 : prompt.index(fa.END)]
    return mapping, span, i


def test_generator_is_deterministic():
    a = fa.make_eval_set(12, seed=0)
    assert a == fa.make_eval_set(12, seed=0)
    assert a != fa.make_eval_set(12, seed=1)
    r1, r2 = random.Random(5), random.Random(5)
    assert [fa.make_example(r1) for _ in range(4)] == [
        fa.make_example(r2) for _ in range(4)
    ]


def test_edits_are_applied_and_answer_ends_with_eos():
    for prompt, answer in fa.make_eval_set(64, seed=3):
        mapping, span, body = _parse(prompt)
        assert 1 <= len(mapping) <= 3
        assert answer == [mapping.get(t, t) for t in span] + [EOS_ID]
        assert answer.count(EOS_ID) == 1 and EOS_ID not in prompt
        for old, new in mapping.items():
            assert old in span  # every rename changes the answer
            assert new not in prompt[body:]  # new names are fresh
            assert old not in answer
        assert all(0 <= t < FIRST_SPECIAL_ID for t in prompt)
        assert prompt[-1] == fa.ANSWER
        assert 41 <= len(answer) <= 121 and 50 <= len(prompt) <= 300


def test_code_is_deterministic_at_order():
    for prompt, _ in fa.make_eval_set(32, seed=4):
        code = prompt[prompt.index(fa.FILE) : prompt.index(fa.ANSWER)]
        nxt = {}
        for i in range(fa.ORDER, len(code)):
            ctx = tuple(code[i - fa.ORDER : i])
            assert nxt.setdefault(ctx, code[i]) == code[i]


def test_code_recurs_like_code():
    # prompt lookup needs recurring n-grams: most answer bigrams are in the
    # prompt, and some prompt bigrams occur more than once
    hits = total = repeats = 0
    for prompt, answer in fa.make_eval_set(16, seed=5):
        grams = list(zip(prompt, prompt[1:], strict=False))
        repeats += len(grams) - len(set(grams))
        for g in zip(answer, answer[1:-1], strict=False):
            hits += g in set(grams)
            total += 1
    assert hits / total > 0.6 and repeats > 100


def test_detok_reads_like_code():
    prompt, _ = fa.make_example(random.Random(0))
    text = fa.detok(prompt)
    assert "<span>" in text and "<answer>" in text
    assert re.search(r"v\d+ = ", text)


def test_curriculum_grows_to_full():
    easy, full = fa.difficulty(0.0), fa.difficulty(1.0)
    assert easy.span_max <= 12 and easy.ctx_max == 0 and easy.renames_max == 0
    assert full.span_max == fa.FULL.span_max and full.ctx_max == fa.FULL.ctx_max
    assert full.renames_max == fa.FULL.renames_max
    levels = [fa.difficulty(x / 10) for x in range(11)]
    assert all(
        a.span_max <= b.span_max for a, b in zip(levels, levels[1:], strict=False)
    )
    rng = random.Random(0)
    for _ in range(20):
        d = fa.sample_difficulty(rng, fa.difficulty(0.3))
        _, answer = fa.make_example(rng, d)
        assert len(answer) <= d.span_max + 1


def test_ngram_draft_semantics():
    # longest suffix match wins, earliest occurrence of it, up to k tokens
    toks = [1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3]
    assert fa.ngram_draft(toks, 2, 10, 3) == [9, 2, 3]
    assert fa.ngram_draft([7, 8, 1, 2], 2, 10, 4) == []
    assert fa.ngram_draft([5, 6, 7, 5, 6], 2, 10, 8) == [7, 5, 6]


def _vllm_ngram_finder():
    """vLLM's own n-gram matcher; without numba (the CPU test bed), its
    source run as plain Python."""
    import importlib.util

    np = pytest.importorskip("numpy")
    name = "_find_longest_matched_ngram_and_propose_tokens"
    try:
        from vllm.v1.spec_decode import ngram_proposer

        return getattr(ngram_proposer, name), np
    except ImportError:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("vllm is not installed")
        path = Path(spec.submodule_search_locations[0])
        src = (path / "v1" / "spec_decode" / "ngram_proposer.py").read_text()
        body = src[src.index(f"def {name}(") :].split("\n@", 1)[0]
        ns = {"np": np}
        exec(body, ns)
        return ns[name], np


def test_ngram_draft_matches_vllm():
    find, np = _vllm_ngram_finder()
    rng = random.Random(0)
    for _ in range(500):
        toks = [rng.randrange(rng.choice([2, 4, 8])) for _ in range(rng.randint(1, 50))]
        k, lo, hi = rng.randint(1, 70), rng.randint(1, 3), rng.randint(3, 10)
        ref = find(np.array(toks, dtype=np.int32), lo, hi, 4096, k).tolist()
        assert fa.ngram_draft(toks, lo, hi, k) == ref, (toks, k, lo, hi)


def test_simulated_ngram_mix():
    prompt = [3, 4, 5, 6, 7, 8, 9, 10]
    out = [3, 4, 5, 6, 7, 8, 11, EOS_ID]
    # 3 and 4 without drafts; "3 4" drafts 5 6 7 8 9: four accepted, 11
    # instead of 9; then EOS, no draft for "8 11"
    s = fa.simulate_ngram(prompt, out, k=5)
    assert (s["steps"], s["zero"], s["partial"], s["full"]) == (4, 3, 1, 0)
    assert s["accepted"] == 4
    s = fa.simulate_ngram(prompt, out, k=4)
    assert (s["steps"], s["zero"], s["partial"], s["full"]) == (4, 3, 0, 1)
    stats = fa.simulate_set(fa.make_eval_set(16, seed=0), k=8)
    assert min(stats["zero"], stats["full"], stats["partial"]) > 0


def test_exact_match():
    r = fa.exact_match([[1, 2, EOS_ID], [1, 3, EOS_ID]], [[1, 2, EOS_ID]] * 2)
    assert r["exact_match"] == 0.5 and r["n"] == 2
    assert r["prefix_tokens"] == pytest.approx(4 / 6)
    # stopping early or running past EOS is a miss
    assert fa.exact_match([[1, 2]], [[1, 2, EOS_ID]])["exact_match"] == 0.0


def test_force_torch_gdn_unwraps_kernel_bindings(monkeypatch):
    import functools

    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    fa.force_torch_gdn()
    ref = m.torch_chunk_gated_delta_rule

    @functools.wraps(ref)
    def bound(*args, **kwargs):  # what a kernel binding looks like
        raise AssertionError("kernel called")

    monkeypatch.setattr(m, "torch_chunk_gated_delta_rule", bound)
    fa.force_torch_gdn()
    assert m.torch_chunk_gated_delta_rule is ref


def _shape(name: str, layer_types) -> str:
    m = re.match(r"(model\.language_model\.layers\.)(\d+)(\..*)", name)
    if m:
        return m.group(1) + layer_types[int(m.group(2))] + m.group(3)
    return name


def test_checkpoint_loads_and_matches_write_model_layout(tmp_path):
    import json

    import torch
    from safetensors import safe_open

    from harness.models import write_model

    logs = []
    res = fa.train(tmp_path / "fa", steps=40, device="cpu", batch=8, size=TINY,
                   lr=3e-3, warmup=10, eval_n=2, log_every=20,
                   log=logs.append)  # fmt: skip
    rows = [json.loads(x) for x in logs]
    assert [r["step"] for r in rows[:2]] == [20, 40] and "eval" in rows[2]
    # short copies are learned from the start: the loss leaves uniform
    assert rows[1]["loss"] < rows[0]["loss"] < 5.6 and rows[1]["loss"] < 4.5
    assert 0 <= res["exact_match"] <= 1
    model = fa.load_model(tmp_path / "fa")
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    # greedy decode through the checkpoint, and the teacher-forced metric
    ex = fa.make_eval_set(2, seed=0)
    assert len(fa.greedy(model, [p for p, _ in ex], max_new=4)) == 2
    assert 0 <= fa.token_accuracy(model, ex) <= 1
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ex[0][0]])).logits
    assert logits.shape[-1] == 256 and torch.isfinite(logits).all()

    cfg = json.loads((tmp_path / "fa" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    types = cfg["text_config"]["layer_types"]
    assert types.count("linear_attention") == types.count("full_attention")
    ref = write_model("qwen3_5", tmp_path / "ref")
    ref_types = json.loads((ref / "config.json").read_text())["text_config"][
        "layer_types"
    ]

    def names(path, lt):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {_shape(k, lt) for k in f.keys()}  # noqa: SIM118

    assert names(tmp_path / "fa", types) == names(ref, ref_types)
    info = json.loads((tmp_path / "fa" / "fixture.json").read_text())
    assert info["kind"] == "fastapply" and "eval_transformers" in info


def test_mtp_head_trains_and_is_written_under_vllm_names(tmp_path):
    import json

    import torch
    from safetensors.torch import load_file

    fa.train(tmp_path / "fa", steps=2, device="cpu", batch=4, size=TINY,
             warmup=1, eval_n=1, log=lambda _: None)  # fmt: skip
    before = load_file(str(tmp_path / "fa" / "model.safetensors"))
    model = fa.load_model(tmp_path / "fa")
    head = fa.mtp_head(model.config.text_config)
    # the head's names are the checkpoint's mtp.* names (what vLLM loads)
    assert set(fa.mtp_tensors(head)) == {k for k in before if k.startswith("mtp.")}
    inp = torch.tensor([fa.make_eval_set(1, seed=0)[0][0][:20]])
    logits = fa.mtp_forward(head, fa._LM(model), inp)
    # position i predicts token i+2: one position fewer than the input
    assert logits.shape == (1, 19, 256)

    logs = []
    res = fa.train_mtp(tmp_path / "fa", device="cpu", budget_s=3, batch=4,
                       log=logs.append)  # fmt: skip
    assert res["mtp_steps"] >= 1 and 0 <= res["mtp_top1"] <= 1
    after = load_file(str(tmp_path / "fa" / "model.safetensors"))
    assert set(after) == set(before)
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert changed and all(k.startswith("mtp.") for k in changed)
    info = json.loads((tmp_path / "fa" / "fixture.json").read_text())
    assert info["mtp"] == "trained" and info["mtp_train"]["mtp_steps"] >= 1


def test_vllm_exact_match_with_a_stub_engine(monkeypatch):
    vllm = pytest.importorskip("vllm")
    import harness.equivalence as eq

    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER",
                "VLLM_USE_V2_MODEL_RUNNER"):  # fmt: skip
        monkeypatch.setenv(var, "0")
    ex = fa.make_eval_set(3, seed=0)
    prompts, answers = [p for p, _ in ex], [a for _, a in ex]
    replies = {
        # vLLM stopped at EOS without listing it / listing it / ran out
        tuple(prompts[0]): (answers[0][:-1], "stop"),
        tuple(prompts[1]): (answers[1], "stop"),
        tuple(prompts[2]): (answers[2][:-1] + [7], "length"),
    }
    engines = []

    class StubLLM:
        def __init__(self, **kw):
            engines.append(kw)

        def generate(self, reqs, sp, use_tqdm=False):
            assert sp.temperature == 0.0
            out = []
            for r in reqs:
                toks, why = replies[tuple(r["prompt_token_ids"])]
                c = SimpleNamespace(token_ids=toks, finish_reason=why)
                out.append(SimpleNamespace(outputs=[c]))
            return out

        def get_metrics(self):
            return []

    monkeypatch.setattr(vllm, "LLM", StubLLM)
    monkeypatch.setattr(eq, "_shutdown", lambda llm: None)
    r = fa.vllm_exact_match("m", prompts, answers, batch=2, spec_config=fa.ngram_spec())
    assert r["exact_match"] == pytest.approx(2 / 3) and r["batch"] == 2
    assert r["outputs"][0] == answers[0]
    assert r["ngram_steps_replayed"]["steps"] > 0
    kw = engines[0]
    assert kw["speculative_config"]["num_speculative_tokens"] == 64
    assert kw["max_num_seqs"] == 2 and kw["language_model_only"]
    assert kw["attention_backend"] == "TRITON_ATTN"
    assert kw["gdn_prefill_backend"] == "triton" and kw["enforce_eager"]


@pytest.mark.gpu
def test_vllm_exact_match_runs(tmp_path):
    fa.train(tmp_path / "fa", steps=5, device="cuda", batch=8, size=TINY, eval_n=2)
    ex = fa.make_eval_set(8, seed=0)
    prompts, answers = [p for p, _ in ex], [a for _, a in ex]
    a = fa.vllm_exact_match(tmp_path / "fa", prompts, answers, batch=1)
    b = fa.vllm_exact_match(tmp_path / "fa", prompts, answers, 8, fa.ngram_spec(8))
    assert a["n"] == b["n"] == 8 and len(a["outputs"]) == 8


def test_summary_table_lists_every_run():
    rows = [
        {"batch": 1, "spec": None, "exact_match": 1.0, "prefix_tokens": 1.0,
         "identical_to_first_nonspec": True},
        {"batch": 8, "spec": fa.ngram_spec(64), "exact_match": 0.25,
         "prefix_tokens": 0.5, "identical_to_first_nonspec": False,
         "spec_metrics": {"vllm:spec_decode_num_drafts": 10,
                          "vllm:spec_decode_num_draft_tokens": 640,
                          "vllm:spec_decode_num_accepted_tokens": 64}},
        {"batch": 8, "spec": fa.ngram_spec(64), "error": "boom"},
    ]  # fmt: skip
    table = fa.summary_table([("fork", rows[:1]), ("fork", rows[1:])])
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert "| fork | v1 | False | none | 0 | 1 | 1.000 | 1.000 | True |" in lines[2]
    assert lines[3].endswith("| 0.250 | 0.500 | False | 10 | 0.100 |")
    assert "| error |" in lines[4]


def test_task_module_is_pure_and_re_exported():
    """The task generator lives in ``harness.fastapply_task`` (no torch, no
    vLLM, no equivalence matrix); ``harness.fastapply`` re-exports it."""
    import sys

    from conftest import run_until_done

    from harness import fastapply_task as task

    for name in ("make_eval_set", "make_example", "Difficulty", "FULL", "detok",
                 "ngram_draft", "simulate_ngram", "simulate_set", "ngram_spec",
                 "difficulty", "sample_difficulty", "_Region", "_code"):  # fmt: skip
        assert getattr(fa, name) is getattr(task, name), name
    assert fa.make_eval_set(2, 5) == task.make_eval_set(2, 5)
    code = (
        "import sys, harness.fastapply_task as t; t.make_eval_set(2, 0); "
        "bad = {'torch', 'vllm', 'transformers', 'harness.equivalence', "
        "'harness.fastapply'} & set(sys.modules); assert not bad, bad"
    )
    repo = str(Path(__file__).resolve().parent.parent)
    proc = run_until_done([sys.executable, "-c", code], cwd=repo,
                          what="the fast-apply task import check")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
