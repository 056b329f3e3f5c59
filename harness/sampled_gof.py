"""The sampled-decoding distribution test on a GPU host (``harness.sampled``
has the statistics and why; this module drives vLLM)::

    python -m harness.sampled_gof --model nemotron_h --drafter scripted:all_accept \\
        --k 3 --preset t0.8-p0.9-k5 --length 3 --out reports/sampled
"""

from __future__ import annotations

import argparse
import json

from .oracle import TOPK
from .sampled import (
    BUGS,
    POWER,
    SEED,
    Preset,
    bug_joint,
    g_tests,
    joint,
    plan,
    power,
    preset,
    sampling_kwargs,
    target_dist,
)

# logprobs per conditional (vLLM's default max_logprobs): the support needs
# top_k of them, the planned "truncation" bug the mass beyond top_k
PLAN_LOGPROBS = 20


def runs_fla(model: str) -> bool:
    """Whether ``model``'s recurrent layers run FLA's chunked kernels (Gated
    DeltaNet, KDA: ``harness.models.FIXTURES``' ``mixers``; the fast-apply
    fixture is a Qwen3.5). On CUDA they refuse float32
    ("ChunkGatedDeltaRuleFunction does not support float32"), and in
    bfloat16 their noise is large enough for the G-test to see
    (noncentrality ~ N * noise^2)."""
    from .equivalence import FASTAPPLY
    from .models import FIXTURES

    if model == FASTAPPLY:
        return True
    mixers = FIXTURES[model]["mixers"] if model in FIXTURES else ""
    return "GDN" in mixers or "KDA" in mixers


def float32_refusal(model: str, dtype: str) -> str | None:
    """Why ``model`` cannot run the test in ``dtype`` on a GPU, or None."""
    if dtype == "float32" and runs_fla(model):
        return (
            f"{model}: its linear-attention layers run FLA kernels, which refuse "
            "float32 on CUDA; use the Mamba2 hybrid (--model nemotron_h, the "
            "default), whose kernels take float32"
        )
    return None


def exact_conditionals(llm, prompt: list[int], p: Preset, length: int) -> dict:
    """``{prefix: raw top-k logprobs}`` for every prefix of up to
    ``length - 1`` tokens in the support: the logprobs of one greedy step
    after prompt + prefix (a prefill) on a non-speculative engine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # more than top_k: the "truncation" bug's untruncated distribution
    k = max(p.top_k, TOPK, PLAN_LOGPROBS)
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k)
    conds: dict[tuple, dict] = {}
    frontier = [()]
    for _ in range(length):
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt + list(f)) for f in frontier],
            sp,
            use_tqdm=False,
        )
        nxt = []
        for f, o in zip(frontier, outs, strict=True):
            lps = {
                int(t): float(v.logprob) for t, v in o.outputs[0].logprobs[0].items()
            }
            conds[f] = lps
            nxt += [f + (t,) for t in target_dist(lps, p)]
        frontier = nxt
    return conds


def main(argv: list[str] | None = None) -> None:
    """The distribution test on a GPU host (vLLM installed)::

        python -m harness.sampled_gof --model nemotron_h \\
            --drafter scripted:all_accept --k 3 --preset t0.8-p0.9-k5 --length 3 \\
            --out reports/sampled

    Writes ``<out>/gof-<model>-<drafter>-<preset>.json``: the exact joint
    distribution's size, the planned sample count per bug, the G-test per
    prefix length, the acceptance metrics, ``powered`` (the samples reach
    the planned power against every bug). The preset must use top-k (the
    exact distribution is computed from top-k logprobs). Planned counts
    assume the draft at each position is the target's argmax (what
    ``scripted:all_accept`` proposes on the greedy path)."""
    ap = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="nemotron_h")
    # the greedy path as one-hot drafts: what the power plan assumes, and the
    # rule n-gram and MTP drafts follow too (NemotronH's MTP head is built in
    # its config's dtype, bfloat16, not the engine's float32)
    ap.add_argument("--drafter", default="scripted:all_accept")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--runner", default="v1")
    ap.add_argument("--preset", default="t0.8-p0.9-k5")
    ap.add_argument("--length", type=int, default=3)
    ap.add_argument(
        "--samples",
        type=int,
        default=None,
        help="default: plan() for the bugs, at most --cap",
    )
    ap.add_argument("--cap", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="reports/sampled")
    a = ap.parse_args(argv)
    if why := float32_refusal(a.model, a.dtype):
        ap.error(why)
    import tempfile
    from pathlib import Path

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from . import equivalence as eq
    from .models import write_model

    p = preset(a.preset)
    if not p.top_k:
        ap.error(f"preset {a.preset} has no top-k: its distribution is not exact")
    with tempfile.TemporaryDirectory(prefix="hsfork-gof-") as tmp:
        model_dir = (
            str(eq.FASTAPPLY_DIR)
            if a.model == eq.FASTAPPLY
            else str(write_model(a.model, Path(tmp) / "m", seed=a.seed))
        )
        prompt = eq.cell_prompts(a.model, 1, a.seed)[0]
        # float32: kernel noise far below what the test could see
        ref = eq.Cell(a.model, "none", 0, 64, dtype=a.dtype)
        llm = eq._engine(ref, model_dir)
        try:
            conds = exact_conditionals(llm, prompt, p, a.length)
            greedy = (
                llm.generate(
                    [TokensPrompt(prompt_token_ids=prompt)],
                    SamplingParams(temperature=0.0, max_tokens=a.length + 8),
                    use_tqdm=False,
                )[0]
                .outputs[0]
                .token_ids
            )
        finally:
            eq._shutdown(llm)
        exact = joint({f: target_dist(v, p) for f, v in conds.items()}, a.length)
        planned = {
            b: plan(exact, bug_joint(conds, p, a.length, b), cap=a.cap) for b in BUGS
        }
        n = a.samples or min(a.cap, max(planned.values()))
        cell = eq.Cell(
            a.model,
            a.drafter,
            a.k,
            min(n, 256),
            a.runner,
            dtype=a.dtype,
            max_tokens=a.length,
            sampling=a.preset,
        )
        if a.drafter.startswith("scripted:"):
            eq._scripted_env(cell, Path(tmp), a.seed, [prompt], [list(greedy)])
        eq.write_drafter(cell, model_dir, a.seed)
        llm = eq._engine(cell, model_dir)
        try:
            kw = sampling_kwargs(a.preset)
            params = [
                SamplingParams(
                    **{**kw, "seed": SEED + i}, max_tokens=a.length, ignore_eos=True
                )
                for i in range(n)
            ]
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=prompt)] * n, params, use_tqdm=False
            )
            metrics = {
                m.name: m.value
                for m in llm.get_metrics()
                if "spec_decode" in m.name and hasattr(m, "value")
            }
        finally:
            eq._shutdown(llm)
    samples = [tuple(o.outputs[0].token_ids) for o in outs]
    result = {
        "model": a.model,
        "drafter": a.drafter,
        "k": a.k,
        "runner": a.runner,
        "preset": a.preset,
        "lossless": p.lossless,
        "length": a.length,
        "outcomes": len(exact),
        "planned": planned,
        "samples": n,
        "power": {b: power(n, exact, bug_joint(conds, p, a.length, b)) for b in BUGS},
        "tests": g_tests(samples, exact),
        "accept": metrics,
    }
    result["ok"] = all(t["ok"] for t in result["tests"].values()) or not p.lossless
    # a pass says little below the planned power (--samples, or a plan cut
    # at --cap)
    result["powered"] = min(result["power"].values()) >= POWER
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"gof-{a.model}-{a.drafter.replace(':', '-')}-{a.preset.replace(':', '-')}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("model", "drafter", "preset", "samples", "ok", "powered")
            }
        )
    )


if __name__ == "__main__":
    main()
