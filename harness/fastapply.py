"""The fast-apply fixture: a tiny Qwen3.5 trained to apply edits to code.

Speculative decoding is only exercised naturally by a model whose greedy
output is predictable from its prompt. This module makes one: a synthetic
"fast-apply" task (the prompt holds rename instructions and a file with a
marked span; the answer is the span with the renames applied, then EOS), a
tiny hybrid Qwen3.5 (Gated DeltaNet + full attention) trained on it in a few
GPU minutes, and the evaluations (transformers greedy on any device, vLLM on
a GPU host). With n-gram (prompt lookup) drafting the answers give a natural
mix of steps: copied runs are accepted, a renamed identifier rejects the
draft that copied the old name (partial accepts), right after a new name the
suffix occurs nowhere before (zero-draft steps), and drafts that end before
the next rename are accepted in full (common for k <= 8, rare for k = 64,
whose drafts run past the span's end). ``python -m harness.fastapply stats``
replays vLLM's n-gram proposer on the reference answers to count them.

Task (word-level ids, ``harness.models`` conventions: VOCAB 256, special ids
250..255 at the top, EOS 255; markers 240..244)::

    RENAME a b [RENAME c d ...] FILE ctx_before SPAN span END ctx_after ANSWER
    -> span with every a replaced by b (c by d ...) EOS

Answers 41-121 tokens (EOS included), prompts 50-300. The code is lines of
keywords/punctuation (ids 0..31) and identifiers (ids 32..239) from templates
(assignments, calls, ``def``/``if``/``for`` blocks with indented bodies), each
example drawing identifiers from a pool of 10-20 with Zipf-like reuse, so
bigrams recur as in real code. Two choices make the task learnable in minutes:

- the code region (markers included) is *deterministic at order* ``ORDER``
  (3): any 3 consecutive tokens determine the next one (lines that would
  break this are redrawn). Otherwise an exact copy must know *which* of two
  identical contexts it is at, which local (induction-style) copying cannot
  tell; and the span's end (EOS) would be ambiguous;
- the renames come *before* the code: while the prompt is processed every
  occurrence of ``a`` can already attend to ``RENAME a b`` and carry ``b``,
  so emitting ``b`` is the same one-hop copy as any other token. With the
  instructions after the code it takes a second lookup after the copy; a
  small CPU-trained model then emitted the new name for only ~15% of renamed
  tokens while copying the rest at ~98%.

New names are fresh identifiers (in the prompt only in their instruction), so
the answer has the span's length and a renamed token aligns with its original.

Curriculum (why a naive copy run stays at uniform loss): copying is learned
by an induction mechanism (match the current context against the source,
emit the token after the match) that forms only after a plateau; its gradient
signal shrinks with the number of candidate source positions, so with long
random spans from step 0 the plateau outlasts a short run. Here the
curriculum ``difficulty(level)`` starts with pure copies of at most 12 tokens
without file context (the plateau is a few hundred steps), then brings in
renames, longer spans and file context. ``level`` rises with training
progress, but only while the running answer-token accuracy is >= 0.9
(``train``'s gate): harder examples wait until the easier ones are learned.
Every batch samples difficulty uniformly up to the current ceiling, so short
examples stay in the mix. Loss is on answer tokens only (the prompt's code is
random by design; predicting it wastes capacity). The model uses a 1:1
GDN/attention layer pattern: attention layers do the exact lookups, the GDN
layer before each one (with its short convolution) supplies the local
n-gram features they match on.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# the task (vocabulary, generator, curriculum levels, n-gram replay) lives in
# harness.fastapply_task; its names stay importable from here
from .fastapply_task import (  # noqa: F401
    ANSWER,
    CODE_WORDS,
    END,
    FILE,
    FULL,
    IDENT_HI,
    IDENT_LO,
    INDENT,
    MARKERS,
    NL,
    ORDER,
    PROMPT_MAX,
    RENAME,
    SPAN,
    SPAN_POOL,
    ZIPF,
    Difficulty,
    _code,
    _Region,
    detok,
    difficulty,
    make_eval_set,
    make_example,
    ngram_draft,
    ngram_spec,
    sample_difficulty,
    simulate_ngram,
    simulate_set,
)
from .models import EOS_ID, VOCAB

# ---------------------------------------------------------------------------
# model


@dataclass(frozen=True)
class ModelSize:
    hidden: int = 256
    intermediate: int = 512
    layers: int = 6  # alternating GDN, attention (1:1)
    heads: int = 4
    head_dim: int = 64


CPU_SIZE = ModelSize(hidden=128, intermediate=256, layers=4, heads=4, head_dim=32)


def model_config(size: ModelSize = ModelSize(), mtp: bool = True) -> dict:
    """``harness.models``' Qwen3.5 config (tiny vision tower, MTP layer),
    with the text model resized and a 1:1 GDN/attention layer pattern."""
    from .models import qwen3_5_config

    cfg = qwen3_5_config(VOCAB, mtp_layers=1 if mtp else 0)
    text = cfg["text_config"]
    text.update(
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=max(1, size.heads // 2),
        head_dim=size.head_dim,
        full_attention_interval=2,
        layer_types=["linear_attention", "full_attention"] * (size.layers // 2),
        linear_key_head_dim=size.head_dim,
        linear_value_head_dim=size.head_dim,
        linear_num_key_heads=max(1, size.heads // 2),
        linear_num_value_heads=size.heads,
    )
    # mrope sections (t, h, w) cover the rotary pairs: [3, 3, 2] at head_dim 64
    rope = text["rope_parameters"]
    pairs = int(size.head_dim * rope["partial_rotary_factor"]) // 2
    w = pairs // 4
    rope["mrope_section"] = [pairs - w - (pairs - w) // 2, (pairs - w) // 2, w]
    cfg["vision_config"]["out_hidden_size"] = size.hidden
    return cfg


def force_torch_gdn() -> None:
    """Make transformers' Qwen3.5 run its reference torch GDN and conv
    functions even where ``fla``/``causal_conv1d`` are installed (fla's
    Triton kernels refuse backward on Hopper). transformers binds the
    implementation when the module is imported; the GDN layer calls the
    module-level names, so they are replaced by the unwrapped torch ones."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    for name in (
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    ):
        fn = getattr(m, name, None)
        if fn is None:
            continue
        raw = inspect.unwrap(fn)
        code = getattr(raw, "__code__", None)
        if (
            code is None
            or Path(code.co_filename).resolve() != Path(m.__file__).resolve()
        ):
            raise RuntimeError(f"cannot find the torch reference of {name}")
        setattr(m, name, raw)


def _text_model(size: ModelSize, seed: int):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    force_torch_gdn()
    torch.manual_seed(seed)
    text = dict(model_config(size)["text_config"])
    text.pop("model_type", None)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).float()


def save_checkpoint(
    lm,
    size: ModelSize,
    out: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    meta: dict | None = None,
) -> Path:
    """Write ``lm`` (a trained ``Qwen3_5ForCausalLM``) as the checkpoint
    ``harness.models.write_model`` would: a ``Qwen3_5ForConditionalGeneration``
    (tiny random vision tower, weights ``model.language_model.*``,
    ``lm_head``), random ``mtp.*`` weights (vLLM skips them unless MTP is
    requested), config, generation config, tokenizer, ``fixture.json``."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForConditionalGeneration

    from .models import _mtp_tensors, _write_tokenizer, qwen3_5_hf_config

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = model_config(size)
    cfg_dict["dtype"] = cfg_dict["text_config"]["dtype"] = dtype
    torch.manual_seed(seed)
    full = Qwen3_5ForConditionalGeneration(qwen3_5_hf_config(cfg_dict)).float()
    full.model.language_model.load_state_dict(lm.model.state_dict())
    full.lm_head.load_state_dict(lm.lm_head.state_dict())
    tensors = dict(full.state_dict())
    tensors.update(_mtp_tensors(full, cfg_dict["text_config"], seed))

    # the trained weights in ``dtype``; the random vision tower and MTP layer
    # (never used by the fixture's runs) in bf16, to stay small
    def cast(name, t):
        extra = name.startswith(("mtp.", "model.visual."))
        return t.detach().to("cpu", torch.bfloat16 if extra else getattr(torch, dtype))

    tensors = {k: cast(k, v).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": EOS_ID, "do_sample": False}) + "\n"
    )
    _write_tokenizer(out, VOCAB)
    info = {
        "kind": "fastapply",
        "vocab": VOCAB,
        "size": asdict(size),
        "seed": seed,
        "dtype": dtype,
        "mtp": "random",
    }
    info.update(meta or {})
    (out / "fixture.json").write_text(json.dumps(info, indent=2) + "\n")
    return out


def load_model(model_dir: str | Path, device: str = "cpu"):
    """The checkpoint as transformers' ``Qwen3_5ForConditionalGeneration``
    (fp32, eval mode, torch GDN path)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    force_torch_gdn()
    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(model_dir), dtype=torch.float32
    )
    return model.to(device).eval()


# ---------------------------------------------------------------------------
# evaluation (transformers)


def _padded(examples, device):
    """Inputs (prompt + answer minus its last token) and labels (answer
    tokens at the positions that predict them, -100 elsewhere)."""
    import torch

    seqs = [list(p) + list(a) for p, a in examples]
    width = max(map(len, seqs)) - 1
    inp = torch.full((len(seqs), width), EOS_ID, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, ((p, a), s) in enumerate(zip(examples, seqs, strict=True)):
        inp[i, : len(s) - 1] = torch.tensor(s[:-1])
        lab[i, len(p) - 1 : len(s) - 1] = torch.tensor(list(a))
    return inp.to(device), lab.to(device)


def _answer_logits(model, inp, lab):
    """Logits at the answer positions only (``model`` is a causal LM or the
    conditional-generation wrapper)."""
    inner = (
        model.model.language_model
        if hasattr(model.model, "language_model")
        else model.model
    )
    hidden = inner(input_ids=inp, use_cache=False).last_hidden_state
    mask = lab != -100
    return model.lm_head(hidden[mask]), lab[mask]


def token_accuracy(model, examples, batch: int = 32) -> float:
    """Teacher-forced: share of answer tokens that are the greedy choice."""
    import torch

    device = next(model.parameters()).device
    right = total = 0
    with torch.no_grad():
        for i in range(0, len(examples), batch):
            inp, lab = _padded(examples[i : i + batch], device)
            logits, target = _answer_logits(model, inp, lab)
            right += (logits.argmax(-1) == target).sum().item()
            total += target.numel()
    return right / max(total, 1)


def greedy(model, prompts, max_new: int = 128, batch: int = 32) -> list[list[int]]:
    """Greedy continuations with transformers' ``generate`` (left-padded
    batches), each cut after its first EOS."""
    import torch

    device = next(model.parameters()).device
    outs = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), EOS_ID, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=EOS_ID,
                pad_token_id=EOS_ID,
            )
        for row in gen[:, width:].tolist():
            outs.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
    return outs


def exact_match(preds, answers) -> dict:
    """Exact match (EOS included) and the greedy prefix agreement: the
    share of answer tokens before the first divergence."""
    exact = prefix = total = 0
    for p, a in zip(preds, answers, strict=True):
        p, a = list(p), list(a)
        exact += p == a
        n = 0
        while n < min(len(p), len(a)) and p[n] == a[n]:
            n += 1
        prefix += n
        total += len(a)
    return {
        "n": len(answers),
        "exact_match": exact / max(len(answers), 1),
        "prefix_tokens": prefix / max(total, 1),
    }


def evaluate(model, examples, batch: int = 32) -> dict:
    preds = greedy(model, [p for p, _ in examples], batch=batch)
    res = exact_match(preds, [a for _, a in examples])
    res["token_accuracy"] = token_accuracy(model, examples, batch)
    return res


# ---------------------------------------------------------------------------
# training


def _make_batch(seed: int, index: int, ceiling: Difficulty, batch: int):
    """A padded training batch (numpy: cheap to pass between processes)."""
    import numpy as np

    rng = random.Random(f"fastapply-train-{seed}-{index}")
    # the curriculum is complete: half of the batch at full difficulty
    at_ceiling = 0.5 if ceiling == difficulty(1.0) else 0.0
    examples = [
        make_example(rng, sample_difficulty(rng, ceiling, at_ceiling))
        for _ in range(batch)
    ]
    width = max(len(p) + len(a) for p, a in examples) - 1
    inp = np.full((batch, width), EOS_ID, dtype=np.int64)
    lab = np.full((batch, width), -100, dtype=np.int64)
    for i, (p, a) in enumerate(examples):
        s = p + a
        inp[i, : len(s) - 1] = s[:-1]
        lab[i, len(p) - 1 : len(s) - 1] = a
    return inp, lab


class _Batches:
    """Training batches, made ``depth`` steps ahead in worker processes
    (forked before CUDA starts) or inline when ``workers`` is 0."""

    def __init__(self, seed: int, batch: int, workers: int, depth: int = 6):
        self.seed, self.batch, self.depth = seed, batch, depth
        self.pool = None
        if workers:
            import multiprocessing as mp

            self.pool = mp.get_context("fork").Pool(workers)
        self.pending: list = []
        self.next_index = 0

    def get(self, ceiling: Difficulty):
        if self.pool is None:
            self.next_index += 1
            return _make_batch(self.seed, self.next_index, ceiling, self.batch)
        while len(self.pending) < self.depth:
            self.next_index += 1
            args = (self.seed, self.next_index, ceiling, self.batch)
            self.pending.append(self.pool.apply_async(_make_batch, args))
        return self.pending.pop(0).get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()


def train(
    out_dir: str | Path,
    steps: int = 20000,
    device: str = "cuda",
    budget_s: float | None = None,
    batch: int = 64,
    lr: float = 1e-3,
    size: ModelSize = ModelSize(),
    seed: int = 0,
    workers: int = 0,
    warmup: int = 150,
    gate: float = 0.9,
    ramp: float = 0.55,
    gate_every: int = 10,
    floor_from: float = 0.3,
    floor_full: float = 0.8,
    eval_n: int = 64,
    log_every: int = 50,
    save_dtype: str = "float32",
    log=print,
) -> dict:
    """Train the fixture, evaluate it, write the checkpoint to ``out_dir``.

    Progress ``p`` is ``max(step / steps, elapsed / budget_s)``: a wall-time
    budget ends the run on time whatever the device's speed, and the
    learning rate (linear warmup, cosine to 0.1x) follows ``p``. The
    curriculum level moves from 0 to 1 over ``ramp`` of the progress, but
    only while the running answer-token accuracy is at least ``gate`` (read
    every ``gate_every`` steps): a harder distribution is not shown before
    the easier one is learned. It is never below the floor that rises from
    0 at ``floor_from`` to 1 at ``floor_full``, so a time-boxed run ends with
    a phase on the full task (by then copying is learned; the harder data
    only slows it down)."""
    import torch

    t_start = time.time()
    batches = _Batches(seed, batch, workers)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    lm = _text_model(size, seed).to(device).train()
    opt = torch.optim.AdamW(
        lm.parameters(),
        lr=lr,
        betas=(0.9, 0.98),
        weight_decay=0.01,
        fused=device.startswith("cuda"),
    )
    probe = make_eval_set(32, seed + 1000)
    history: list[dict] = []
    level = p_prev = 0.0
    acc_ema = 0.0
    t0 = time.time()
    step = 0
    p = 0.0
    cuda = device.startswith("cuda")
    # per-step metrics stay on the device: reading them back each step would
    # stall the launch queue (the step time is launch-bound on a GPU)
    losses: list = []
    accs: list = []
    window: list = []
    try:
        while p < 1.0:
            ceiling = difficulty(level)
            inp, lab = (torch.from_numpy(x) for x in batches.get(ceiling))
            if cuda:
                inp, lab = (x.pin_memory().to(device, non_blocking=True)
                            for x in (inp, lab))  # fmt: skip
            cur_lr = lr * min(1.0, (step + 1) / warmup)
            cur_lr *= 0.1 + 0.45 * (1 + math.cos(math.pi * min(p, 1.0)))
            for g in opt.param_groups:
                g["lr"] = cur_lr
            logits = lm.lm_head(
                lm.model(input_ids=inp, use_cache=False).last_hidden_state
            )
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), lab.flatten(), ignore_index=-100
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            opt.step()
            step += 1
            with torch.no_grad():
                mask = lab != -100
                hit = ((logits.argmax(-1) == lab) & mask).sum()
                accs.append(hit / mask.sum())
                losses.append(loss.detach())
            elapsed = time.time() - t0
            p = step / steps
            if budget_s:
                p = max(p, elapsed / budget_s)
            logging = step % log_every == 0 or p >= 1.0
            if step % gate_every == 0 or logging:
                # the gate: the level rises with progress while the running
                # accuracy is >= gate; the floor makes sure the full task
                # gets the last part of a time-boxed run
                got = torch.stack(accs).tolist()
                window += list(zip(torch.stack(losses).tolist(), got, strict=True))
                accs.clear()
                losses.clear()
                for a in got:
                    acc_ema = a if acc_ema == 0.0 else 0.9 * acc_ema + 0.1 * a
                if acc_ema >= gate:
                    level = level + (p - p_prev) / ramp
                floor = (p - floor_from) / (floor_full - floor_from)
                level = min(1.0, max(level, floor))
                p_prev = p
            if logging:
                row = {
                    "step": step,
                    "progress": round(p, 3),
                    "elapsed_s": round(elapsed, 1),
                    "loss": round(sum(x for x, _ in window) / len(window), 4),
                    "acc": round(sum(a for _, a in window) / len(window), 4),
                    "level": round(level, 3),
                    "span_max": ceiling.span_max,
                    "lr": round(cur_lr, 6),
                    "steps_per_s": round(step / elapsed, 2),
                }
                window.clear()
                if step % (log_every * 5) == 0 or p >= 1.0:
                    lm.eval()
                    row["full_token_acc"] = round(token_accuracy(lm, probe), 4)
                    lm.train()
                history.append(row)
                log(json.dumps(row))
    finally:
        batches.close()
    train_s = time.time() - t0
    lm.eval()
    meta = {
        "task": {
            "order": ORDER,
            "span_pool": SPAN_POOL,
            "zipf": ZIPF,
            "full": asdict(FULL),
            "prompt_max": PROMPT_MAX,
        },
        "train": {
            "steps": step,
            "train_s": round(train_s, 1),
            "batch": batch,
            "lr": lr,
            "final_level": round(level, 3),
            "uniform_loss": round(math.log(VOCAB), 4),
        },
        "history": history,
    }
    out = save_checkpoint(lm, size, out_dir, seed, save_dtype, meta)
    model = load_model(out, device)
    res = evaluate(model, make_eval_set(eval_n, 0))
    res["total_s"] = round(time.time() - t_start, 1)
    info = json.loads((out / "fixture.json").read_text())
    info["eval_transformers"] = res
    (out / "fixture.json").write_text(json.dumps(info, indent=2) + "\n")
    log(json.dumps({"eval": res}))
    return res


# ---------------------------------------------------------------------------
# MTP head (trained on the frozen fixture)


def mtp_head(text_config):
    """The layers of vLLM's ``Qwen3_5MultiTokenPredictor`` in transformers'
    own Qwen3.5 modules: ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
    ``fc`` (2h -> h), one full-attention decoder layer, ``norm``; the
    embedding and the output head are the target's. Position ``i`` reads the
    target's final hidden state at ``i`` and the embedding of token ``i+1``
    and predicts token ``i+2``, as vLLM's MTP proposer feeds it."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    h, eps = text_config.hidden_size, text_config.rms_norm_eps
    full = text_config.layer_types.index("full_attention")
    head = torch.nn.Module()
    head.pre_fc_norm_embedding = m.Qwen3_5RMSNorm(h, eps=eps)
    head.pre_fc_norm_hidden = m.Qwen3_5RMSNorm(h, eps=eps)
    head.fc = torch.nn.Linear(2 * h, h, bias=False)
    head.layer = m.Qwen3_5DecoderLayer(text_config, layer_idx=full)
    head.norm = m.Qwen3_5RMSNorm(h, eps=eps)
    return head


def mtp_forward(head, lm, inp):
    """MTP logits for ``inp`` (batch, L): position ``i`` predicts token
    ``i+2`` (the last position has no next token and is dropped)."""
    import torch

    with torch.no_grad():
        hidden = lm.model(input_ids=inp, use_cache=False).last_hidden_state
        emb = lm.model.embed_tokens(inp[:, 1:])
    x = torch.cat(
        [head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(hidden[:, :-1])],
        dim=-1,
    )
    x = head.fc(x)
    pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    # text-only M-RoPE: the three sections share the text position
    rope = lm.model.rotary_emb(x, pos.expand(3, x.shape[0], -1))
    out = head.layer(x, position_embeddings=rope, attention_mask=None, position_ids=pos)
    x = out[0] if isinstance(out, tuple) else out
    return lm.lm_head(head.norm(x))


def mtp_tensors(head) -> dict:
    """``head``'s weights under the checkpoint names vLLM's Qwen3.5 MTP
    loads (``harness.models._mtp_tensors`` writes the same names)."""
    out = {}
    for name, t in head.state_dict().items():
        if name.startswith("layer."):
            name = "layers.0." + name[len("layer.") :]
        out["mtp." + name] = t
    return out


def train_mtp(
    model_dir: str | Path,
    device: str = "cuda",
    budget_s: float = 60.0,
    batch: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    log=print,
) -> dict:
    """Train the MTP head of the fixture in ``model_dir`` on the fast-apply
    task with the target frozen, and write it into the checkpoint (bf16, in
    place). Reports the head's teacher-forced top-1 accuracy on the answer
    tokens of held-out examples (the share of first drafts a perfect verify
    would accept)."""
    import torch
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    full = load_model(model_dir, device)
    lm = _LM(full)
    for prm in full.parameters():
        prm.requires_grad_(False)
    torch.manual_seed(seed)
    head = mtp_head(full.config.text_config).to(device).float().train()
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    t0 = time.time()
    step = 0
    index = 10**6  # other batches than the fixture's training
    while time.time() - t0 < budget_s:
        index += 1
        inp, lab = (
            torch.from_numpy(x).to(device)
            for x in _make_batch(seed, index, FULL, batch)
        )
        # lab[:, i] is the token at i+1; the MTP target at i is the token at
        # i+2, i.e. lab[:, i+1]
        logits = mtp_forward(head, lm, inp)
        tgt = lab[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), tgt.flatten(), ignore_index=-100
        )
        cur = lr * min(1.0, (step + 1) / 50)
        cur *= 0.5 * (1 + math.cos(math.pi * min((time.time() - t0) / budget_s, 1)))
        for g in opt.param_groups:
            g["lr"] = cur
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 100 == 0:
            log(json.dumps({"mtp_step": step, "loss": round(loss.item(), 4)}))
    head.eval()
    right = total = 0
    with torch.no_grad():
        examples = make_eval_set(64, 0)
        for i in range(0, 64, 32):
            inp, lab = _padded(examples[i : i + 32], device)
            logits = mtp_forward(head, lm, inp)
            tgt = lab[:, 1:]
            mask = tgt != -100
            right += ((logits.argmax(-1) == tgt) & mask).sum().item()
            total += mask.sum().item()
    res = {"mtp_steps": step, "mtp_top1": round(right / max(total, 1), 4)}
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    new = mtp_tensors(head)
    assert set(new) == {k for k in tensors if k.startswith("mtp.")}, "names"
    for k, v in new.items():
        tensors[k] = v.detach().to("cpu", tensors[k].dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    info = json.loads((model_dir / "fixture.json").read_text())
    info["mtp"] = "trained"
    info["mtp_train"] = res | {"budget_s": budget_s, "batch": batch, "lr": lr}
    (model_dir / "fixture.json").write_text(json.dumps(info, indent=2) + "\n")
    log(json.dumps(res))
    return res


class _LM:
    """The text model and output head of a loaded checkpoint, as ``train``'s
    causal LM exposes them (``.model``, ``.lm_head``)."""

    def __init__(self, full):
        self.model = full.model.language_model
        self.lm_head = full.lm_head


# ---------------------------------------------------------------------------
# vLLM (GPU host)


def vllm_exact_match(
    model_dir: str | Path,
    prompts,
    answers,
    batch: int = 1,
    spec_config: dict | None = None,
    dtype: str = "bfloat16",
    max_tokens: int | None = None,
    runner: str = "v1",
    async_sched: bool = False,
) -> dict:
    """Greedy decoding of ``prompts`` in vLLM, ``batch`` requests in flight,
    with ``spec_config`` (``None``: no speculation): exact match against
    ``answers`` (EOS included: a request must stop at EOS), the output tokens
    and vLLM's spec-decode counters. Engine settings as
    ``harness.equivalence`` uses for Qwen3.5."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from .equivalence import Cell, _shutdown, engine_kwargs, set_runner

    set_runner(runner)  # v1 | mrv2 | default (vLLM's pick)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    drafter = "none" if spec_config is None else spec_config.get("method", "spec")
    k = 0 if spec_config is None else spec_config.get("num_speculative_tokens", 0)
    cell = Cell("qwen3_5", drafter, k, batch, runner, async_sched=async_sched)
    cell = dataclasses.replace(cell, dtype=dtype)
    kw = engine_kwargs(cell, str(model_dir), spec_config)
    t0 = time.time()
    llm = LLM(**kw)
    try:
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens or max(map(len, answers)) + 8,
        )
        outs = []
        t1 = time.time()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            outs += llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in chunk],
                sp,
                use_tqdm=False,
            )
        gen_s = time.time() - t1
        metrics = {}
        try:
            for m in llm.get_metrics():
                if "spec_decode" in m.name:
                    if hasattr(m, "value"):
                        metrics[m.name] = m.value
                    elif hasattr(m, "values"):
                        metrics[m.name] = list(m.values)
        except Exception:  # noqa: BLE001 - metrics are informative only
            pass
    finally:
        _shutdown(llm)
    preds = []
    for o in outs:
        c = o.outputs[0]
        toks = list(c.token_ids)
        # stopped at EOS: make the EOS part of the output whether or not
        # vLLM lists it
        if c.finish_reason == "stop" and (not toks or toks[-1] != EOS_ID):
            toks.append(EOS_ID)
        preds.append(toks)
    res = exact_match(preds, answers)
    res.update(
        batch=batch,
        spec=spec_config,
        runner=runner,
        async_scheduling=async_sched,
        dtype=dtype,
        tokens=sum(map(len, preds)),
        engine_s=round(t1 - t0, 1),
        generate_s=round(gen_s, 2),
        spec_metrics=metrics,
        outputs=preds,
    )
    if spec_config and spec_config.get("method") == "ngram":
        # the step mix these outputs get from vLLM's proposer (replayed)
        res["ngram_steps_replayed"] = simulate_set(
            zip(prompts, preds, strict=True),
            spec_config["num_speculative_tokens"],
            spec_config.get("prompt_lookup_min", 2),
            spec_config.get("prompt_lookup_max", 10),
        )
    return res


def summary_table(results: list[tuple[str, list[dict]]]) -> str:
    """Markdown table of ``vllm`` results (``(variant, rows)``): exact match,
    greedy prefix agreement, whether the outputs equal the variant's first
    non-speculative run, and the drafter's acceptance."""
    lines = [
        "| variant | runner | async | drafter | k | BS | exact match | prefix "
        "tokens | = non-spec | drafts | accepted/drafted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, rows in results:
        for r in rows:
            spec = r.get("spec") or {}
            m = r.get("spec_metrics") or {}
            drafts = m.get("vllm:spec_decode_num_drafts")
            drafted = m.get("vllm:spec_decode_num_draft_tokens")
            acc = m.get("vllm:spec_decode_num_accepted_tokens")
            rate = f"{acc / drafted:.3f}" if drafted else "-"
            same = r.get("identical_to_first_nonspec")
            em = r.get("exact_match")
            pt = r.get("prefix_tokens")
            lines.append(
                f"| {variant} | {r.get('runner', 'v1')} | "
                f"{r.get('async_scheduling', False)} | "
                f"{spec.get('method', 'none')} | "
                f"{spec.get('num_speculative_tokens', 0)} | {r.get('batch')} | "
                f"{'error' if em is None else f'{em:.3f}'} | "
                f"{'-' if pt is None else f'{pt:.3f}'} | "
                f"{'-' if same is None else same} | "
                f"{'-' if drafts is None else int(drafts)} | {rate} |"
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harness.fastapply")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the fixture and write a checkpoint")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=20000)
    t.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-time budget of the training loop (seconds)",
    )
    t.add_argument("--device", default="cuda")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--workers",
        type=int,
        default=None,
        help="data worker processes (default: 10 on cuda, 0 on cpu)",
    )
    t.add_argument(
        "--size",
        default="gpu",
        choices=["gpu", "cpu"],
        help="gpu: hidden 256, 6 layers; cpu: hidden 128, 4 layers",
    )
    t.add_argument(
        "--save-dtype",
        default="float32",
        choices=["bfloat16", "float32"],
        help="dtype of the trained weights (vision tower and MTP: bfloat16)",
    )
    t.add_argument("--eval-n", type=int, default=64)
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--ramp", type=float, default=0.55)
    e = sub.add_parser("eval", help="transformers greedy exact match")
    e.add_argument("--model", required=True)
    e.add_argument("--n", type=int, default=64)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--device", default="cpu")
    e.add_argument("--batch", type=int, default=32)
    m = sub.add_parser("train-mtp", help="train the MTP head of a fixture")
    m.add_argument("--model", required=True)
    m.add_argument("--device", default="cuda")
    m.add_argument("--budget-s", type=float, default=60.0)
    m.add_argument("--batch", type=int, default=64)
    v = sub.add_parser("vllm", help="vLLM exact match, per batch size and drafter")
    v.add_argument("--model", required=True)
    v.add_argument("--n", type=int, default=64)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    v.add_argument(
        "--spec",
        nargs="+",
        default=["none", "ngram"],
        help="none | ngram (k=--k, lookup 2..10) | mtp (k=--mtp-k)",
    )
    v.add_argument("--k", type=int, default=64)
    v.add_argument("--mtp-k", type=int, default=3)
    v.add_argument("--runner", choices=["v1", "mrv2", "default"], default="v1")
    v.add_argument("--async-sched", action="store_true")
    v.add_argument("--dtype", default="bfloat16")
    v.add_argument("--out", default=None, help="write results (JSON) here")
    r = sub.add_parser("report", help="markdown table of vllm result files")
    r.add_argument("files", nargs="+", help="VARIANT=FILE.json")
    s = sub.add_parser("stats", help="task statistics and simulated n-gram mix")
    s.add_argument("--n", type=int, default=200)
    s.add_argument("--k", type=int, nargs="+", default=[64, 8])
    a = ap.parse_args(argv)

    if a.cmd == "train":
        workers = a.workers
        if workers is None:
            workers = 10 if a.device.startswith("cuda") else 0
        size = ModelSize() if a.size == "gpu" else CPU_SIZE
        train(
            a.out,
            a.steps,
            a.device,
            a.budget_s,
            a.batch,
            a.lr,
            size,
            a.seed,
            workers,
            ramp=a.ramp,
            eval_n=a.eval_n,
            log_every=a.log_every,
            save_dtype=a.save_dtype,
        )
    elif a.cmd == "eval":
        model = load_model(a.model, a.device)
        examples = make_eval_set(a.n, a.seed)
        res = evaluate(model, examples, a.batch)
        res["ngram_sim_k64"] = simulate_set(examples, 64)
        print(json.dumps(res))
    elif a.cmd == "train-mtp":
        train_mtp(a.model, a.device, a.budget_s, a.batch)
    elif a.cmd == "vllm":
        examples = make_eval_set(a.n, a.seed)
        prompts = [p for p, _ in examples]
        answers = [x for _, x in examples]
        results = []
        for spec in a.spec:
            cfg = {
                "none": None,
                "ngram": ngram_spec(a.k),
                "mtp": {"method": "mtp", "num_speculative_tokens": a.mtp_k},
            }[spec]
            for bs in a.batch:
                try:
                    r = vllm_exact_match(
                        a.model,
                        prompts,
                        answers,
                        bs,
                        cfg,
                        a.dtype,
                        runner=a.runner,
                        async_sched=a.async_sched,
                    )
                except Exception as err:  # noqa: BLE001 - recorded, next cell
                    r = {"batch": bs, "spec": cfg, "error": repr(err)[-2000:]}
                results.append(r)
                print(
                    json.dumps({k: v for k, v in r.items() if k != "outputs"}),
                    flush=True,
                )
        ref = next(
            (r for r in results if r.get("spec") is None and "outputs" in r), None
        )
        if ref is not None:
            for r in results:
                if "outputs" in r:
                    r["identical_to_first_nonspec"] = r["outputs"] == ref["outputs"]
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
        print(
            json.dumps(
                [
                    {
                        k: r.get(k)
                        for k in (
                            "batch",
                            "spec",
                            "exact_match",
                            "identical_to_first_nonspec",
                            "error",
                        )
                    }
                    for r in results
                ]
            )
        )
    elif a.cmd == "report":
        results = []
        for item in a.files:
            variant, path = item.split("=", 1)
            results.append((variant, json.loads(Path(path).read_text())))
        print(summary_table(results), end="")
    elif a.cmd == "stats":
        examples = make_eval_set(a.n, 0)
        pl = [len(p) for p, _ in examples]
        al = [len(x) for _, x in examples]
        print(
            json.dumps(
                {
                    "prompt_len": [min(pl), sum(pl) / len(pl), max(pl)],
                    "answer_len": [min(al), sum(al) / len(al), max(al)],
                }
            )
        )
        for k in a.k:
            print(json.dumps({"k": k, **simulate_set(examples, k)}))


if __name__ == "__main__":
    sys.exit(main())
