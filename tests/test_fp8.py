# SPDX-License-Identifier: Apache-2.0
"""harness.fp8: a block-FP8 copy of the fast-apply fixture in the layout of
published FP8 checkpoints, checked against vLLM's own loader on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import fake_output

from harness import fp8

REPO = Path(__file__).resolve().parent.parent
FASTAPPLY = REPO / "fixtures" / "fastapply"


def test_block_quantization_round_trip():
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * torch.linspace(0.01, 3, 384)
    q, s = fp8.quantize_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (2, 3) and s.dtype == torch.float32
    # each block's largest magnitude maps to the largest FP8 value
    assert q.float().abs().amax() == pytest.approx(fp8.FP8_MAX)
    back = fp8.dequantize_block(q, s)
    # e4m3 keeps 3 mantissa bits: at most half a step, 1/16 of the value
    # (plus the subnormal step near zero)
    err = (back - w).abs()
    scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert bool((err <= w.abs() / 16 + scale * 2**-9).all())


@pytest.fixture(scope="module")
def fp8_fixture(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "fastapply-fp8"
    done = fp8.write_fp8(FASTAPPLY, out)
    return out, done


def test_layout_of_the_written_checkpoint(fp8_fixture):
    import torch
    from safetensors import safe_open

    out, done = fp8_fixture
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["text_config"]["quantization_config"] == qc
    assert qc["quant_method"] == "fp8" and qc["activation_scheme"] == "dynamic"
    assert qc["weight_block_size"] == [128, 128]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118
        for name in done["quantized"]:
            w = f.get_tensor(name)
            s = f.get_tensor(name.removesuffix("weight") + "weight_scale_inv")
            assert w.dtype == torch.float8_e4m3fn
            assert tuple(s.shape) == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        for name in done["kept_2d"]:
            assert f.get_tensor(name).dtype == torch.bfloat16
            assert name.removesuffix("weight") + "weight_scale_inv" not in names
    # GDN's fused b/a gates, lm_head, the embeddings and the vision tower
    # stay bf16, each listed by its full name
    ignored = set(qc["modules_to_not_convert"])
    assert {n.removesuffix(".weight") for n in done["kept_2d"]} == ignored
    assert "lm_head" in ignored
    assert sum(n.endswith(("in_proj_a", "in_proj_b")) for n in ignored) == 6
    # every projection of the language model and the MTP head is FP8
    assert len(done["quantized"]) == 47
    assert any(n.startswith("mtp.") for n in done["quantized"])


LOAD_CHECK = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import test_harness_models_more as check
# a CPU has no scaled-mm kernel for FP8 Linear layers; the weights and
# their scales are created and loaded as on a GPU
import vllm.model_executor.layers.quantization.fp8 as fp8
fp8.init_fp8_linear_kernel = lambda *args, **kwargs: None
check._subprocess_main(json.loads(sys.argv[2]))
"""


def test_vllm_loads_every_fp8_weight_and_scale(fp8_fixture, tmp_path):
    """vLLM's Qwen3.5 classes (target and MTP), built on the CPU with the
    checkpoint's fp8 quantization config, take every tensor; the layers in
    the ignore list get no FP8 parameters; only the attention layers' KV
    quantization scales, which vLLM defaults after loading when a
    checkpoint has none, stay unloaded."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here")
    from conftest import run_until_done

    out, _ = fp8_fixture
    specs = [
        ["qwen3_5", str(out), arch, "bfloat16"]
        for arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MTP")
    ]
    script = tmp_path / "load_check.py"
    script.write_text(LOAD_CHECK)
    env = {
        **os.environ,
        "HSFORK_CPU_TESTBED": "0",
        "CUDA_VISIBLE_DEVICES": "",
        "VLLM_LOGGING_LEVEL": "ERROR",
    }
    proc = run_until_done(
        [sys.executable, str(script), str(REPO), json.dumps(specs)],
        what="the vLLM load check of the FP8 fixture", cwd=REPO, env=env,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-4000:]
    results = json.loads(lines[-1][len("RESULT ") :])
    kv_scales = ("k_scale", "q_scale", "v_scale", "prob_scale")
    for r in results:
        assert r["skip"] is None and r["error"] is None, r
        assert r["unexpected"] == [], r["unexpected"]
        assert r["unloaded"], "an FP8 model without attention scales?"
        assert all(n.rsplit(".", 1)[-1] in kv_scales for n in r["unloaded"]), r
        assert set(r["nan"]) == set(r["unloaded"])


def test_fp8_slice_runs_the_fp8_copy_against_its_own_reference():
    """The fp8 slice's cells load the block-FP8 copy and compute in bf16; the
    non-speculative reference is keyed by dtype, so it is the same FP8
    model; margins and the drift floor know the dtype."""
    from harness import compare, oracle
    from harness.equivalence import FP8, engine_kwargs, slice_cells, spec_config

    cells = [c for c in slice_cells("fp8") if c.dtype == FP8]
    assert cells
    assert {c.drafter for c in cells} == {"ngram", "mtp", "none"}
    assert {c.cache_mode for c in cells} == {"none", "align"}
    for cell in cells:
        kw = engine_kwargs(cell, "/m-fp8", spec_config(cell))
        assert kw["dtype"] == "bfloat16"
        assert "quantization" not in kw  # the checkpoint's own config says it
    # the compiled MTP cell has a control: the same engine without a drafter
    (mtp,) = [c for c in cells if c.drafter == "mtp" and c.graphs != "eager"]
    (control,) = [c for c in cells if c.drafter == "none"]
    same = ("runner", "cache_mode", "graphs", "async_sched", "batch", "max_tokens")
    assert all(getattr(control, f) == getattr(mtp, f) for f in same)
    assert spec_config(control) is None
    assert FP8 in compare.TIE_MARGIN and FP8 in oracle.EPS


def test_run_cells_runs_and_verifies_fp8_cells_on_the_fp8_copy(tmp_path, monkeypatch):
    """An fp8 cell's reference, candidate and teacher-forced verification
    all run on the FP8 copy (never the bf16 fixture), at bf16 activations."""
    import harness.equivalence as eq
    from harness.compare import Position

    seen: list[tuple[str, str]] = []

    def fake_generate(cell, model_dir, waves, logprobs, batches=None):
        seen.append(("generate", model_dir))
        kw = eq.engine_kwargs(cell, model_dir, eq.spec_config(cell))
        assert kw["dtype"] == "bfloat16"
        return [fake_output([1, 2, 3], logprobs) for w in waves for _ in w], {}

    def fake_forced(model, dtype, model_dir, seqs, kv_cache_dtype="auto", **_):
        seen.append(("forced", model_dir))
        return [[Position(t, 0, 3.0) for t in c] for _, c in seqs]

    monkeypatch.setattr(eq, "generate", fake_generate)
    monkeypatch.setattr(eq, "teacher_forced", fake_forced)
    cell = eq.Cell(eq.FASTAPPLY, "ngram", 8, 2, dtype=eq.FP8, max_tokens=3)
    (row,) = eq.run_cells([cell], tmp_path, n_prompts=2, seed=0)
    assert row["status"] == "ok", row.get("error")
    dirs = {d for _, d in seen}
    assert dirs == {str(tmp_path / f"model-{eq.FASTAPPLY}-{eq.FP8}")}
    assert {what for what, _ in seen} == {"generate", "forced"}


def test_fp8_slice_also_runs_online_fp8_and_float16():
    """The other dtypes a user picks: vLLM's online FP8 (the bf16 fixture,
    ``quantization="fp8"``, bf16 activations) and float16, each with n-gram
    k=64 and MTP k=3; every dtype a slice uses has a tie margin and a drift
    unit."""
    from harness import compare, oracle
    from harness.equivalence import (
        FP8_ONLINE,
        engine_kwargs,
        reference_key,
        slice_cells,
        spec_config,
    )
    from harness.full_matrix import expected_cells

    cells = slice_cells("fp8")
    for dt, want in ((FP8_ONLINE, "bfloat16"), ("float16", "float16")):
        mine = [c for c in cells if c.dtype == dt]
        assert {(c.drafter, c.k) for c in mine} == {("ngram", 64), ("mtp", 3)}
        for c in mine:
            kw = engine_kwargs(c, "/m", spec_config(c))
            assert kw["dtype"] == want
            assert kw.get("quantization") == ("fp8" if dt == FP8_ONLINE else None)
            # judged against a reference of its own dtype
            assert reference_key(c, 8)[1] == dt
    used = {key["dtype"] for _, key in expected_cells()}
    assert used <= set(compare.TIE_MARGIN) and used <= set(oracle.EPS)
