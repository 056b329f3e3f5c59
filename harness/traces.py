"""Per-request, per-step draft and acceptance traces of a real drafter, to
replay on another model (issue: speed at production shape).

``record(llm)`` (an in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
wraps its scheduler's ``update_from_output``: at every step, for every
request that sampled tokens, it appends ``[drafts verified, drafts
accepted]`` to that request's trace (``[0, 0]`` for a decode without
drafts). ``write``/``load`` keep the traces as JSON lines, one request per
line, in the order the requests were first seen. ``benchmarks.scripted``
replays them through the scripted drafter (``make_plan(..., traces=...)``):
the target of the replay meets the recorded acceptance patterns, whatever
its own weights would accept.

Why by hand: vLLM's ``/metrics`` and ``SpecDecodingStats`` count drafts and
accepts per step for the whole batch, not per request.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path


class Recorder:
    def __init__(self) -> None:
        self.traces: dict[str, list[list[int]]] = {}

    def observe(self, scheduler_output, model_runner_output) -> None:
        """One step: drafts scheduled per request (the scheduler's output)
        against the tokens it sampled (the runner's output)."""
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        index = model_runner_output.req_id_to_index or {}
        sampled = model_runner_output.sampled_token_ids
        for req_id, i in index.items():
            if i >= len(sampled):
                continue
            n = len(sampled[i])
            if n == 0:  # a partial prefill: nothing sampled
                continue
            drafts = [t for t in spec.get(req_id, []) if t >= 0]
            accepted = min(n - 1, len(drafts))
            self.traces.setdefault(req_id, []).append([len(drafts), accepted])


def _scheduler(llm):
    core = llm.llm_engine.engine_core
    inner = getattr(core, "engine_core", None)
    if inner is None:
        raise RuntimeError(
            "traces need the in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        )
    return inner.scheduler


@contextlib.contextmanager
def record(llm) -> Iterator[Recorder]:
    """Record the traces of everything ``llm`` runs inside the block."""
    sched = _scheduler(llm)
    rec = Recorder()
    original = sched.update_from_output
    shadowed = "update_from_output" in vars(sched)

    def update_from_output(scheduler_output, model_runner_output):
        rec.observe(scheduler_output, model_runner_output)
        return original(scheduler_output, model_runner_output)

    sched.update_from_output = update_from_output
    try:
        yield rec
    finally:
        if shadowed:
            sched.update_from_output = original
        else:
            del sched.update_from_output  # the class's method again


def write(traces: dict[str, list[list[int]]], path: Path, meta: dict) -> None:
    with open(path, "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for req_id, steps in traces.items():
            f.write(json.dumps({"request": req_id, "steps": steps}) + "\n")


def load(path: Path) -> tuple[dict, list[list[list[int]]]]:
    """(meta, the steps of each request)."""
    meta: dict = {}
    out = []
    for line in Path(path).read_text().splitlines():
        obj = json.loads(line)
        if "meta" in obj:
            meta = obj["meta"]
        elif obj.get("steps"):
            out.append(obj["steps"])
    return meta, out


def summary(traces: list[list[list[int]]]) -> dict:
    """Acceptance of a set of traces: drafts, accepts, the rate, and the
    share of steps without drafts."""
    steps = [s for t in traces for s in t]
    drafted = sum(d for d, _ in steps)
    accepted = sum(a for _, a in steps)
    return {
        "requests": len(traces),
        "steps": len(steps),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "steps_without_drafts": round(sum(d == 0 for d, _ in steps) / len(steps), 4)
        if steps
        else None,
    }


def record_run(
    drafter: str,
    k: int,
    batch: int,
    n: int,
    prompts: str,
    seed: int,
    max_tokens: int,
    temperature: float = 0.0,
) -> tuple[dict[str, list[list[int]]], dict]:
    """Run the fast-apply fixture with a drafter (V1, in-process) on its
    held-out prompts (``fastapply``: much to copy) or on random token
    prompts (``random``) and record the traces. The fixture's greedy
    answers repeat themselves, so n-gram finds much to copy even on random
    prompts; ``temperature`` > 0 samples the answers (seeded per request),
    which leaves the drafts little to match: a low-acceptance trace."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from . import compat
    from .equivalence import (
        FASTAPPLY,
        FASTAPPLY_DIR,
        Cell,
        _engine,
        _shutdown,
        cell_prompts,
        make_prompts,
    )

    cell = Cell(FASTAPPLY, drafter, k, batch, "v1", max_tokens=max_tokens)
    if prompts == "fastapply":
        ps = cell_prompts(FASTAPPLY, n, seed)
    else:
        ps = make_prompts(n, seed, lo=100, hi=300)
    llm = _engine(cell, str(FASTAPPLY_DIR))
    try:
        with record(llm) as rec:
            for i in range(0, len(ps), batch):
                llm.generate(
                    [TokensPrompt(prompt_token_ids=p) for p in ps[i : i + batch]],
                    [
                        SamplingParams(
                            temperature=temperature,
                            seed=seed + j if temperature > 0 else None,
                            max_tokens=max_tokens,
                        )
                        for j in range(i, min(i + batch, len(ps)))
                    ],
                    use_tqdm=False,
                )
    finally:
        _shutdown(llm)
    meta = {
        "model": FASTAPPLY,
        "drafter": drafter,
        "k": k,
        "batch": batch,
        "prompts": prompts,
        "n": n,
        "seed": seed,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "vllm": compat.version_str(),
    }
    return rec.traces, meta


def step_classes(traces: list[list[list[int]]], k: int, batch: int) -> dict:
    """How the engine steps of the trace's rows, replayed ``batch`` at a
    time in closed batches (``benchmarks.decode_latency --trace``: the rows
    of a round start together and a row leaves when its trace ends), fall
    into the CUDA-graph classes of vLLM's V1 runner with
    ``num_speculative_tokens=k``: ``plain`` (no row carries a draft, and
    no row accepted a draft the step before, so every recurrent state is in
    its first slot: the decode graph of query length 1, which v0.26.0
    captures for such steps from stable patch 37 on, piecewise before),
    ``verify`` (every row carries k drafts: a uniform decode of query
    length 1 + k, the verify graph), ``piecewise`` (any other step: mixed
    draft counts, or no drafts right after an accepted one).
    A trailing round of fewer than ``batch`` rows is left out, as the
    replay leaves it. Shares of all steps, and the step count."""
    counts = {"plain": 0, "verify": 0, "piecewise": 0}
    for start in range(0, len(traces) - batch + 1, batch):
        rows = traces[start : start + batch]
        for step in range(max(len(r) for r in rows)):
            drafts = [r[step][0] for r in rows if step < len(r)]
            accepted_before = any(r[step - 1][1] for r in rows if 0 < step < len(r))
            if not any(drafts) and not accepted_before:
                counts["plain"] += 1
            elif all(d == k for d in drafts):
                counts["verify"] += 1
            else:
                counts["piecewise"] += 1
    total = sum(counts.values())
    shares = {c: round(n / total, 4) if total else None for c, n in counts.items()}
    return {"batch": batch, "steps": total, **shares}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("record", help="run a drafter on the GPU and record")
    p.add_argument("--drafter", default="ngram", help="ngram | mtp | ngram:acceptance")
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--prompts", choices=["fastapply", "random"], default="fastapply")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: sampled answers (seeded), little for n-gram to copy",
    )
    p.add_argument("--out", required=True)
    p = sub.add_parser("summary", help="acceptance of a trace file")
    p.add_argument("path")
    p.add_argument(
        "--batch-sizes",
        default="",
        help="e.g. 1,8,32,64: also the CUDA-graph class of each step of a "
        "closed-batch replay at these batch sizes (step_classes)",
    )
    a = ap.parse_args(argv)
    if a.cmd == "record":
        traces, meta = record_run(
            a.drafter,
            a.k,
            a.batch,
            a.n,
            a.prompts,
            a.seed,
            a.max_tokens,
            a.temperature,
        )
        write(traces, Path(a.out), meta)
        print(json.dumps({**meta, **summary(list(traces.values()))}))
    else:
        meta, traces = load(Path(a.path))
        print(json.dumps({**meta, **summary(traces)}))
        for bs in filter(None, a.batch_sizes.split(",")):
            print(json.dumps(step_classes(traces, meta["k"], int(bs))))


if __name__ == "__main__":
    main()
