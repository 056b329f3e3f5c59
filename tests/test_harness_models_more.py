# SPDX-License-Identifier: Apache-2.0
"""Generated tiny models, checkpoint side: the weights round-trip through
transformers exactly, the Qwen3-Next MTP and Kimi-Linear layouts are the
published ones, and vLLM's own model classes (built on the CPU, in a
subprocess) load every parameter from each fixture.

Run as a script (``python tests/test_harness_models_more.py SPECS``) this
file is that subprocess: vLLM on a CPU-only host with no device build
resolves no platform, so the check stands in an attention backend name, a
CPU device, an MoE backend and an MLA prefill backend for what vLLM's
constructors ask of the platform; it runs no forward pass.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from harness.models import (
    FIXTURES,
    HAND_WRITTEN,
    KINDS,
    OWN_MODEL,
    build_model,
    dflash_target_layers,
    main,
    on_line,
    vllm_loads,
    write_dense_draft,
    write_dflash_head,
    write_dspark_head,
    write_eagle3_head,
    write_eagle_head,
    write_medusa_head,
    write_model,
)

EAGLE3 = "eagle3"  # a spec's arch: the EAGLE-3 head, built as vLLM resolves it
EAGLE = "eagle"  # the EAGLE-1 head, likewise
DFLASH = "dflash"  # the DFlash draft model (write_dflash_head), likewise
MEDUSA = "medusa"  # the Medusa head (write_medusa_head), likewise
DSPARK = "dspark"  # the DSpark draft model (write_dspark_head), likewise
# heads written beside their target, built under its config
HEADS = {
    EAGLE3: write_eagle3_head,
    EAGLE: write_eagle_head,
    DFLASH: write_dflash_head,
    MEDUSA: write_medusa_head,
    DSPARK: write_dspark_head,
}
# (target kind, head) -> {line: a piece of the error vLLM raises building
# the speculative config}: v0.33.0 has no Medusa (its method list refuses
# "medusa"); v0.26.0's Medusa config reads the vocabulary from the target's
# top-level config, which the Qwen3.5 fixture (a multimodal config) lacks
# (config/speculative.py:911)
REFUSED_HEADS = {
    ("qwen3_5", MEDUSA): {
        "v0.26.0": "'Qwen3_5Config' object has no attribute 'vocab_size'",
        "v0.33.0": "Input should be",
    },
    ("nemotron_h", MEDUSA): {"v0.33.0": "Input should be"},
}
DENSE_DRAFT = "Qwen3ForCausalLM"  # a spec's arch: the draft of write_dense_draft

REPO = Path(__file__).resolve().parent.parent
NEW_KINDS = ["qwen3_next", "kimi_linear", "granitemoehybrid"]


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


# -- tests -------------------------------------------------------------------


def test_registry_and_cli(tmp_path):
    assert set(KINDS) == set(FIXTURES) >= {"qwen3_5", "nemotron_h", *NEW_KINDS}
    for kind in NEW_KINDS:
        main([kind, str(tmp_path / kind), "--seed", "1"])
        cfg = json.loads((tmp_path / kind / "config.json").read_text())
        assert cfg["architectures"] == [FIXTURES[kind]["architecture"]]
        info = json.loads((tmp_path / kind / "fixture.json").read_text())
        assert info["kind"] == kind and info["seed"] == 1
        assert info["mtp"] == FIXTURES[kind]["mtp"]


# a kind whose model is our own torch module (Bailing-MoE-linear) has no
# transformers class to load it back: test_bailing_moe_linear_layout checks
# its checkpoint against that module
@pytest.mark.parametrize("kind", [k for k in KINDS if k not in OWN_MODEL])
def test_checkpoint_round_trips_through_transformers(tmp_path, kind):
    """The checkpoint names are the ones transformers' conversion loads back
    (fused experts, Kimi-Linear's split conv and renamed MoE): nothing
    missing, unexpected or reshaped, and every weight equal to the model's
    that wrote it (for a hand-written kind, to its weight table)."""
    import torch
    import transformers

    path = write_model(kind, tmp_path / "m", seed=5)
    _, ref = build_model(kind, seed=5)
    if kind in HAND_WRITTEN:
        # no transformers class: the checkpoint is the hand-written table
        got = _tensors(path)
        assert set(got) == set(ref)
        for name, t in ref.items():
            assert torch.equal(got[name], t), name
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["dtype"] == FIXTURES[kind]["dtype"]
        return
    cls = getattr(transformers, type(ref).__name__)
    model, info = cls.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in info), info
    got = model.state_dict()
    want = ref.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dtype"] == FIXTURES[kind]["dtype"]


def test_qwen3_next_mtp_layout(tmp_path):
    """``mtp.*`` as vLLM's Qwen3NextMTP loads it: the fusion fc, three norms
    and one full-attention MoE decoder layer shaped like the model's."""
    path = write_model("qwen3_next", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    t = _tensors(path)
    full = cfg["layer_types"].index("full_attention")
    layer = {
        k[len(f"model.layers.{full}.") :]: v.shape
        for k, v in t.items()
        if k.startswith(f"model.layers.{full}.")
    }
    mtp = {k: v.shape for k, v in t.items() if k.startswith("mtp.")}
    h = cfg["hidden_size"]
    expected = {f"mtp.layers.0.{k}": s for k, s in layer.items()}
    expected["mtp.fc.weight"] = (h, 2 * h)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        expected[f"mtp.{norm}.weight"] = (h,)
    assert mtp == expected
    # one MoE layer: router, per-expert projections, shared expert and gate
    n = cfg["num_experts"]
    assert mtp["mtp.layers.0.mlp.gate.weight"] == (n, h)
    for e in range(n):
        for w in ("gate_proj", "up_proj", "down_proj"):
            assert f"mtp.layers.0.mlp.experts.{e}.{w}.weight" in mtp
    assert "mtp.layers.0.mlp.shared_expert_gate.weight" in mtp
    assert "mtp.layers.0.self_attn.q_norm.weight" in mtp

    plain = write_model("qwen3_next", tmp_path / "plain", mtp=False)
    assert not any(k.startswith("mtp.") for k in _tensors(plain))
    cfg = json.loads((plain / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 0


def test_kimi_linear_layout(tmp_path):
    """Published Kimi-Linear names: KDA with separate q/k/v short convs and
    the forget gate's f_a/f_b, A_log and dt_bias on ``self_attn``; MLA
    without q LoRA; layer 0 a dense ``mlp``, later layers
    ``block_sparse_moe`` with experts w1/w2/w3, a shared expert and a
    router with its score-correction bias."""
    path = write_model("kimi_linear", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    la = cfg["linear_attn_config"]
    t = {k: tuple(v.shape) for k, v in _tensors(path).items()}
    h, d, nh = cfg["hidden_size"], la["head_dim"], la["num_heads"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if i + 1 in la["kda_layers"]:
            for c in ("q", "k", "v"):
                assert t[p + f"self_attn.{c}_conv1d.weight"] == (
                    nh * d, 1, la["short_conv_kernel_size"],
                )  # fmt: skip
            assert t[p + "self_attn.A_log"] == (1, 1, nh, 1)
            assert t[p + "self_attn.dt_bias"] == (nh * d,)
            assert t[p + "self_attn.f_a_proj.weight"] == (d, h)
            assert t[p + "self_attn.f_b_proj.weight"] == (nh * d, d)
            assert t[p + "self_attn.b_proj.weight"] == (nh, h)
            assert not any(k.startswith(p + "self_attn.forget_gate") for k in t)
        else:
            assert i + 1 in la["full_attn_layers"]
            r, kv = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
            assert t[p + "self_attn.kv_a_proj_with_mqa.weight"] == (kv + r, h)
            assert t[p + "self_attn.kv_a_layernorm.weight"] == (kv,)
            assert p + "self_attn.q_proj.weight" in t
        if i < cfg["first_k_dense_replace"]:
            assert t[p + "mlp.gate_proj.weight"] == (cfg["intermediate_size"], h)
            assert not any(k.startswith(p + "block_sparse_moe.") for k in t)
        else:
            m = p + "block_sparse_moe."
            assert t[m + "gate.weight"] == (cfg["num_experts"], h)
            assert t[m + "gate.e_score_correction_bias"] == (cfg["num_experts"],)
            inter = cfg["moe_intermediate_size"]
            for e in range(cfg["num_experts"]):
                assert t[m + f"experts.{e}.w1.weight"] == (inter, h)
                assert t[m + f"experts.{e}.w2.weight"] == (h, inter)
                assert t[m + f"experts.{e}.w3.weight"] == (inter, h)
            assert t[m + "shared_experts.gate_proj.weight"] == (inter, h)
            assert not any(k.startswith(p + "mlp.") for k in t)


def test_plamo2_layout(tmp_path):
    """Published Plamo2 names under ``model.layers.layers.<i>``, exactly
    those vLLM's Plamo2Model loads: Mamba and attention layers as its
    ``is_mamba`` places them (both present); Mamba with the fused in_proj,
    a depthwise conv, the bcdt/dt projections (rank max(64, hidden/16)),
    per-head A_log, D and dt_bias, and dt/B/C norm weights; attention with
    fused qkv and per-head q/k norm weights; zero-centred layer and final
    norms (vLLM adds their offsets); an untied output head. The config
    class is the fixture's own module, through trust_remote_code."""
    import torch
    from transformers import AutoConfig

    from harness.models_plamo2 import CONFIG_FILE, time_step_rank

    path = write_model("plamo2", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoConfig": "configuration_plamo2.Plamo2Config"}
    assert (path / CONFIG_FILE).is_file()
    hf = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert type(hf).__name__ == "Plamo2Config" and hf.model_type == "plamo2"
    assert (hf.mamba_step, hf.hidden_size_per_head) == (2, 64)
    assert hf.tie_word_embeddings is False

    ts = _tensors(path)
    t = {k: tuple(v.shape) for k, v in ts.items()}
    h, hd, n = cfg["hidden_size"], cfg["hidden_size_per_head"], cfg["num_hidden_layers"]
    nh, s, kc = cfg["mamba_num_heads"], cfg["mamba_d_state"], cfg["mamba_d_conv"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    ff = cfg["intermediate_size"]
    inner, rank = nh * hd, time_step_rank(cfg)
    assert rank == 64
    # vLLM's is_mamba for mamba_step 2 and four layers
    step = cfg["mamba_step"]
    mamba = [i % step != step // 2 for i in range(n)]
    assert mamba == [True, False, True, False]
    want = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg["vocab_size"], h),
    }
    for i in range(n):
        p, m = f"model.layers.layers.{i}.", f"model.layers.layers.{i}.mixer."
        for norm in ("pre_mixer_norm", "post_mixer_norm", "pre_mlp_norm",
                     "post_mlp_norm"):  # fmt: skip
            want[p + f"{norm}.weight"] = (h,)
        want[p + "mlp.gate_up_proj.weight"] = (2 * ff, h)
        want[p + "mlp.down_proj.weight"] = (h, ff)
        if mamba[i]:
            want |= {
                m + "in_proj.weight": (2 * inner, h),
                m + "conv1d.weight": (inner, 1, kc),
                m + "bcdt_proj.weight": (rank + 2 * s, inner),
                m + "dt_proj.weight": (nh, rank),
                m + "dt_bias": (nh,),
                m + "A_log": (nh,),
                m + "D": (nh,),
                m + "dt_norm_weight": (rank,),
                m + "B_norm_weight": (s,),
                m + "C_norm_weight": (s,),
                m + "out_proj.weight": (h, inner),
            }
            dt = torch.nn.functional.softplus(ts[m + "dt_bias"])
            assert ((dt >= 1e-4) & (dt <= 0.1 + 1e-6)).all()
        else:
            want |= {
                m + "qkv_proj.weight": ((nq + 2 * nkv) * hd, h),
                m + "o_proj.weight": (h, nq * hd),
                m + "q_weight": (nq, hd),
                m + "k_weight": (nkv, hd),
            }
    assert t == want
    for name, v in ts.items():
        if name.endswith(("_norm.weight", "model.norm.weight")):
            assert not v.any(), name  # zero-centred


def test_bailing_moe_linear_layout(tmp_path):
    """Published Bailing-MoE-linear (Ling/Ring 2.5) names, exactly those
    vLLM's BailingMoeV25Model and BailingMoeV25MTPModel load: the layer
    pattern of ``layer_group_size`` (lightning attention, then MLA as the
    last layer of each group; both present); lightning attention with the
    fused query_key_value, q/k norms, g_proj, g_norm and ``dense``; MLA
    without q LoRA (q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    ``dense``); layer 0 a dense ``mlp``, the later ones the MoE (router with
    its expert_bias, per-expert projections, a shared expert); the MTP layer
    as ``model.layers.<num_hidden_layers>`` (enorm, hnorm, eh_proj, MLA +
    MoE, final_layernorm), and none without MTP. The config class is the
    fixture's own module (transformers' class for "bailing_hybrid" is
    another model's), through trust_remote_code; the checkpoint holds the
    weights of the module build_model returns."""
    import torch
    from transformers import AutoConfig

    from harness.models_bailing import CONFIG_FILE, is_linear_layer, is_moe_layer

    kind = "bailing_moe_linear"
    path = write_model(kind, tmp_path / "m", seed=5)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["BailingMoeV2_5ForCausalLM"]
    # the model type vLLM keys its MLA detection and the MTP switch on
    assert cfg["model_type"] == "bailing_hybrid"
    cls = "BailingMoeLinearConfig"
    assert cfg["auto_map"] == {"AutoConfig": f"{CONFIG_FILE[:-3]}.{cls}"}
    assert (path / CONFIG_FILE).is_file()
    hf = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert type(hf).__name__ == cls and hf.model_type == "bailing_hybrid"
    # transformers' BailingHybridConfig sets head_dim to qk_rope_head_dim
    assert (hf.head_dim, hf.qk_rope_head_dim) == (64, 64)
    assert (hf.layer_group_size, hf.num_nextn_predict_layers) == (4, 1)
    assert hf.num_experts_per_tok == hf.num_experts  # every expert routed
    assert hf.tie_word_embeddings is False

    n = cfg["num_hidden_layers"]
    # whole groups: the published modeling code makes the layers of a
    # trailing partial group full attention, vLLM linear
    assert n % cfg["layer_group_size"] == 0
    linear = [is_linear_layer(cfg, i) for i in range(n)]
    assert linear == [True, True, True, False]
    moe = [is_moe_layer(cfg, i) for i in range(n)]
    assert moe == [False, True, True, True]

    ts = _tensors(path)
    t = {k: tuple(v.shape) for k, v in ts.items()}
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    nh, d = cfg["num_attention_heads"], cfg["head_dim"]
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    vd, rank = cfg["v_head_dim"], cfg["kv_lora_rank"]
    ne, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    ff = cfg["intermediate_size"]

    def mlp(p, size):
        return {
            p + "gate_proj.weight": (size, h),
            p + "up_proj.weight": (size, h),
            p + "down_proj.weight": (h, size),
        }

    def mla(p):
        a = p + "attention."
        return {
            a + "q_proj.weight": (nh * (nope + rope), h),
            a + "kv_a_proj_with_mqa.weight": (rank + rope, h),
            a + "kv_a_layernorm.weight": (rank,),
            a + "kv_b_proj.weight": (nh * (nope + vd), rank),
            a + "dense.weight": (h, nh * vd),
        }

    def moe_block(p):
        out = {p + "mlp.gate.weight": (ne, h), p + "mlp.gate.expert_bias": (ne,)}
        for e in range(ne):
            out |= mlp(p + f"mlp.experts.{e}.", inter)
        return out | mlp(p + "mlp.shared_experts.", inter)

    want = {
        "model.word_embeddings.weight": (vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    for i in range(n):
        p = f"model.layers.{i}."
        want |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if linear[i]:
            a = p + "attention."
            want |= {
                a + "query_key_value.weight": (3 * nh * d, h),
                a + "query_layernorm.weight": (d,),
                a + "key_layernorm.weight": (d,),
                a + "g_proj.weight": (nh * d, h),
                a + "g_norm.weight": (nh * d,),
                a + "dense.weight": (h, nh * d),
            }
        else:
            want |= mla(p)
        want |= moe_block(p) if moe[i] else mlp(p + "mlp.", ff)
    p = f"model.layers.{n}."
    for norm in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm",
                 "final_layernorm"):  # fmt: skip
        want[p + f"{norm}.weight"] = (h,)
    want[p + "eh_proj.weight"] = (h, 2 * h)
    want |= mla(p) | moe_block(p)
    assert t == want

    # the checkpoint is the module's weights, output head and embedding as
    # build_model draws them
    _, model = build_model(kind, seed=5)
    sd = model.state_dict()
    assert set(sd) == set(ts)
    for name, w in sd.items():
        assert torch.equal(ts[name], w), name
    assert cfg["dtype"] == FIXTURES[kind]["dtype"]

    plain = write_model(kind, tmp_path / "plain", mtp=False)
    plain_cfg = json.loads((plain / "config.json").read_text())
    assert plain_cfg["num_nextn_predict_layers"] == 0
    assert not any(k.startswith(p) for k in _tensors(plain))


def test_dense_draft_repeats_the_last_token(tmp_path):
    """The attention-only draft model has the target's vocabulary and
    tokenizer and predicts, at every position, the token it was given."""
    import torch
    from transformers import AutoModelForCausalLM

    target = write_model("qwen3_5", tmp_path / "target")
    draft = write_dense_draft(target, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    tcfg = json.loads((target / "config.json").read_text())
    assert cfg["vocab_size"] == tcfg["text_config"]["vocab_size"]
    assert cfg["eos_token_id"] == tcfg["eos_token_id"]
    assert (draft / "tokenizer.json").read_bytes() == (
        target / "tokenizer.json"
    ).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (3, 24), generator=g)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.equal(logits.argmax(-1), ids)
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1.0  # decisive, also in bf16


def test_families_slice():
    """Every other hybrid family has cells; MTP cells where the fixture has
    a head; a family with no spec path on any line only the two cells that
    record that it should be refused (Jamba, Mamba and Plamo2: the fork
    refuses Plamo2 with a speculative config on v0.26.0; v0.33.0 has no
    Plamo2 class and refuses the model itself)."""
    from harness.equivalence import FAMILY_SPEC, dry_run, slice_cells
    from harness.models import FAMILY_KINDS

    cells = slice_cells("families")
    # 6 families with a spec path x 9 cells, Qwen3.5-MoE's and
    # Bailing-MoE-linear's 12 each (MTP), and 2 each for Jamba, Mamba and
    # Plamo2
    assert len(cells) == 84
    assert len([c for c in cells if c.model == "plamo2"]) == 2
    assert len([c for c in cells if c.model == "bailing_moe_linear"]) == 12
    assert {c.model for c in cells} == set(FAMILY_KINDS) == set(FAMILY_SPEC)
    assert cells == [c for k in FAMILY_KINDS for c in slice_cells(f"families-{k}")]
    for kind in FAMILY_KINDS:
        own = [c for c in cells if c.model == kind]
        assert any(c.drafter == "mtp" for c in own) == FIXTURES[kind]["mtp"]
        if not any(v is True for v in FAMILY_SPEC[kind].values()):
            assert len(own) == 2
        else:
            assert {c.cache_mode for c in own} == {"none", "align"}
            assert {c.runner for c in own} >= {"v1", "default"}
            drafters = {c.drafter for c in own}
            assert {"ngram", "ngram_gpu", "draft_model:dense"} <= drafters
            assert any(c.async_sched for c in own if c.drafter == "ngram_gpu")
    for item in dry_run(cells):
        kind = item["cell"]["model"]
        for k, v in FIXTURES[kind]["engine_kwargs"].items():
            assert item["engine_kwargs"][k] == v


def _vllm_specs():
    specs = []
    for kind, fx in FIXTURES.items():
        specs.append((kind, fx["architecture"], fx["dtype"]))
        if fx["mtp"]:
            specs.append((kind, fx["mtp_architecture"], fx["dtype"]))
    # the EAGLE-3 head for Qwen3.5 (harness.models.write_eagle3_head) and the
    # attention-only draft model (harness.models.write_dense_draft)
    specs.append(("qwen3_5", EAGLE3, "bfloat16"))
    specs.append(("qwen3_5", EAGLE, "bfloat16"))
    specs.append(("qwen3_5", DFLASH, "bfloat16"))
    specs.append(("qwen3_5", DSPARK, "bfloat16"))
    # Medusa (v0.26.0): for Qwen3.5 v0.26.0 refuses the pair (REFUSED_HEADS);
    # NemotronH's text-only config carries the vocabulary it reads
    specs.append(("qwen3_5", MEDUSA, "bfloat16"))
    specs.append(("nemotron_h", MEDUSA, FIXTURES["nemotron_h"]["dtype"]))
    specs.append(("qwen3_5", DENSE_DRAFT, "bfloat16"))
    # Qwen3.5 with GDN heads of 128 (the flashinfer slice's QWEN3_5_D128)
    q = FIXTURES["qwen3_5"]
    specs.append((D128, q["architecture"], q["dtype"]))
    specs.append((D128, q["mtp_architecture"], q["dtype"]))
    return specs


D128 = "qwen3_5_d128"


def _write_fixture(kind: str, path: Path) -> None:
    if kind == D128:
        write_model("qwen3_5", path, linear_head_dim=128)
    else:
        write_model(kind, path)


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory):
    """One subprocess checks every fixture and architecture."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here")
    tmp_dir = tmp_path_factory.mktemp("vllm-load")
    specs = []
    for kind, arch, dtype in _vllm_specs():
        path = tmp_dir / kind
        if not path.exists():
            _write_fixture(kind, path)
        if arch in HEADS:
            head = HEADS[arch](path, tmp_dir / f"{kind}-{arch}")
            specs.append([kind, f"{path}{os.pathsep}{head}", arch, dtype])
            continue
        if arch == DENSE_DRAFT:
            draft = write_dense_draft(path, tmp_dir / f"{kind}-dense-draft")
            specs.append([kind, str(draft), arch, dtype])
            continue
        specs.append([kind, str(path), arch, dtype])
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
        HSFORK_CPU_TESTBED="0",
        CUDA_VISIBLE_DEVICES="",
        # v0.33.0's Kimi-Linear (vllm/models/kimi_k3) imports the CuTe DSL
        # GEMM-AR kernel at construction unless this is off (cutlass is not
        # installed on the CPU test bed; unknown to v0.26.0)
        VLLM_KIMI_K3_GEMM_AR="0",
        VLLM_LOGGING_LEVEL="ERROR",
    )
    from conftest import run_until_done

    proc = run_until_done(
        [sys.executable, __file__, json.dumps(specs)],
        what="the vLLM load check of the fixtures", cwd=REPO, env=env,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise AssertionError(
            f"vLLM load check failed (rc {proc.returncode}):\n" + proc.stderr[-6000:]
        )
    return {(r["kind"], r["arch"]): r for r in json.loads(lines[-1][7:])}


def _vllm_spec_params():
    """``_vllm_specs`` as parameters; a fixture vLLM cannot load
    (``harness.models.vllm_loads`` False; none today: OLMo-hybrid loads on
    both forks since their patch to its conv loader) is a strict expected
    failure, so a vLLM that loads it shows."""
    out = []
    for s in _vllm_specs():
        marks = []
        if not vllm_loads("qwen3_5" if s[0] == D128 else s[0]):
            marks = [pytest.mark.xfail(strict=True, reason="vLLM's loader fails")]
        out.append(pytest.param(s, id=f"{s[0]}-{s[1]}", marks=marks))
    return out


@pytest.mark.parametrize("spec", _vllm_spec_params())
def test_vllm_model_loads_every_parameter(vllm_results, spec):
    """vLLM's class for the architecture (MTP drafters included), built on
    the CPU from the fixture's config.json, takes every checkpoint tensor
    (its loader raises on an unknown name or a wrong shape) and has every
    element of every parameter written (parameters are NaN before). On a
    line whose registry lacks the class, vLLM refuses it instead."""
    r = vllm_results[spec[:2]]
    if r["skip"]:
        pytest.skip(r["skip"])
    if not on_line("qwen3_5" if spec[0] == D128 else spec[0]):
        # not in this line's registry (FIXTURES' ``lines``; Plamo2 on
        # v0.33.0): vLLM refuses the architecture when the config is built
        assert r["error"] is not None, "loads on a line it is not listed for"
        assert spec[1] in r["error"] and "not supported" in r["error"], r["error"]
        return
    from harness.compat import version_str

    refused = REFUSED_HEADS.get(spec[:2], {}).get(f"v{version_str()}")
    if refused is not None:
        # a head this line has no drafter for, or cannot build for this
        # target: vLLM says so when the speculative config is built (a line
        # that takes the pair shows here)
        assert r["error"] is not None, "builds on a line that refused it"
        assert refused in r["error"], r["error"]
        return
    assert r["error"] is None, r["error"]
    assert r["unloaded"] == [], r["unloaded"]
    assert r["unexpected"] == [], r["unexpected"]
    assert r["nan"] == [], r["nan"]
    # not an empty model: the smallest is NemotronH's MTP step of one
    # attention layer (7 parameters on v0.33.0, 8 on v0.26.0)
    assert r["params"] >= 7


# -- the subprocess ----------------------------------------------------------


def _stand_in_platform() -> str | None:
    """Make vLLM's constructors work on an unresolved (no-device) platform;
    None, or why the check cannot run here."""
    import torch
    from vllm.platforms import current_platform
    from vllm.platforms.interface import UnspecifiedPlatform

    if not isinstance(current_platform, UnspecifiedPlatform):
        return f"needs vLLM's unresolved CPU platform, not {current_platform}"
    import vllm.model_executor.layers.attention.mla_attention as mla
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as um
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
    )

    def backend(selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla:
            return "vllm.v1.attention.backends.mla.triton_mla.TritonMLABackend"
        return "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"

    platform = type(current_platform)
    platform.get_attn_backend_cls = staticmethod(backend)
    platform.current_device = staticmethod(lambda: torch.device("cpu"))
    platform.num_compute_units = staticmethod(lambda device_id=0: 1)
    um.select_unquantized_moe_backend = lambda moe_config: (
        UnquantizedMoeBackend.TRITON,
        None,
    )
    mla.get_mla_prefill_backend = lambda vllm_config: lambda **kw: None
    # v0.33.0's Kimi-Linear (vllm/models/kimi_k3) creates an auxiliary CUDA
    # stream at construction; it is only used in forward

    class NoStream:
        def __init__(self, *args, **kwargs):
            pass

    torch.cuda.Stream = NoStream

    # and picks its MLA prefill backend through the platform (v0.26.0:
    # mla_attention.get_mla_prefill_backend, patched above)
    class NoMLAPrefill:
        def __init__(self, *args, **kwargs):
            pass

        @staticmethod
        def get_name() -> str:
            return "none (CPU load check)"

    platform.get_mla_prefill_backend_cls = staticmethod(lambda *a, **k: NoMLAPrefill)
    return None


def _check(path: str, arch: str, dtype: str, init) -> dict:
    import torch
    from safetensors.torch import safe_open
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.models.registry import ModelRegistry

    from harness.compat import mtp_needs_spec_config

    spec = None
    if arch in HEADS:
        # "target<pathsep>head": the head is built under the target's config
        path, head = path.split(os.pathsep)
    # a fixture whose config class is its own configuration module (Plamo2:
    # harness.models_plamo2) names it in config.json's auto_map
    remote = "auto_map" in json.loads((Path(path) / "config.json").read_text())
    mc = ModelConfig(
        model=path,
        dtype=dtype,
        skip_tokenizer_init=True,
        enforce_eager=True,
        trust_remote_code=remote,
    )
    if arch.endswith(("MTP", "MTPModel")) and mtp_needs_spec_config():
        # v0.33.0: MTP classes read the drafter's quantization config
        spec = SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=1,
            target_model_config=mc,
            target_parallel_config=ParallelConfig(),
        )
    if arch in HEADS:
        # 3: the heads' default number of Medusa heads and DSpark block size
        spec = SpeculativeConfig(
            method=arch,
            model=head,
            num_speculative_tokens=3,
            target_model_config=mc,
            target_parallel_config=ParallelConfig(),
        )
        arch, path = spec.draft_model_config.architectures[0], head
    vc = VllmConfig(
        model_config=mc,
        speculative_config=spec,
        device_config=DeviceConfig(device="cpu"),
    )
    with set_current_vllm_config(vc):
        init()
        cls, _ = ModelRegistry.resolve_model_cls(
            [arch], spec.draft_model_config if spec else mc
        )
        if vc.quant_config is not None:
            # as vLLM's initialize_model does: the model's name mapping and
            # fused modules reach the quantization config (its ignore list)
            from vllm.model_executor.model_loader.utils import configure_quant_config

            configure_quant_config(vc.quant_config, cls)
        with torch.device("cpu"):
            model = cls(vllm_config=vc, prefix="")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for p in params.values():
                if p.is_floating_point():
                    p.fill_(float("nan"))
        with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
            weights = [(k, f.get_tensor(k)) for k in f.keys()]  # noqa: SIM118
        loaded = model.load_weights(iter(weights))
        if loaded is None:
            # some loaders (EAGLE-3 heads) do not say what they loaded: a
            # floating-point parameter is loaded when it is no longer NaN
            loaded = {
                n
                for n, p in params.items()
                if not (p.is_floating_point() and p.isnan().any())
            }

    # some loaders report FusedMoE weights without the ``routed_experts``
    # module in the name
    def norm(names):
        return {n.replace(".routed_experts.", ".") for n in names}

    names, loaded = norm(params), norm(loaded)
    # vLLM's MTP/EAGLE loaders give a drafter without its own lm_head the
    # target's (load_eagle_model, _maybe_share_lm_head): not in the checkpoint
    shared = set()
    if arch.endswith(("MTP", "MTPModel")) and not getattr(
        model, "has_own_lm_head", False
    ):
        shared = {"lm_head.weight"} - loaded
    # an EAGLE, DFlash or DSpark head without a token embedding takes the
    # target's
    if arch.startswith(("Eagle", "DFlash", "Qwen3DSpark")):
        shared = {"model.embed_tokens.weight"} - loaded
    # DFlash reads its mask_embedding only from a mask_embedding.pt shipped
    # beside the checkpoint (none here: the mask token's own embedding row);
    # DSpark never loads it (it masks with the mask token's row)
    if arch.startswith(("DFlash", "Qwen3DSpark")):
        shared |= {"model.mask_embedding"} - loaded
    return {
        "unloaded": sorted(names - loaded - shared),
        "unexpected": sorted(loaded - names),
        "nan": sorted(
            n for n, p in params.items() if n not in shared and p.isnan().any()
        ),
        "params": len(params),
    }


def _subprocess_main(specs: list) -> None:
    results = []
    why = _stand_in_platform()
    state = {"init": False}

    def init():
        """Under the model's config: the groups depend on it (an expert
        parallel group only for MoE models)."""
        from vllm.distributed import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from vllm.distributed.parallel_state import destroy_model_parallel

        if state["init"]:
            destroy_model_parallel()
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{port}",
            )  # fmt: skip
            state["init"] = True
        initialize_model_parallel(1, 1)

    for kind, path, arch, dtype in specs:
        r = {"kind": kind, "arch": arch, "error": None, "skip": why}
        if why is None:
            try:
                r.update(_check(path, arch, dtype, init))
            except Exception as e:  # reported per architecture
                import traceback

                where = traceback.format_exc(limit=-12)
                r["error"] = f"{type(e).__name__}: {e}\n{where}"
        results.append(r)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    _subprocess_main(json.loads(sys.argv[1]))


@pytest.mark.parametrize(
    "kind",
    [
        "qwen3_next",
        "qwen3_5_moe",
        "kimi_linear",
        "jamba",
        "lfm2_moe",
        "bailing_moe_linear",
    ],
)
def test_moe_fixtures_do_not_swap_experts_under_bf16_noise(kind):
    """A MoE fixture's next-token log-probabilities move by no more between
    fp32 and bf16 than a dense fixture's (0.3 nats): with top 2 of 4 random
    experts, bf16 noise swapped the 2nd and 3rd expert and moved them by
    7.3-7.4 nats (Qwen3-Next, Qwen3.5-MoE, Kimi-Linear), a jump the
    margin-aware oracle cannot tell from a bug. harness.models.MOE_EXPERTS
    routes every token to every expert."""
    import torch

    from harness.models import build_model

    _, model = build_model(kind)
    ids = torch.randint(10, 200, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lp32 = model.float()(input_ids=ids).logits.float().log_softmax(-1)
        lp16 = model.to(torch.bfloat16)(input_ids=ids).logits.float().log_softmax(-1)
    assert (lp32 - lp16).abs().max().item() < 1.0


def test_a_fused_olmo_conv_is_written_in_the_published_layout():
    """A transformers that saves OLMo-hybrid's short convs fused (the GPU
    hosts' 5.x) still gives the checkpoint vLLM's mapper loads: q, k and v
    convs, split at the key and value sizes; a tensor of another size is
    refused."""
    import torch

    from harness.models import olmo_hybrid_config, split_olmo_conv

    cfg = olmo_hybrid_config()
    key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    fused = torch.randn(2 * key + value, 1, 4)
    out = split_olmo_conv("model.layers.0.linear_attn.conv1d.weight", fused, cfg)
    assert sorted(out) == [
        f"model.layers.0.linear_attn.{p}_conv1d.weight" for p in "kqv"
    ]
    q = out["model.layers.0.linear_attn.q_conv1d.weight"]
    v = out["model.layers.0.linear_attn.v_conv1d.weight"]
    assert torch.equal(
        torch.cat([q, out["model.layers.0.linear_attn.k_conv1d.weight"], v]), fused
    )
    assert v.shape[0] == value
    with pytest.raises(ValueError, match="rows"):
        split_olmo_conv("x.linear_attn.conv1d.weight", fused[:-1], cfg)


def test_dflash_head_reads_three_distinct_target_layers(tmp_path):
    """vLLM collects one auxiliary hidden state per distinct layer and the
    DFlash head takes three: the 4-layer Qwen3.5 fixture once got [0, 2, 2]
    (512 features where 768 were expected, refused at the first step on a
    GPU, by the fork and upstream alike)."""
    target = tmp_path / "qwen3_5"
    write_model("qwen3_5", target)
    head = write_dflash_head(target, tmp_path / "dflash")
    cfg = json.loads((head / "config.json").read_text())
    n = json.loads((target / "config.json").read_text())["text_config"][
        "num_hidden_layers"
    ]
    ids = cfg["dflash_config"]["target_layer_ids"]
    assert len(set(ids)) == 3 and all(0 <= i <= n - 2 for i in ids), (n, ids)
    for n in range(4, 65):
        ids = dflash_target_layers(n)
        assert len(set(ids)) == 3 and max(ids) <= n - 2
    with pytest.raises(ValueError, match="4 layers"):
        dflash_target_layers(3)


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_medusa_head_layout(tmp_path, kind):
    """A Medusa head of n heads: the config keys vLLM's MedusaConfig reads
    (num_heads n, one residual layer with bias, the target's width and
    vocabulary, no truncated vocabulary) and no other key with "num" and
    "heads" or "layers" in its name (MedusaConfig renames every such key
    to num_heads / num_hidden_layers); vLLM's parameter names, one residual
    block and one LM head per head, in the shapes its Medusa class has."""
    target = tmp_path / kind
    write_model(kind, target)
    tcfg = json.loads((target / "config.json").read_text())
    text = tcfg.get("text_config", tcfg)
    h, v = text["hidden_size"], text["vocab_size"]
    for n in (1, 4):
        head = write_medusa_head(target, tmp_path / f"medusa{n}", num_heads=n)
        cfg = json.loads((head / "config.json").read_text())
        assert cfg["architectures"] == ["MedusaModel"]
        assert cfg["model_type"] == "medusa"
        assert (cfg["num_heads"], cfg["num_hidden_layers"]) == (n, 1)
        assert (cfg["hidden_size"], cfg["vocab_size"]) == (h, v)
        assert cfg["truncated_vocab_size"] == v and cfg["medusa_fc_bias"] is True
        renamed = [k for k in cfg if "num" in k and ("heads" in k or "layers" in k)]
        assert sorted(renamed) == ["num_heads", "num_hidden_layers"]
        want = {}
        for i in range(n):
            want[f"blocks.{i}.layers.0.weight"] = (h, h)
            want[f"blocks.{i}.layers.0.bias"] = (h,)
            want[f"lm_heads.{i}.weight"] = (v, h)
        assert {k: tuple(t.shape) for k, t in _tensors(head).items()} == want


def test_dspark_head_layout_and_target_layers(tmp_path):
    """A DSpark head reads the target layers DFlash's head reads: three
    distinct ones (vLLM adds 1 to each and collects one hidden state per
    distinct layer; fc takes three), at the top level where vLLM's dense
    DSpark lookup finds them (no dflash_config or eagle_config, whose ids
    it reads first), and one decoder layer per target layer (v0.26.0 sizes
    fc by the draft's layer count). Block size and Markov rank as asked,
    the anchor predicting, its own LM head and Markov head, the target's
    token embedding."""
    target = tmp_path / "qwen3_5"
    write_model("qwen3_5", target)
    text = json.loads((target / "config.json").read_text())["text_config"]
    n, h, v = text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]
    head = write_dspark_head(target, tmp_path / "dspark", block_size=5, markov_rank=8)
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    ids = cfg["target_layer_ids"]
    assert ids == dflash_target_layers(n)
    assert len(set(ids)) == 3 and all(1 <= i + 1 <= n - 1 for i in ids), (n, ids)
    assert "dflash_config" not in cfg and "eagle_config" not in cfg
    assert cfg["num_hidden_layers"] == len(ids)
    assert (cfg["block_size"], cfg["markov_rank"]) == (5, 8)
    assert cfg["sample_from_anchor"] is True and cfg["dspark_bonus_anchor"] is False
    assert cfg["use_aux_hidden_state"] is True and 0 <= cfg["mask_token_id"] < v
    assert (cfg["target_hidden_size"], cfg["draft_vocab_size"]) == (h, v)
    t = {k: tuple(x.shape) for k, x in _tensors(head).items()}
    assert t["fc.weight"] == (h, 3 * h)
    assert t["markov_head.markov_w1.weight"] == (v, 8)
    assert t["markov_head.markov_w2.weight"] == (v, 8)
    assert t["lm_head.weight"] == (v, h)
    assert t["hidden_norm.weight"] == t["norm.weight"] == (h,)
    layers = {k.split(".")[1] for k in t if k.startswith("layers.")}
    assert layers == {str(i) for i in range(len(ids))}
    assert not any("embed_tokens" in k or "confidence_head" in k for k in t)


def test_vllm_reads_the_dspark_head_target_layers(tmp_path):
    """vLLM's own lookup of the target layers a drafter reads (the one that
    sets the target's auxiliary hidden states on Model Runner V2) finds the
    DSpark head's three, each plus one."""
    pytest.importorskip("vllm")
    aux = pytest.importorskip("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils")
    from types import SimpleNamespace

    from transformers import AutoConfig

    target = tmp_path / "qwen3_5"
    write_model("qwen3_5", target)
    head = write_dspark_head(target, tmp_path / "dspark")
    ids = json.loads((head / "config.json").read_text())["target_layer_ids"]
    hf = AutoConfig.from_pretrained(head)
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
    assert aux.get_eagle3_aux_layers_from_config(spec) == tuple(i + 1 for i in ids)
