"""Offline Hugging Face model cache, generated from our own code.

No machine here reaches a model hub. Upstream tests that name a hub model
(``Qwen/Qwen3.5-0.8B``...) get a generated config served from a local hub
cache instead: ``HF_HUB_CACHE=<out>`` with ``HF_HUB_OFFLINE=1``. The cache has
the layout huggingface_hub writes (``models--org--name/refs/main`` and
``snapshots/<revision>/``), the revision being a hash of the files, so the
same generator always produces the same tree.

The configs are shaped like the published ones (layer pattern, head counts,
vocabulary) but are written here; no weights are included.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from .common import REPO


def _layer_types(n: int, interval: int) -> list[str]:
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(n)
    ]


def qwen3_5_text(
    *,
    hidden_size: int,
    num_layers: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    linear_k_heads: int,
    linear_v_heads: int,
    vocab_size: int = 248320,
    tie: bool = False,
    mtp_layers: int = 1,
) -> dict:
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": 256,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "layer_types": _layer_types(num_layers, 4),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": linear_k_heads,
        "linear_num_value_heads": linear_v_heads,
        "mtp_num_hidden_layers": mtp_layers,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "tie_word_embeddings": tie,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "use_cache": True,
    }


def qwen3_5_vl(text: dict, *, vision_depth: int, vision_hidden: int) -> dict:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_5",
            "depth": vision_depth,
            "hidden_size": vision_hidden,
            "hidden_act": "gelu_pytorch_tanh",
            "intermediate_size": vision_hidden * 4,
            "num_heads": max(1, vision_hidden // 64),
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": text["hidden_size"],
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [],
            "initializer_range": 0.02,
        },
    }


def qwen3_5_0_8b() -> dict[str, bytes]:
    text = qwen3_5_text(
        hidden_size=1024,
        num_layers=24,
        intermediate_size=3584,
        num_heads=8,
        num_kv_heads=2,
        linear_k_heads=16,
        linear_v_heads=16,
        tie=True,
    )
    return {"config.json": _dump(qwen3_5_vl(text, vision_depth=12, vision_hidden=768))}


def qwen3_5_9b() -> dict[str, bytes]:
    text = qwen3_5_text(
        hidden_size=4096,
        num_layers=32,
        intermediate_size=12288,
        num_heads=16,
        num_kv_heads=4,
        linear_k_heads=16,
        linear_v_heads=32,
    )
    return {"config.json": _dump(qwen3_5_vl(text, vision_depth=27, vision_hidden=1152))}


def _dump(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


# hub id -> generator of {file name: content}
MODELS: dict[str, Callable[[], dict[str, bytes]]] = {
    "Qwen/Qwen3.5-0.8B": qwen3_5_0_8b,
    "Qwen/Qwen3.5-9B": qwen3_5_9b,
}


def default_cache() -> Path:
    return Path(os.environ.get("HSFORK_HF_CACHE", REPO / ".cache" / "hf" / "hub"))


def write_model(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name])
    revision = digest.hexdigest()
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / revision
    snap.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = snap / name
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    return snap


def write_model_cache(out: str | Path | None = None) -> Path:
    cache = Path(out) if out else default_cache()
    for repo_id, make in MODELS.items():
        write_model(cache, repo_id, make())
    return cache
