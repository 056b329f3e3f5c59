"""The Bailing-MoE-linear fixture (Ling/Ring 2.5: vLLM's
``BailingMoeV2_5ForCausalLM`` and its MTP drafter ``BailingMoeV25MTPModel``):
its config, its configuration module and a torch model of our own whose
parameters are the checkpoint.

Hand-written because transformers has no model class for it: published
checkpoints ship their modeling and configuration code as remote code
(``configuration_bailing_moe_v2_5.py``). Their config says ``model_type``
"bailing_hybrid", which vLLM keys on (its MLA detection and the MTP switch
in ``SpeculativeConfig``), but the ``BailingHybridConfig`` that transformers
5.20 and 5.24 have under that name is another model's (Ling 3.0: KDA
layers; it sets ``head_dim`` to ``qk_rope_head_dim``), and a transformers
without it cannot read the config at all. So
``CONFIG_MODULE``, a configuration module of our own, is written beside
config.json (``auto_map``) and vLLM builds the config with
``trust_remote_code=True`` (the fixture's ``engine_kwargs``), the same on
every transformers.

The weights: ``BailingMoeLinearForCausalLM``'s parameters carry the names and
shapes of the published checkpoint (``model.word_embeddings``,
``model.layers.<i>.attention.*``, ``mlp.gate.expert_bias``, per-expert
``gate/up/down_proj``; the MTP layer as ``model.layers.<num_hidden_layers>``),
the ones vLLM's ``BailingMoeV25Model.load_weights`` and
``BailingMoeV25MTPModel.load_weights`` read (bailing_moe_linear.py,
bailing_moe_mtp.py; the same on v0.26.0 and v0.33.0). Its forward follows
vLLM's source (lightning attention with per-layer decay, gated group norm;
MLA; sigmoid-routed MoE with a shared expert) in plain PyTorch, so the
fixture's margins and its routing under bf16 can be measured on a CPU as the
other fixtures' are; it was not compared with vLLM's kernels (vLLM runs no
forward pass on a CPU here).

Layer pattern (vLLM's ``is_linear_layer``): with ``layer_group_size`` 4,
layer i is linear attention unless ``(i + 1) % 4 == 0``: three lightning
attention layers, then one MLA layer.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from . import remote_config
from .remote_config import config_module

CONFIG_FILE = "configuration_bailing_moe_linear.py"

# the config keys vLLM's BailingMoeV2_5ForCausalLM, its lightning attention
# (layers/mamba/linear/bailing_linear_attn.py, base.py) and its MTP drafter
# read
KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "layer_group_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "partial_rotary_factor",
    "use_qk_norm",
    "group_norm_size",
    "linear_silu",
    "use_bias",
    "use_qkv_bias",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
    "num_experts",
    "num_experts_per_tok",
    "num_shared_experts",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "score_function",
    "moe_router_enable_expert_bias",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "router_dtype",
    "num_nextn_predict_layers",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "initializer_range",
)

CONFIG_MODULE = config_module(
    """Bailing-MoE-linear's configuration for a generated test fixture
(written by harness.models_bailing). Published checkpoints ship theirs as
remote code; transformers' class for model_type "bailing_hybrid" is another
model's. This one stores the keys vLLM's BailingMoeV2_5ForCausalLM reads and
passes the others to PretrainedConfig.""",
    "BailingMoeLinearConfig",
    "bailing_hybrid",
    KEYS,
)


def bailing_moe_linear_config(
    vocab: int, experts: int, eos_id: int, mtp_layers: int = 1
) -> dict:
    """Four layers (``layer_group_size`` 4: three lightning attention layers,
    then MLA), hidden 256. Lightning attention: 4 heads of 64, q/k RMS
    norms, RoPE on half of each head, the output normed over all heads
    (``group_norm_size`` 1) and gated. MLA without q LoRA at the published
    latent sizes (kv_lora_rank 512 + rope 64 = 576, as the Kimi-Linear
    fixture: the size vLLM's FlashMLA-type backends take; Triton MLA takes
    any). Layer 0 a dense MLP, the others a small MoE (``experts``, all
    routed; sigmoid router with expert bias, one shared expert). One MTP
    layer (``num_nextn_predict_layers``). The config class is
    ``CONFIG_MODULE`` (``auto_map``)."""
    return {
        "architectures": ["BailingMoeV2_5ForCausalLM"],
        "model_type": "bailing_hybrid",
        "auto_map": {"AutoConfig": f"{CONFIG_FILE[:-3]}.BailingMoeLinearConfig"},
        "vocab_size": vocab,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "layer_group_size": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        # the lightning attention's head size (the MLA sizes are below)
        "head_dim": 64,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        # one norm over all heads' outputs: with a norm per head
        # (group_norm_size = heads) a head whose q.k sums to near zero at an
        # early position flips sign under bf16 noise and the norm scales the
        # flip up to the head's full output: next-token log-probabilities
        # moved by up to 7.6 nats between fp32 and bf16 over seeds 0-3,
        # 0.34-0.42 with one group (tests/test_harness_models_more.py,
        # test_moe_fixtures_do_not_swap_experts_under_bf16_noise)
        "group_norm_size": 1,
        "linear_silu": False,
        "use_bias": False,
        "use_qkv_bias": False,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_interleave": True,
        "num_experts": experts,
        "num_experts_per_tok": experts,
        "num_shared_experts": 1,
        "moe_intermediate_size": 128,
        "first_k_dense_replace": 1,
        "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "router_dtype": "fp32",
        "num_nextn_predict_layers": mtp_layers,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        "bos_token_id": 1,
        "pad_token_id": 0,
        # vLLM's MLA backends take no float32 (``dtype="auto"`` picks this;
        # the weights are stored in float32)
        "dtype": "bfloat16",
    }


def is_linear_layer(cfg: dict, i: int) -> bool:
    """Whether layer ``i`` is lightning attention (vLLM's
    ``is_linear_layer``); the others are MLA."""
    group = cfg["layer_group_size"]
    return group > 0 and (i + 1) % group != 0


def is_moe_layer(cfg: dict, i: int) -> bool:
    """Whether layer ``i``'s MLP is the MoE (vLLM's decoder layer)."""
    return cfg["num_experts"] > 1 and i >= cfg["first_k_dense_replace"]


def write_config_module(out: str | Path) -> None:
    """``CONFIG_MODULE`` beside the fixture's config.json."""
    remote_config.write_config_module(out, CONFIG_FILE, CONFIG_MODULE)


# -- the model -----------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def _inv_freq(dim: int, theta: float, device=None):
    ar = torch.arange(0, dim, 2, dtype=torch.float32, device=device)
    return 1.0 / theta ** (ar / dim)


def _rope_neox(x, positions, rot: int, theta: float):
    """RoPE on the first ``rot`` channels of ``x`` (..., T, heads, d),
    halves rotated (vLLM's ``is_neox_style=True``)."""
    freqs = positions.float()[:, None] * _inv_freq(rot, theta, positions.device)
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    xr, xp = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out.to(x.dtype), xp], dim=-1)


def _rope_interleaved(x, positions, theta: float):
    """RoPE on all channels of ``x`` (..., T, heads, d), pairs (2i, 2i+1)
    rotated (vLLM's ``is_neox_style=False``, the MLA layers')."""
    d = x.shape[-1]
    freqs = positions.float()[:, None] * _inv_freq(d, theta, positions.device)
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)


def slopes(num_heads: int, layer: int, num_layers: int):
    """The lightning attention's per-head decay rates in layer ``layer``
    (vLLM's ``BailingMoELinearAttention``: MiniMax's ALiBi slopes scaled by
    ``1 - layer / (num_layers - 1) + 1e-5``)."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    def get(n):
        if math.log2(n).is_integer():
            return power_of_2(n)
        p = 2 ** math.floor(math.log2(n))
        return power_of_2(p) + get(2 * p)[0::2][: n - p]

    s = torch.tensor(get(num_heads), dtype=torch.float32)
    if num_layers <= 1:
        return s * (1 + 1e-5)
    return s * (1 - layer / (num_layers - 1) + 1e-5)


class MLP(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        n = cfg["num_experts"]
        self.weight = nn.Parameter(torch.empty(n, cfg["hidden_size"]))
        self.expert_bias = nn.Parameter(torch.zeros(n))


class MoE(nn.Module):
    """Routed experts and a shared expert. The router runs in float32
    (``router_dtype`` fp32); sigmoid scores plus the expert bias pick the
    experts (group-limited), the unbiased scores of the picked ones,
    renormalised and times ``routed_scaling_factor``, weigh their outputs;
    the shared expert's output is added unscaled."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, n = cfg["hidden_size"], cfg["num_experts"]
        self.cfg = cfg
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(
            MLP(h, cfg["moe_intermediate_size"]) for _ in range(n)
        )
        self.shared_experts = MLP(
            h, cfg["moe_intermediate_size"] * cfg["num_shared_experts"]
        )

    def forward(self, x):
        cfg = self.cfg
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = F.linear(flat.float(), self.gate.weight.float()).to(x.dtype)
        scores = torch.sigmoid(logits.float())
        biased = scores + self.gate.expert_bias.float()
        groups, n = cfg["n_group"], cfg["num_experts"]
        top2 = biased.view(-1, groups, n // groups).topk(min(2, n // groups), -1)
        picked = top2.values.sum(-1).topk(cfg["topk_group"], -1).indices
        mask = torch.zeros_like(top2.values[..., 0]).scatter_(1, picked, 1.0)
        mask = mask.repeat_interleave(n // groups, dim=1)
        sel = biased.masked_fill(mask == 0, float("-inf"))
        idx = sel.topk(cfg["num_experts_per_tok"], -1).indices
        w = scores.gather(1, idx)
        if cfg["norm_topk_prob"]:
            w = w / w.sum(-1, keepdim=True)
        w = w * cfg["routed_scaling_factor"]
        outs = torch.stack([e(flat) for e in self.experts], dim=1)  # (N, E, h)
        picked_out = outs.gather(1, idx[..., None].expand(-1, -1, shape[-1]))
        routed = (picked_out.float() * w[..., None]).sum(1).to(x.dtype)
        return (routed + self.shared_experts(flat)).reshape(shape)


class GroupNorm(nn.Module):
    """The lightning attention's output norm: RMS over each of
    ``group_norm_size`` groups of channels, one weight per channel."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, x):
        shape = x.shape
        g = x.float().reshape(*shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return g.reshape(shape) * self.weight.float()


class LightningAttention(nn.Module):
    """vLLM's ``BailingMoELinearAttention``: fused q/k/v (float32 from here
    on), per-head q/k RMS norms, RoPE, q scaled by head_dim**-0.5, then per
    head o_t = sum_{j<=t} exp(-s (t - j)) (q_t . k_j) v_j (the recurrence
    kv_t = exp(-s) kv_{t-1} + k_t v_t^T, o_t = q_t kv_t), normed
    (``GroupNorm``), gated by sigmoid(g_proj(x)), projected by ``dense``."""

    def __init__(self, cfg: dict, layer: int):
        super().__init__()
        h, nh, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
        self.cfg, self.nh, self.d = cfg, nh, d
        bias = cfg["use_bias"] or cfg["use_qkv_bias"]
        self.query_key_value = nn.Linear(h, 3 * nh * d, bias=bias)
        if cfg["use_qk_norm"]:
            self.query_layernorm = RMSNorm(d, cfg["rms_norm_eps"])
            self.key_layernorm = RMSNorm(d, cfg["rms_norm_eps"])
        self.g_proj = nn.Linear(h, nh * d, bias=False)
        self.g_norm = GroupNorm(nh * d, cfg["group_norm_size"], cfg["rms_norm_eps"])
        self.dense = nn.Linear(nh * d, h, bias=cfg["use_bias"])
        s = slopes(nh, layer, cfg["num_hidden_layers"])
        self.register_buffer("slope", s, persistent=False)

    def forward(self, x, positions):
        cfg, nh, d = self.cfg, self.nh, self.d
        b, t, _ = x.shape
        qkv = self.query_key_value(x).float()
        if cfg["linear_silu"]:
            qkv = F.silu(qkv)
        q, k, v = qkv.view(b, t, 3, nh, d).unbind(2)
        if cfg["use_qk_norm"]:
            q = self.query_layernorm(q)
            k = self.key_layernorm(k)
        rot = int(d * cfg["partial_rotary_factor"])
        q = _rope_neox(q, positions, rot, cfg["rope_theta"])
        k = _rope_neox(k, positions, rot, cfg["rope_theta"])
        q = q * d**-0.5
        # decay[h, i, j] = exp(-s_h (i - j)) for j <= i, else 0
        ar = torch.arange(t, device=x.device)
        dist = (ar[:, None] - ar[None, :]).float()
        decay = torch.exp(-self.slope.float()[:, None, None] * dist.clamp(min=0))
        decay = decay * (dist >= 0)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) * decay
        o = torch.einsum("bhij,bjhd->bihd", scores, v).reshape(b, t, nh * d)
        o = self.g_norm(o) * torch.sigmoid(self.g_proj(x).float())
        return self.dense(o.to(x.dtype))


class MLA(nn.Module):
    """Multi-head latent attention (vLLM's ``BailingMoeV25MLAAttention``):
    q from ``q_proj`` (or q LoRA), a shared latent and RoPE key from
    ``kv_a_proj_with_mqa``, the latent normed and expanded to per-head keys
    and values by ``kv_b_proj``; interleaved RoPE on the rope channels,
    causal softmax attention scaled by (nope + rope)**-0.5, ``dense`` out."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
        self.cfg, self.nh = cfg, nh
        nope, rope, vd = (
            cfg["qk_nope_head_dim"],
            cfg["qk_rope_head_dim"],
            cfg["v_head_dim"],
        )
        r, qr = cfg["kv_lora_rank"], cfg["q_lora_rank"]
        bias = cfg["use_qkv_bias"]
        if qr is None:
            self.q_proj = nn.Linear(h, nh * (nope + rope), bias=False)
        else:
            self.q_a_proj = nn.Linear(h, qr, bias=bias)
            self.q_a_layernorm = RMSNorm(qr, cfg["rms_norm_eps"])
            self.q_b_proj = nn.Linear(qr, nh * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, r + rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(r, cfg["rms_norm_eps"])
        self.kv_b_proj = nn.Linear(r, nh * (nope + vd), bias=False)
        self.dense = nn.Linear(nh * vd, h, bias=bias)

    def forward(self, x, positions):
        cfg, nh = self.cfg, self.nh
        nope, rope, vd = (
            cfg["qk_nope_head_dim"],
            cfg["qk_rope_head_dim"],
            cfg["v_head_dim"],
        )
        b, t, _ = x.shape
        if cfg["q_lora_rank"] is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(b, t, nh, nope + rope).split([nope, rope], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([cfg["kv_lora_rank"], rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, nh, nope + vd)
        k_nope, v = kv.split([nope, vd], -1)
        theta = cfg["rope_theta"]
        q_pe = _rope_interleaved(q_pe, positions, theta)
        k_pe = _rope_interleaved(k_pe[:, :, None, :], positions, theta)
        qh = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
        kh = torch.cat([k_nope, k_pe.expand(-1, -1, nh, -1)], -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qh.float(),
            kh.float(),
            v.transpose(1, 2).float(),
            is_causal=True,
            scale=(nope + rope) ** -0.5,
        )
        return self.dense(o.transpose(1, 2).reshape(b, t, nh * vd).to(x.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, i: int):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps)
        self.attention = (
            LightningAttention(cfg, i) if is_linear_layer(cfg, i) else MLA(cfg)
        )
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = (
            MoE(cfg) if is_moe_layer(cfg, i) else MLP(h, cfg["intermediate_size"])
        )

    def forward(self, x, positions):
        x = x + self.attention(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(nn.Module):
    """The MTP layer's weights (vLLM's
    ``BailingMoeV25MultiTokenPredictorLayer``): the norms of the token
    embedding (``enorm``) and of the target's hidden state (``hnorm``), the
    fusion ``eh_proj``, one MLA + MoE decoder layer and ``final_layernorm``
    (the output head is the target's). No forward: the fixture's checks run
    the target only."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.attention = MLA(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MoE(cfg)
        self.final_layernorm = RMSNorm(h, eps)


class Body(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        n = cfg["num_hidden_layers"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i) for i in range(n)]
            + [MTPLayer(cfg) for _ in range(cfg["num_nextn_predict_layers"])]
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class BailingMoeLinearForCausalLM(nn.Module):
    """The fixture's weights (``state_dict()`` is the checkpoint) and a
    reference forward of the target model: ``model(input_ids=ids).logits``
    for ``ids`` of shape (batch, length), positions from 0. Linear and
    embedding weights normal(0, ``initializer_range``), the expert bias
    normal(0, ``initializer_range``) (it only picks experts, and every
    expert is picked), norms ones."""

    def __init__(self, cfg: dict):
        super().__init__()
        if cfg["num_hidden_layers"] % cfg["layer_group_size"]:
            # the published modeling code makes trailing layers of a partial
            # group full attention, vLLM makes them linear
            raise ValueError("num_hidden_layers must be whole layer groups")
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        std = cfg["initializer_range"]
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear | nn.Embedding):
                    m.weight.normal_(0.0, std)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()
                elif isinstance(m, Gate):
                    m.weight.normal_(0.0, std)
                    m.expert_bias.normal_(0.0, std)

    def get_input_embeddings(self):
        return self.model.word_embeddings

    def forward(self, input_ids):
        n = self.cfg["num_hidden_layers"]
        x = self.model.word_embeddings(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        for layer in self.model.layers[:n]:
            x = layer(x, positions)
        return SimpleNamespace(logits=self.lm_head(self.model.norm(x)))


def build(vocab: int, experts: int, eos_id: int, mtp: bool = True):
    """``(config dict, model)``: the fixture's config and a freshly drawn
    ``BailingMoeLinearForCausalLM`` (seed torch's global generator first).
    ``vocab``, ``experts`` and ``eos_id`` are ``harness.models``' (passed in:
    that module imports this one)."""
    cfg = bailing_moe_linear_config(vocab, experts, eos_id, mtp_layers=1 if mtp else 0)
    return cfg, BailingMoeLinearForCausalLM(cfg)
