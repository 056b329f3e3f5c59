"""The Plamo2 (PLaMo 2) fixture: its config, its configuration module and a
hand-written weight table.

Hand-written because neither transformers nor vLLM has a Plamo2 config or
model class: published checkpoints (pfnet/plamo-2-*) ship both as remote
code. So no transformers model makes these weights, as it does for the other
fixtures. ``weights`` draws every tensor that vLLM's ``Plamo2ForCausalLM``
loads (v0.26.0 vllm/model_executor/models/plamo2.py, ``Plamo2Model.load_weights``)
under the published checkpoint's names and shapes, and ``CONFIG_MODULE`` is a
configuration module of our own, written beside config.json (``auto_map``),
so that vLLM builds the config with ``trust_remote_code=True`` and no
network. v0.33.0 has no Plamo2 class (its registry lists it as supported
until v0.26.0).

Layer pattern (vLLM's ``is_mamba``): with ``mamba_step`` 2, layer i is
attention where ``i % 2 == 1``; the fixture's four layers are Mamba,
attention, Mamba, attention.
"""

from __future__ import annotations

from pathlib import Path

from . import remote_config
from .remote_config import config_module

CONFIG_FILE = "configuration_plamo2.py"

# the config keys vLLM's Plamo2ForCausalLM reads (models/plamo2.py; head_dim
# comes from hidden_size_per_head, the chunk size from mamba_chunk_size)
KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "rms_norm_eps",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size_per_head",
    "max_position_embeddings",
    "rope_theta",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_num_heads",
    "mamba_step",
    "mamba_chunk_size",
    "intermediate_size",
    "vocab_size",
)

CONFIG_MODULE = config_module(
    """Plamo2's configuration for a generated test fixture (written by
harness.models_plamo2). transformers has no Plamo2 class and published
checkpoints ship theirs as remote code; this one stores the keys vLLM's
Plamo2ForCausalLM reads and passes the others to PretrainedConfig.""",
    "Plamo2Config",
    "plamo2",
    KEYS,
)


def plamo2_config(vocab: int, special_ids: dict) -> dict:
    """Four layers (``mamba_step`` 2: Mamba, attention, Mamba, attention),
    hidden 256; Mamba: 4 heads of 64 (the head size is
    ``hidden_size_per_head``), state 64, conv 4, one B/C group; attention:
    4 query and 2 KV heads of 64, q/k RMS norms, RoPE. The config class is
    ``CONFIG_MODULE`` (``auto_map``)."""
    return {
        "architectures": ["Plamo2ForCausalLM"],
        "model_type": "plamo2",
        "auto_map": {"AutoConfig": f"{CONFIG_FILE[:-3]}.Plamo2Config"},
        "vocab_size": vocab,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "mamba_step": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size_per_head": 64,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "mamba_d_state": 64,
        "mamba_d_conv": 4,
        "mamba_num_heads": 4,
        "mamba_chunk_size": 256,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        **special_ids,
        "dtype": "float32",
    }


def is_mamba(cfg: dict, i: int) -> bool:
    """Whether layer ``i`` is a Mamba layer (vLLM's ``is_mamba``)."""
    step, n = cfg["mamba_step"], cfg["num_hidden_layers"]
    if n <= step // 2:
        return i != n - 1
    return i % step != step // 2


def time_step_rank(cfg: dict) -> int:
    """The dt projection's rank (vLLM's ``Plamo2MambaMixer``)."""
    return max(64, cfg["hidden_size"] // 16)


def weights(cfg: dict, seed: int, lm_head_std: float, embed_std: float) -> dict:
    """The checkpoint tensors, under the published names (vLLM renames
    ``A_log``, ``*_norm_weight``, ``q_weight`` and ``k_weight`` on load).

    Linear weights normal(0, ``initializer_range``); the embedding
    normal(0, ``embed_std``) and the output head normal(0, ``lm_head_std``)
    (as ``harness.models._shape_weights`` does for the other fixtures);
    the depthwise conv uniform(+-1/sqrt(kernel)) as torch's Conv1d; Mamba's
    ``A_log`` log(1..heads), ``D`` ones and ``dt_bias`` the inverse softplus
    of a log-uniform step in [1e-3, 0.1] (Mamba2's init). The decoder
    layers' four norms and the final norm are stored zero-centred, as
    published checkpoints store them (vLLM's loader adds the offsets 1,
    1/5, 1 and 5**-1.5, and 1); the other norms are ones."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    h, ff, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["hidden_size_per_head"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    nh, state, kernel = (
        cfg["mamba_num_heads"],
        cfg["mamba_d_state"],
        cfg["mamba_d_conv"],
    )
    inner, rank = nh * hd, time_step_rank(cfg)

    def normal(*shape, s=std):
        return torch.randn(shape, generator=g) * s

    out = {"model.embed_tokens.weight": normal(vocab, h, s=embed_std)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.layers.{i}."
        if is_mamba(cfg, i):
            m = p + "mixer."
            dt = torch.exp(
                torch.rand(nh, generator=g) * (math.log(0.1) - math.log(1e-3))
                + math.log(1e-3)
            ).clamp(min=1e-4)
            bound = 1 / math.sqrt(kernel)
            out |= {
                # per head: [gate (hd rows), x (hd rows)]
                m + "in_proj.weight": normal(2 * inner, h),
                m + "conv1d.weight": (torch.rand((inner, 1, kernel), generator=g)
                                      * 2 - 1) * bound,
                m + "bcdt_proj.weight": normal(rank + 2 * state, inner),
                m + "dt_proj.weight": normal(nh, rank),
                m + "dt_bias": dt + torch.log(-torch.expm1(-dt)),
                m + "A_log": torch.log(torch.arange(1, nh + 1, dtype=torch.float32)),
                m + "D": torch.ones(nh),
                m + "dt_norm_weight": torch.ones(rank),
                m + "B_norm_weight": torch.ones(state),
                m + "C_norm_weight": torch.ones(state),
                m + "out_proj.weight": normal(h, inner),
            }  # fmt: skip
        else:
            m = p + "mixer."
            out |= {
                m + "qkv_proj.weight": normal((nq + 2 * nkv) * hd, h),
                m + "o_proj.weight": normal(h, nq * hd),
                m + "q_weight": torch.ones(nq, hd),
                m + "k_weight": torch.ones(nkv, hd),
            }
        out |= {
            p + "mlp.gate_up_proj.weight": normal(2 * ff, h),
            p + "mlp.down_proj.weight": normal(h, ff),
        }
        for norm in ("pre_mixer_norm", "post_mixer_norm", "pre_mlp_norm",
                     "post_mlp_norm"):  # fmt: skip
            out[p + f"{norm}.weight"] = torch.zeros(h)
    out["model.norm.weight"] = torch.zeros(h)
    out["lm_head.weight"] = normal(vocab, h, s=lm_head_std)
    return {k: v.contiguous() for k, v in out.items()}


def write_config_module(out: str | Path) -> None:
    """``CONFIG_MODULE`` beside the fixture's config.json."""
    remote_config.write_config_module(out, CONFIG_FILE, CONFIG_MODULE)
