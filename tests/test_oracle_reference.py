"""The independent transformers reference (harness.reference) on the
smallest generated Qwen3.5 fixture, on CPU: the folder loads as exactly the
generated model, teacher forcing is aligned (an off-by-one would show),
bf16 agrees with fp32 within the tolerance measured on other sequences,
perturbed weights are detected, and compare_kind's wiring with a fake
vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from harness import reference  # noqa: E402
from harness.equivalence import make_prompts  # noqa: E402

GDN = "model.language_model.layers.1.linear_attn."


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    from harness.models import write_model

    d = write_model("qwen3_5", tmp_path_factory.mktemp("q35") / "m", seed=0)
    ps = make_prompts(6, 3, lo=40, hi=90)
    seqs = [(p[: len(p) // 2], p[len(p) // 2 :]) for p in ps]
    m32 = reference.load(d, "float32")
    return SimpleNamespace(
        dir=d, seqs=seqs, m32=m32, fp32=reference.forced_logprobs(m32, seqs)
    )


def test_load_is_the_generated_model(fixture, tmp_path):
    from safetensors.torch import load_file, save_file

    from harness.models import build_model

    _, built = build_model("qwen3_5", seed=0)
    got = reference.forced_logprobs(built, fixture.seqs)
    assert reference.drift(got, fixture.fp32, fixture.seqs)["token"] == 0.0
    # a checkpoint without one of the model's weights is refused
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in fixture.dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    t = load_file(str(fixture.dir / "model.safetensors"))
    t.pop(next(k for k in t if k.endswith("linear_attn.A_log")))
    save_file(t, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing"):
        reference.load(broken)


def _bf16_tolerance(fixture, seqs_idx, m_positions):
    m16 = reference.load(fixture.dir, "bfloat16")
    seqs = [fixture.seqs[i] for i in seqs_idx]
    low = reference.forced_logprobs(m16, seqs)
    rounding = reference.drift(low, [fixture.fp32[i] for i in seqs_idx], seqs)
    return rounding, reference.tolerance(rounding, m_positions, "bfloat16")


def test_teacher_forcing_is_aligned(fixture):
    # each position equals the last position of a forward over its prefix
    p, cont = fixture.seqs[0]
    inc = [
        reference.forced_logprobs(fixture.m32, [(p + cont[:i], [cont[i]])])[0][0]
        for i in range(len(cont))
    ]
    d = reference.drift([inc], [fixture.fp32[0]], [fixture.seqs[0]])
    rounding, tol = _bf16_tolerance(fixture, range(len(fixture.seqs)), d["positions"])
    assert d["token"] < rounding["token"] <= tol["token"]
    # one position off: far outside what bf16 rounding explains
    shifted = [
        {**fixture.fp32[0][i + 1], cont[i]: fixture.fp32[0][i + 1].get(cont[i], -30.0)}
        for i in range(len(cont) - 1)
    ]
    off = reference.drift([shifted], [fixture.fp32[0][:-1]], [(p, cont[:-1])])
    assert off["topk"] > tol["topk"]


def test_bf16_within_tolerance_measured_on_other_sequences(fixture):
    n = len(fixture.seqs)
    held = list(range(n // 2, n))
    m16 = reference.load(fixture.dir, "bfloat16")
    seqs = [fixture.seqs[i] for i in held]
    got = reference.drift(
        reference.forced_logprobs(m16, seqs), [fixture.fp32[i] for i in held], seqs
    )
    rounding, _ = _bf16_tolerance(fixture, range(n // 2), 0)
    j = reference.judge(got, rounding, "bfloat16")
    assert rounding["token"] > 0  # bf16 does round
    assert j["ok"], j


@pytest.mark.parametrize(
    ("bug", "dtype"),
    [("conv_flip", "bfloat16"), ("A_log_sign", "bfloat16"), ("qkv_1pct", "float32")],
)
def test_perturbed_weight_detected(fixture, bug, dtype):
    """A layout bug (one GDN layer's conv kernel reversed), a sign bug, and
    1% noise on one projection (caught at fp32, where the tolerance comes
    from fp32's own path noise: full vs incremental forward)."""
    m = reference.load(fixture.dir, "float32")
    params = dict(m.named_parameters())
    with torch.no_grad():
        if bug == "conv_flip":
            w = params[GDN + "conv1d.weight"]
            w.copy_(w.flip(-1))
        elif bug == "A_log_sign":
            params[GDN + "A_log"].neg_()
        else:
            w = params[GDN + "in_proj_qkv.weight"]
            g = torch.Generator().manual_seed(0)
            w.add_(torch.randn(w.shape, generator=g) * w.std() * 0.01)
    got = reference.drift(
        reference.forced_logprobs(m, fixture.seqs), fixture.fp32, fixture.seqs
    )
    if dtype == "bfloat16":
        rounding, _ = _bf16_tolerance(fixture, range(len(fixture.seqs)), 0)
    else:
        p, cont = fixture.seqs[0]
        inc = [
            reference.forced_logprobs(fixture.m32, [(p + cont[:i], [cont[i]])])[0][0]
            for i in range(len(cont))
        ]
        rounding = reference.drift([inc], [fixture.fp32[0]], [fixture.seqs[0]])
    assert not reference.judge(got, rounding, dtype)["ok"]


def test_compare_kind_wiring(fixture, monkeypatch, tmp_path):
    """compare_kind with a fake vLLM that returns the bf16 transformers
    logprobs (ok) or those of a model with a flipped conv kernel (not)."""
    from harness import equivalence as eq
    from harness import models

    state = {"model": None}

    def fake_generate(cell, model_dir, waves, logprobs):
        prompts = [p for w in waves for p in w]
        seqs = [
            (p, fixture.seqs[i % len(fixture.seqs)][1][:12])
            for i, p in enumerate(prompts)
        ]
        lps = reference.forced_logprobs(state["model"], seqs)
        outs = [
            SimpleNamespace(
                outputs=[
                    SimpleNamespace(
                        token_ids=c,
                        logprobs=[
                            {t: SimpleNamespace(logprob=v) for t, v in d.items()}
                            for d in lp
                        ],
                    )
                ]
            )
            for (_, c), lp in zip(seqs, lps, strict=True)
        ]
        return outs, {}

    def fake_forced(model, dtype, model_dir, seqs, kv="auto"):
        from harness.compare import Position

        lps = reference.forced_logprobs(state["model"], seqs)
        return [
            [Position.top(d, candidate=t) for d, t in zip(lp, c, strict=True)]
            for lp, (_, c) in zip(lps, seqs, strict=True)
        ]

    monkeypatch.setattr(eq, "generate", fake_generate)
    monkeypatch.setattr(eq, "teacher_forced", fake_forced)
    monkeypatch.setattr(models, "write_model", lambda kind, out, seed=0: fixture.dir)
    state["model"] = reference.load(fixture.dir, "bfloat16")
    r = reference.compare_kind("qwen3_5", tmp_path, 3, "bfloat16", 0, 12)
    assert r["generated"]["ok"] and r["teacher_forced"]["ok"], r
    bad = reference.load(fixture.dir, "bfloat16")
    with torch.no_grad():
        w = dict(bad.named_parameters())[GDN + "conv1d.weight"]
        w.copy_(w.flip(-1))
    state["model"] = bad
    r = reference.compare_kind("qwen3_5", tmp_path, 3, "bfloat16", 0, 12)
    assert not r["teacher_forced"]["ok"] and not r["generated"]["ok"]
    assert r["teacher_forced"]["vllm"]["positions"] == 3 * 12


def test_full_fp32_disables_tf32_and_restores():
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with reference.full_fp32():
            assert torch.get_float32_matmul_precision() == "highest"
            assert not torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision(old)
        torch.backends.cuda.matmul.allow_tf32 = False
    assert set(reference.kernel_packages()) == {"fla", "mamba_ssm", "causal_conv1d"}


def test_main_writes_each_kind_as_it_finishes_and_skips_what_vllm_cannot_load(
    monkeypatch, tmp_path
):
    """``main`` rewrites its JSON after each kind (a process killed at its
    call's limit keeps the kinds it finished), records a kind's error, and
    skips a fixture vLLM cannot load (OLMo-hybrid) instead of failing it."""
    import json

    out = tmp_path / "out"
    seen = []

    def fake_compare(kind, workdir, n, dtype, seed, max_tokens):
        if seen:  # the kinds before this one are on disk already
            done = json.loads((out / "reference-bfloat16.json").read_text())
            assert [r["kind"] for r in done if "skipped" not in r] == seen
        seen.append(kind)
        if kind == "nemotron_h":
            raise RuntimeError("boom")
        ok = {"ok": True}
        return {"kind": kind, "generated": ok, "teacher_forced": ok}

    monkeypatch.setattr(reference, "compare_kind", fake_compare)
    # a fixture the installed vLLM cannot load (today every one loads on
    # the forks: OLMo-hybrid as it loads on upstream)
    from harness.models import FIXTURES

    monkeypatch.setitem(FIXTURES["olmo_hybrid"], "vllm_loads", False)
    reference.main(
        ["--kinds", "qwen3_5,olmo_hybrid,nemotron_h,mamba2", "--out", str(out)]
    )
    rows = json.loads((out / "reference-bfloat16.json").read_text())
    assert [(r["kind"], r["ok"]) for r in rows] == [
        ("qwen3_5", True), ("olmo_hybrid", None), ("nemotron_h", False),
        ("mamba2", True),
    ]  # fmt: skip
    assert rows[1]["skipped"] == "vLLM cannot load it"
    assert "boom" in rows[2]["error"]
    assert seen == ["qwen3_5", "nemotron_h", "mamba2"]


def test_our_own_forward_keeps_its_tensors_on_the_model_device():
    """The reference runs our Bailing forward on the GPU: every tensor it
    makes (RoPE frequencies, the decay's positions) must be on the model's
    device. The meta device stands in for the GPU here (a CPU tensor beside
    a meta one raises as beside a CUDA one)."""
    from harness.models import build_model

    _, model = build_model("bailing_moe_linear", seed=0)
    model = model.float().eval().to("meta")
    ids = torch.tensor([[3, 17, 42, 9, 100, 7]], device="meta")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.device.type == "meta" and logits.shape[:2] == (1, 6)


def test_a_family_without_a_transformers_class_loads_our_own_forward(tmp_path):
    """Bailing-MoE-linear has no transformers class: the reference loads
    the fixture into the torch forward that wrote it (every checkpoint
    tensor, strictly), and its logits are that model's; a checkpoint with a
    tensor missing is refused."""
    from safetensors.torch import load_file, save_file

    from harness.models import build_model, write_model

    d = write_model("bailing_moe_linear", tmp_path / "m", seed=0)
    model = reference.load(d, "float32")
    assert type(model).__name__ == "BailingMoeLinearForCausalLM"
    _, fresh = build_model("bailing_moe_linear", seed=0)
    ids = torch.tensor([[3, 17, 42, 9, 100, 7]])
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = fresh.float().eval()(input_ids=ids).logits
    assert torch.equal(got, want)
    lps = reference.forced_logprobs(model, [([3, 17, 42], [9, 100, 7])])
    assert len(lps[0]) == 3
    weights = load_file(str(d / "model.safetensors"))
    weights.pop(next(iter(sorted(weights))))
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="weights missing"):
        reference.load(d, "float32")
