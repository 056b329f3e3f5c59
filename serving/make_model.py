"""Model directories for ``vllm serve``: the Qwen3.5-9B shape with random
weights, and the fast-apply fixture with a chat template.

``qwen9b OUT``: a checkpoint as users download one (``config.json``,
``generation_config.json``, sharded bf16 safetensors with
``model.safetensors.index.json``, ``tokenizer.json``,
``tokenizer_config.json`` with a chat template), so ``vllm serve OUT`` runs
the whole loading path (no ``--load-format dummy``):

- config: ``hsfork.fixtures.qwen3_5_9b`` (the offline hub cache's
  Qwen3.5-9B config: hidden 4096, 32 layers, 3:1 Gated DeltaNet : full
  attention, 16/4 attention heads of 256, 16/32 linear heads of 128,
  intermediate 12288, vocab 248320, a 27-block vision tower) with one MTP
  layer (``mtp_num_hidden_layers: 1``, as published);
- weights: every tensor of transformers' ``Qwen3_5ForConditionalGeneration``
  (vision tower included; names and shapes read from the model built on the
  ``meta`` device) plus the ``mtp.*`` tensors vLLM's ``Qwen3_5MTP`` loads,
  about 9.7 B parameters (19 GB in bf16). Drawn on ``--device`` (cuda on the
  GPU host: about a minute for the whole checkpoint, most of it the file
  writes), each tensor from its own generator seeded by ``--seed`` and its
  index, initialised as transformers does: linear and embedding weights
  normal(0, 0.02), output projections (``o_proj``, ``out_proj``,
  ``down_proj``) normal(0, 0.02 / sqrt(2 * layers)) so the residual stream
  stays bounded, zero-centred ``(1 + w)`` RMSNorm gains (the gated GDN norm
  and LayerNorms: ones), GDN ``A_log = log U(1, 16)``, ``dt_bias = 1``,
  biases 0;
- tokenizer: ``serving.tokenizer`` (byte-level BPE trained here, padded to
  the 248320 ids; Qwen's special tokens and a ChatML chat template).

The weights are random: the text is meaningless, near-ties between logits
are more common than in a trained model, and MTP drafts are rarely
accepted. What the run proves is the serving path at the real shape.

``fastapply OUT``: a copy of the fast-apply fixture (``fixtures/fastapply``,
trained, bf16, 256-word vocabulary ``t0``..``t249`` + specials, see
``harness.fastapply``) with a chat template. Its prompts are token
sequences; as text they are the words ``t<id>`` joined by single spaces
(``prompt_text``), which the fixture's word-level tokenizer (whitespace
split) encodes back to the same ids. The chat template concatenates the
messages' contents with single spaces and adds nothing else (no role
markers, no generation prompt): a chat request whose user message is
``prompt_text(prompt)`` reaches the model as exactly ``prompt``. The
copy's ``tokenizer_config.json`` drops ``unk_token`` (``t0``, which is also
the newline word): as a special token it would vanish from output text.

Serve it with ``--tokenizer OUT/tokenizer`` (a copy of the tokenizer files
without ``config.json``): transformers 5 loads its own ``Qwen3_5Tokenizer``
for any directory whose ``config.json`` says ``qwen3_5`` (``qwen3_5`` is in
``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``, so ``tokenizer_class`` in
``tokenizer_config.json`` is overridden), and that class replaces the
fixture's whitespace pre-tokenizer and word-piece decoder with Qwen's
byte-level ones: every ``t<id>`` word then encodes to ``t0`` (unknown) and
the output text loses its spaces. (The harness passes token ids, so it
never met this.) The 9B-shaped model's tokenizer is built with Qwen3.5's
own pre-tokenizer, so ``Qwen3_5Tokenizer`` encodes it unchanged.

    python -m serving.make_model qwen9b OUT [--device cuda] [--seed 0]
    python -m serving.make_model fastapply OUT [--src fixtures/fastapply]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .tokenizer import CONTENT_TEMPLATE

REPO = Path(__file__).resolve().parent.parent
FASTAPPLY_SRC = REPO / "fixtures" / "fastapply"
SHARD_BYTES = 4 << 30
STD = 0.02

# The fast-apply chat template: the contents, space-separated, nothing else.
FASTAPPLY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first -%}{{- ' ' -}}{%- endif -%}"
    + CONTENT_TEMPLATE
    + "{%- endfor -%}"
)


def prompt_text(ids) -> str:
    """A fast-apply prompt (ids below the special ones) as the text the
    fixture's word-level tokenizer encodes back to ``ids``."""
    return " ".join(f"t{int(i)}" for i in ids)


# ---------------------------------------------------------------------------
# config


def qwen9b_config(mtp_layers: int = 1) -> dict:
    """``hsfork.fixtures.qwen3_5_9b``'s config (the offline hub cache's
    Qwen3.5-9B) with ``mtp_layers`` MTP layers."""
    from hsfork.fixtures import qwen3_5_9b

    cfg = json.loads(qwen3_5_9b()["config.json"])
    cfg["text_config"]["mtp_num_hidden_layers"] = mtp_layers
    cfg.setdefault("dtype", "bfloat16")
    return cfg


def tiny_config(mtp_layers: int = 1) -> dict:
    """The 9B config shrunk for CPU tests and dry runs: the same layout
    (3:1 GDN : attention, MTP layer, vision tower, vocab 248320), hidden 64,
    4 layers."""
    cfg = qwen9b_config(mtp_layers)
    t = cfg["text_config"]
    t.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=t["layer_types"][:4],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    # mrope sections cover the rotary pairs: 32 * 0.25 / 2 = 4
    t["rope_parameters"]["mrope_section"] = [2, 1, 1]
    v = cfg["vision_config"]
    v.update(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=1,
        out_hidden_size=64,
        num_position_embeddings=64,
    )
    return cfg


def _hf_config(cfg: dict):
    from transformers import Qwen3_5Config

    keys = (
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "tie_word_embeddings",
    )
    return Qwen3_5Config(
        text_config=cfg["text_config"],
        vision_config=cfg["vision_config"],
        **{k: cfg[k] for k in keys if k in cfg},
    )


# ---------------------------------------------------------------------------
# tensor plan


def tensor_plan(cfg: dict, std: float = STD) -> list[tuple[str, tuple, str, float]]:
    """``(name, shape, init, std)`` of every checkpoint tensor, in order.
    ``init``: ``normal``, ``zeros``, ``ones``, ``a_log``. Read from
    transformers' model built on the meta device (no memory)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(_hf_config(cfg))
    kinds: dict[str, str] = {}
    for mname, mod in model.named_modules():
        cls = type(mod).__name__
        for pname, _ in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if cls.endswith("RMSNormGated") or cls == "LayerNorm":
                kinds[full] = "ones" if pname == "weight" else "zeros"
            elif cls.endswith("RMSNorm"):
                kinds[full] = "zeros"  # (1 + w)
            elif pname == "A_log":
                kinds[full] = "a_log"
            elif pname == "dt_bias":
                kinds[full] = "ones"
            elif pname == "bias":
                kinds[full] = "zeros"
            else:
                kinds[full] = "normal"
    text = cfg["text_config"]
    out_std = std / math.sqrt(2 * text["num_hidden_layers"])

    def entry(name, shape, kind):
        s = std
        if kind == "normal" and name.rsplit(".", 2)[-2] in (
            "o_proj",
            "out_proj",
            "down_proj",
        ):
            s = out_std
        return (name, tuple(shape), kind, s)

    plan = [entry(n, t.shape, kinds[n]) for n, t in model.state_dict().items()]
    if text.get("mtp_num_hidden_layers", 0):
        h = text["hidden_size"]
        full = text["layer_types"].index("full_attention")
        prefix = f"model.language_model.layers.{full}."
        for name, shape, kind, _ in list(plan):
            if name.startswith(prefix):
                plan.append(entry("mtp.layers.0." + name[len(prefix) :], shape, kind))
        plan.append(entry("mtp.fc.weight", (h, 2 * h), "normal"))
        for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
            plan.append(entry(f"mtp.{norm}.weight", (h,), "zeros"))
    return plan


def shard_plan(plan, shard_bytes: int = SHARD_BYTES, itemsize: int = 2):
    """Consecutive groups of ``plan`` of at most ``shard_bytes`` each (a
    bigger tensor gets a shard of its own)."""
    shards: list[list] = [[]]
    size = 0
    for item in plan:
        n = math.prod(item[1]) * itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


# ---------------------------------------------------------------------------
# safetensors writer (streams tensors: no second copy of a shard in memory)


def _header(entries: list[tuple[str, tuple, str, int]]) -> bytes:
    """safetensors header for ``(name, shape, dtype, nbytes)`` entries."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, dtype, nbytes in entries:
        meta[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [off, off + nbytes],
        }
        off += nbytes
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def _init(t, kind: str, std: float, gen) -> None:
    if kind == "normal":
        t.normal_(0.0, std, generator=gen)
    elif kind == "zeros":
        t.zero_()
    elif kind == "ones":
        t.fill_(1.0)
    elif kind == "a_log":
        t.uniform_(1.0, 16.0, generator=gen).log_()
    else:
        raise ValueError(kind)


def write_random_checkpoint(
    cfg: dict,
    out: str | Path,
    device: str = "cpu",
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    std: float = STD,
    writers: int = 4,
    log=print,
) -> dict:
    """Random bf16 weights for ``cfg`` (a ``Qwen3_5ForConditionalGeneration``
    config dict) in ``out``: ``model.safetensors`` when one shard holds
    them, else ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json``. Tensors are drawn on ``device`` and
    written by ``writers`` threads (one file each at a time)."""
    import torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = tensor_plan(cfg, std)
    shards = shard_plan(plan, shard_bytes)
    n = len(shards)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    t0 = time.time()
    index = {name: i for i, (name, *_) in enumerate(plan)}
    lock = threading.Lock()  # one shard's tensors generated at a time

    def write_shard(k: int) -> int:
        entries = [
            (name, shape, "BF16", math.prod(shape) * 2)
            for name, shape, _, _ in shards[k]
        ]
        path = out / names[k]
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_header(entries))
            for name, shape, kind, s in shards[k]:
                with lock:
                    gen = torch.Generator(device=device)
                    gen.manual_seed(seed * 1_000_003 + index[name])
                    t = torch.empty(shape, dtype=torch.bfloat16, device=device)
                    _init(t, kind, s, gen)
                    host = t.to("cpu").contiguous()
                    del t
                f.write(memoryview(host.view(torch.int16).numpy()).cast("B"))
                del host
        tmp.replace(path)
        return path.stat().st_size

    with ThreadPoolExecutor(max_workers=max(1, writers)) as pool:
        sizes = list(pool.map(write_shard, range(n)))
    total = sum(math.prod(s) * 2 for _, s, _, _ in plan)
    if n > 1:
        weight_map = {
            name: names[k] for k, shard in enumerate(shards) for name, *_ in shard
        }
        (out / "model.safetensors.index.json").write_text(
            json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map},
                indent=2,
            )
            + "\n"
        )
    res = {
        "tensors": len(plan),
        "params": sum(math.prod(s) for _, s, _, _ in plan),
        "bytes": total,
        "shards": n,
        "file_bytes": sum(sizes),
        "write_s": round(time.time() - t0, 1),
        "device": device,
        "seed": seed,
    }
    log(json.dumps({"checkpoint": res}))
    return res


# ---------------------------------------------------------------------------
# the two model directories


def write_qwen9b(
    out: str | Path,
    device: str = "cuda",
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    cfg: dict | None = None,
    log=print,
) -> dict:
    """The Qwen3.5-9B-shaped serving model (see the module docstring).
    ``cfg`` replaces the 9B config (tests use a tiny one)."""
    from . import tokenizer as tk

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = cfg or qwen9b_config()
    text = cfg["text_config"]
    if text["vocab_size"] != tk.VOCAB:
        raise ValueError(f"vocab_size {text['vocab_size']} != tokenizer's {tk.VOCAB}")
    t0 = time.time()
    tok = tk.write(out, seed)
    log(json.dumps({"tokenizer": tok}))
    ckpt = write_random_checkpoint(cfg, out, device, seed, shard_bytes, log=log)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [tk.IM_END_ID, tk.ENDOFTEXT_ID],
                "pad_token_id": tk.ENDOFTEXT_ID,
                "do_sample": False,
            }
        )
        + "\n"
    )
    info = {
        "kind": "qwen3_5_9b_shape",
        "hidden": text["hidden_size"],
        "layers": text["num_hidden_layers"],
        "layer_types": {
            t: text["layer_types"].count(t) for t in set(text["layer_types"])
        },
        "vocab": text["vocab_size"],
        "mtp_layers": text.get("mtp_num_hidden_layers", 0),
        "tokenizer": tok,
        "checkpoint": ckpt,
        "total_s": round(time.time() - t0, 1),
    }
    (out / "serving_model.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def write_fastapply(out: str | Path, src: str | Path = FASTAPPLY_SRC) -> dict:
    """The fast-apply fixture copied to ``out`` with the chat template in
    its ``tokenizer_config.json``."""
    src, out = Path(src), Path(out)
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"no fixture in {src}")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copyfile(f, out / f.name)
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["chat_template"] = FASTAPPLY_CHAT_TEMPLATE
    # the fixture names t0 (the newline word, id 0) as unk_token: transformers
    # then registers it as a special token, and vLLM's detokenizer (skipping
    # special tokens) drops every newline from the output text. The word-level
    # model keeps t0 as its own unknown word; nothing else needs the entry.
    tc["unk_token"] = None
    tc.setdefault("add_bos_token", False)
    tc.setdefault("clean_up_tokenization_spaces", False)
    text = json.dumps(tc, indent=2) + "\n"
    (out / "tokenizer_config.json").write_text(text)
    # the tokenizer on its own (no config.json beside it): what to serve
    # with (`--tokenizer OUT/tokenizer`), see the module docstring
    tok_dir = out / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    shutil.copyfile(src / "tokenizer.json", tok_dir / "tokenizer.json")
    (tok_dir / "tokenizer_config.json").write_text(text)
    return {
        "kind": "fastapply",
        "src": str(src),
        "out": str(out),
        "tokenizer": str(tok_dir),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.make_model")
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("qwen9b", help="Qwen3.5-9B shape, random weights")
    q.add_argument("out")
    q.add_argument("--device", default="cuda")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--shard-gb", type=float, default=4.0)
    q.add_argument(
        "--tiny", action="store_true", help="the shrunk config (CPU dry runs)"
    )
    f = sub.add_parser("fastapply", help="the fast-apply fixture + chat template")
    f.add_argument("out")
    f.add_argument("--src", default=str(FASTAPPLY_SRC))
    a = ap.parse_args(argv)
    if a.cmd == "qwen9b":
        cfg = tiny_config() if a.tiny else None
        shard = int(a.shard_gb * (1 << 30))
        info = write_qwen9b(a.out, a.device, a.seed, shard, cfg)
    else:
        info = write_fastapply(a.out, a.src)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
