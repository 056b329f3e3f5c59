"""An independent reference: transformers' own forward, in float32, on the
same generated weights, teacher-forced on the sequences vLLM produced.

vLLM's non-speculative run is the harness's reference; this checks the
reference itself. ``load`` reads a fixture folder (``harness.models``
writes it; the architecture named in its ``config.json``) with the
transformers class of that name and refuses a checkpoint that leaves any
weight of the model uninitialised. ``forced_logprobs`` runs one
teacher-forced forward per sequence and returns, at every continuation
position, the ``{token: logprob}`` dict vLLM returns (top-k plus the
sequence's token), so ``harness.oracle`` compares the two.

Independence: transformers picks, per mixer, an optional kernel package
where installed (GDN: ``fla``; Mamba2: ``mamba_ssm``, ``causal_conv1d``)
and its own PyTorch implementation otherwise; the GPU host has none of
them, so the reference shares no kernel with vLLM (the JSON records
``kernel_packages``). float32 matmuls run without TF32 (``full_fp32``).

Tolerance (``tolerance``): measured, not chosen. The same transformers
forward in the dtype vLLM ran (bf16) against float32 gives the rounding
drift of that dtype on these very weights and sequences; vLLM's kernels
round differently but at the same precision, so vLLM's drift from the
float32 forward must stay within ``oracle.factor`` (the extreme-value
factor of ``harness.oracle``) times that measured drift (never below one
unit of the dtype's precision, ``oracle.EPS``).

On a GPU host (vLLM installed; one model kind after another)::

    python -m harness.reference --kinds qwen3_5,nemotron_h,qwen3_next,\\
        granitemoehybrid,kimi_linear,fastapply --dtype bfloat16 \\
        --out reports/reference

writes ``reference-<dtype>.json``: per kind, the vLLM drift from the fp32
forward (generated and teacher-forced logprobs), the transformers bf16
drift, the tolerance, and ``ok``; a kind transformers cannot load or run is
recorded with its error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

from . import oracle

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def load(model_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
    """The fixture in ``model_dir`` as its transformers class, in ``dtype``,
    in eval mode. Raises if a weight of the model is missing from the
    checkpoint (transformers would initialise it at random). A family
    transformers has no class for gets the forward of our own that wrote
    its weights (``OWN_FORWARD``), loaded the same strict way."""
    import torch
    import transformers

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg["architectures"][0] in OWN_FORWARD:
        return _load_own(cfg, model_dir, dtype, device)
    cls = getattr(transformers, cfg["architectures"][0])
    model, info = cls.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), output_loading_info=True
    )
    if info.get("missing_keys"):
        raise ValueError(f"weights missing from {model_dir}: {info['missing_keys']}")
    return model.to(device).eval()


# architectures transformers has no class for, with a float32 PyTorch
# forward of our own (plain torch ops, written from the published modeling
# code and vLLM's layers): Bailing-MoE-linear (harness.models_bailing).
# Independent of vLLM's kernels as transformers' forward is; not of a
# misreading of the architecture shared by both.
OWN_FORWARD = ("BailingMoeV2_5ForCausalLM",)


def _load_own(cfg: dict, model_dir: str | Path, dtype: str, device: str):
    import torch
    from safetensors.torch import load_file

    from .models_bailing import BailingMoeLinearForCausalLM

    model = BailingMoeLinearForCausalLM(cfg)
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: weights missing {missing}, not in the model {unexpected}"
        )
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()


@contextlib.contextmanager
def full_fp32():
    """float32 matmuls at full precision: no TF32 (vLLM, in this process,
    may have allowed it), restored afterwards."""
    import torch

    old = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old[0]
        torch.backends.cudnn.allow_tf32 = old[1]
        torch.set_float32_matmul_precision(old[2])


def kernel_packages() -> dict[str, bool]:
    """Which optional kernel packages transformers would use instead of its
    own PyTorch paths (GDN: fla; Mamba2: mamba_ssm, causal_conv1d). Without
    them the reference shares no kernel with vLLM."""
    import importlib.util

    return {
        p: importlib.util.find_spec(p) is not None
        for p in ("fla", "mamba_ssm", "causal_conv1d")
    }


def forced_logprobs(
    model, seqs: Sequence[tuple[Sequence[int], Sequence[int]]], k: int = oracle.TOPK
) -> list[list[dict[int, float]]]:
    """Per ``(prompt, continuation)``: the ``{token: logprob}`` (top-k and
    the continuation's token) at every continuation position, from one
    forward over prompt + continuation; log-softmax in float32 of the
    model's logits (as vLLM computes logprobs)."""
    import torch

    device = next(model.parameters()).device
    out = []
    for prompt, cont in seqs:
        ids = torch.tensor([list(prompt) + list(cont)], device=device)
        with torch.no_grad(), full_fp32():
            logits = model(input_ids=ids).logits[0].float()
        lps = torch.log_softmax(logits, dim=-1)
        rows = []
        for i, tok in enumerate(cont):
            row = lps[len(prompt) + i - 1]
            top = torch.topk(row, k)
            d = {int(t): float(v) for t, v in zip(top.indices, top.values, strict=True)}
            d[int(tok)] = float(row[tok])
            rows.append(d)
        out.append(rows)
    return out


def drift(a: Sequence[Sequence[dict]], b: Sequence[Sequence[dict]], seqs) -> dict:
    """Worst token and top-k drift of ``a`` against ``b`` over all positions
    (``harness.oracle.position_drift``) and where the worst token drift is."""
    worst = {"token": 0.0, "topk": 0.0, "positions": 0, "where": None}
    for s, (x, y, (_, cont)) in enumerate(zip(a, b, seqs, strict=True)):
        for i, d in enumerate(oracle.sequence_drift(x, y, cont)):
            worst["positions"] += 1
            if d.token > worst["token"]:
                worst["where"] = {"sequence": s, "position": i}
            worst["token"] = max(worst["token"], d.token)
            worst["topk"] = max(worst["topk"], d.topk)
    return worst


def tolerance(rounding: dict, positions: int, dtype: str) -> dict:
    """Thresholds for a drift from the float32 forward measured over
    ``positions`` positions, from ``rounding`` (the same forward in
    ``dtype`` against float32, ``drift``): ``oracle.factor`` times the
    measured rounding drift, at least ``oracle.EPS[dtype]``."""
    c = oracle.factor(rounding["positions"], positions)
    return {
        "factor": round(c, 3),
        "token": oracle.threshold(rounding["token"], dtype, c),
        "topk": oracle.threshold(rounding["topk"], dtype, c),
    }


def judge(vllm: dict, rounding: dict, dtype: str) -> dict:
    tol = tolerance(rounding, vllm["positions"], dtype)
    ok = vllm["token"] <= tol["token"] and vllm["topk"] <= tol["topk"]
    return {"vllm": vllm, "rounding": rounding, "tolerance": tol, "ok": ok}


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return x


def compare_kind(
    kind: str, workdir: Path, n_prompts: int, dtype: str, seed: int, max_tokens: int
) -> dict:
    """vLLM's non-speculative logprobs of ``kind`` (generated, and
    teacher-forced by a prefill) against transformers' float32 forward on
    the same sequences; transformers in ``dtype`` measures the tolerance."""
    from . import equivalence as eq

    # the committed fast-apply fixture, or one written here (the matrix's
    # own choice of checkpoint: Qwen3.5 with GDN heads of 128 included)
    model_dir = str(eq.model_folder(kind, workdir, seed))
    prompts = eq.cell_prompts(kind, n_prompts, seed)
    cell = eq.Cell(kind, "none", 0, n_prompts, dtype=dtype, max_tokens=max_tokens)
    outs, _ = eq.generate(cell, model_dir, [prompts], oracle.TOPK)
    conts = [list(o.outputs[0].token_ids) for o in outs]
    seqs = list(zip(prompts, conts, strict=True))
    generated = oracle.output_lps(outs)
    forced = [
        [q.logprobs for q in pos]
        for pos in eq.teacher_forced(kind, dtype, model_dir, seqs)
    ]
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    fp32 = forced_logprobs(load(model_dir, "float32", device), seqs)
    low = forced_logprobs(load(model_dir, dtype, device), seqs)
    rounding = drift(low, fp32, seqs)
    return {
        "kind": kind,
        "dtype": dtype,
        "sequences": len(seqs),
        "kernel_packages": kernel_packages(),
        "generated": judge(drift(generated, fp32, seqs), rounding, dtype),
        "teacher_forced": judge(drift(forced, fp32, seqs), rounding, dtype),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--kinds",
        default="qwen3_5,nemotron_h,qwen3_next,granitemoehybrid,kimi_linear,fastapply",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="reports/reference")
    a = ap.parse_args(argv)
    import tempfile
    import traceback

    from .models import FIXTURES, vllm_loads

    results = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"reference-{a.dtype}.json"
    with tempfile.TemporaryDirectory(prefix="hsfork-ref-") as tmp:
        for kind in a.kinds.split(","):
            if kind in FIXTURES and not vllm_loads(kind):
                # no vLLM logprobs to check (harness.models says why)
                r = {"kind": kind, "ok": None, "skipped": "vLLM cannot load it"}
                results.append(r)
                path.write_text(json.dumps(results, indent=1) + "\n")
                print(json.dumps(r), flush=True)
                continue
            try:
                r = compare_kind(
                    kind, Path(tmp), a.prompts, a.dtype, a.seed, a.max_tokens
                )
                r["ok"] = r["generated"]["ok"] and r["teacher_forced"]["ok"]
            except Exception as e:  # noqa: BLE001 - recorded per kind
                r = {
                    "kind": kind,
                    "ok": False,
                    "error": repr(e)[-2000:],
                    "traceback": traceback.format_exc()[-4000:],
                }
            results.append(_finite(r))
            # after each kind: a process killed at its call's limit keeps
            # the kinds it finished
            path.write_text(json.dumps(results, indent=1) + "\n")
            print(
                json.dumps({k: r.get(k) for k in ("kind", "ok", "error")}), flush=True
            )
    print(json.dumps({"json": str(path)}))


if __name__ == "__main__":
    main()
