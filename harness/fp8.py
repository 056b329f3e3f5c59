"""A block-FP8 copy of a bf16 Qwen3.5 checkpoint, in the layout vLLM's
``fp8`` loader reads from published FP8 checkpoints (issue: production
paths, FP8 cells).

Why by hand: the tools that write such checkpoints (llm-compressor, the
model authors' own scripts) need the hub or a GPU, and none writes the
``quant_method: fp8`` block layout for a checkpoint our code generates. The
layout (``docs/production-paths-v0.33.0.md``, section 3):

- ``config.json`` (and ``text_config``) gains ``quantization_config``:
  ``quant_method: fp8``, ``activation_scheme: dynamic``, ``fmt: e4m3``,
  ``weight_block_size: [128, 128]`` and ``modules_to_not_convert``;
- each quantized Linear ``<m>.weight`` becomes ``float8_e4m3fn`` with
  ``<m>.weight_scale_inv`` of shape ``[ceil(out/128), ceil(in/128)]``: per
  128x128 block, the factor that turns the FP8 values back into the
  weight (``w ~= fp8 * scale_inv``, the block's absolute maximum over 448);
- quantized: attention q/k/v/o, GDN ``in_proj_qkv``, ``in_proj_z``,
  ``out_proj``, the MLP, and the MTP head's linear layers (the MTP drafter
  inherits the target's quantization in vLLM); every other 2-D weight stays
  bf16 and its module is listed, by its full checkpoint name, in
  ``modules_to_not_convert`` (vLLM matches that list exactly, after mapping
  the names to its own): GDN ``in_proj_a``/``in_proj_b`` (their fused output
  is not a multiple of the block), ``lm_head``, the embeddings and the
  vision tower. ``conv1d``, norms and the GDN gates are no Linear layers.

``python -m harness.fp8 SRC OUT`` (SRC: a folder with ``config.json`` and
``model.safetensors``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn
# Linear layers that become FP8 (a suffix of the checkpoint name, before
# ``.weight``)
QUANTIZED = re.compile(
    r"\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)"
    r"|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|fc)\.weight$"
)


def quantize_block(w):
    """(fp8 weight, scale_inv) of a 2-D weight, per BLOCK x BLOCK block."""
    import torch

    out_f, in_f = w.shape
    rows, cols = -(-out_f // BLOCK), -(-in_f // BLOCK)
    pad = torch.zeros(rows * BLOCK, cols * BLOCK, dtype=torch.float32)
    pad[:out_f, :in_f] = w.float()
    blocks = pad.view(rows, BLOCK, cols, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(rows * BLOCK, cols * BLOCK)[:out_f, :in_f]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv.float()


def dequantize_block(q, scale_inv):
    out_f, in_f = q.shape
    s = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return q.float() * s[:out_f, :in_f]


def quantization_config(not_converted: list[str]) -> dict:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": sorted(not_converted),
    }


def write_fp8(src: Path, out: Path) -> dict:
    """Write the FP8 copy of ``src`` to ``out``; returns what was quantized."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, out / f.name)
    tensors, quantized, kept = {}, [], []
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no iteration
            t = f.get_tensor(name)
            if QUANTIZED.search(name) and t.dim() == 2:
                if t.shape[0] % BLOCK or t.shape[1] % BLOCK:
                    raise ValueError(
                        f"{name}: {tuple(t.shape)} is not a multiple of the "
                        f"{BLOCK}x{BLOCK} block"
                    )
                q, s = quantize_block(t)
                tensors[name] = q
                tensors[name.removesuffix("weight") + "weight_scale_inv"] = s
                quantized.append(name)
            else:
                tensors[name] = t
                if name.endswith(".weight") and t.dim() == 2:
                    kept.append(name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    qc = quantization_config([n.removesuffix(".weight") for n in kept])
    config["quantization_config"] = qc
    if "text_config" in config:
        config["text_config"]["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"quantized": quantized, "kept_2d": kept}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    a = ap.parse_args(argv)
    done = write_fp8(Path(a.src), Path(a.out))
    print(
        f"{len(done['quantized'])} linear weights in FP8, "
        f"{len(done['kept_2d'])} 2-D weights kept: {a.out}"
    )


if __name__ == "__main__":
    main()
