"""Where the time of a decode step goes, for one vLLM install.

    python -m benchmarks.step_profile --variant fork --out out/prof-fork \\
        -- --mode ngram_nomatch --batch-sizes 1,64

Arguments after ``--`` are ``benchmarks.decode_latency``'s (its ``--out`` is
not used). One in-process engine, as in ``decode_latency``; per batch size a
warm-up run, then one run of ``--tokens`` decode tokens during which

- the model runner's and the scheduler's step methods are timed on the host
  (``time.perf_counter`` around each call: the host time of the call, which
  includes waits on the device only where the method synchronizes), and the
  return values of the fork's ``_recurrent_states_in_first_slot`` are counted
  (which path the recurrent-state backends took);

then one shorter run under ``torch.profiler`` (CPU and CUDA activity) whose
operator and kernel tables go to ``<out>/profile-bs<N>.txt``.

Writes ``<out>/step_profile.json``. Compare two variants with
``python -m benchmarks.step_profile --compare A.json B.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

from benchmarks import decode_latency as dl

RUNNER_METHODS = (
    "execute_model",
    "_update_states",
    "_prepare_inputs",
    "_build_attention_metadata",
    "_preprocess",
    "_model_forward",
    "sample_tokens",
    "_sample",
    "_update_states_after_model_execute",
    "_bookkeeping_sync",
    "propose_draft_token_ids",
    "take_draft_token_ids",
    "_recurrent_states_in_first_slot",
    "_park_accepted_counts",
)
SCHEDULER_METHODS = ("schedule", "update_from_output", "update_draft_token_ids")


class MethodTimer:
    """perf_counter totals per wrapped method; counts of returned values for
    the methods named in ``count_results``."""

    def __init__(self) -> None:
        self.on = False
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.results: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()
        self.results.clear()

    def wrap(self, obj, name: str, prefix: str, count_results: bool = False) -> bool:
        fn = getattr(obj, name, None)
        if fn is None or not callable(fn):
            return False
        key = f"{prefix}.{name}"

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.total[key] += time.perf_counter() - t0
                self.calls[key] += 1
            if count_results:
                self.results[key][repr(out)] += 1
            return out

        setattr(obj, name, timed)
        return True

    def summary(self, steps: int) -> dict:
        return {
            k: {
                "calls": self.calls[k],
                "total_ms": self.total[k] * 1e3,
                "us_per_step": self.total[k] * 1e6 / steps if steps else None,
                "results": dict(self.results.get(k, {})),
            }
            for k in sorted(self.total)
        }


def model_runner(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core, core.model_executor.driver_worker.worker.model_runner


def profile_tables(llm, prompts, sp, path: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dl.generate(llm, prompts, sp)
    ka = prof.key_averages()
    with open(path, "w") as fh:
        fh.write(f"# torch {torch.__version__}\n\n## by self CPU time\n")
        fh.write(ka.table(sort_by="self_cpu_time_total", row_limit=60))
        fh.write("\n\n## by device time\n")
        fh.write(ka.table(sort_by="self_device_time_total", row_limit=40))
        fh.write("\n")


def run(variant: str, out: Path, argv: list[str]) -> int:
    a = dl.parse_args([*argv, "--out", str(out / "unused.json")])
    out.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if a.runner == "mrv2" else "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    doc: dict = {
        "schema": "hsfork-step-profile/1",
        "variant": variant,
        "mode": a.label,
        "argv": argv,
        "results": [],
    }
    doc.update(dl.install_info())
    path = out / "step_profile.json"
    llm = None
    code = 0
    try:
        from vllm import LLM

        model_dir = str(dl.write_model_dir(a.model_dir))
        llm = LLM(**dl.engine_kwargs(a, model_dir))
        doc.update(dl.device_info())
        meter = dl.StepMeter(llm)
        core, runner = model_runner(llm)
        timer = MethodTimer()
        counted = "_recurrent_states_in_first_slot"
        doc["wrapped"] = [
            f"runner.{m}"
            for m in RUNNER_METHODS
            if timer.wrap(runner, m, "runner", count_results=m == counted)
        ] + [
            f"scheduler.{m}"
            for m in SCHEDULER_METHODS
            if timer.wrap(core.scheduler, m, "scheduler")
        ]
        kind = dl.sampling_kind(a)
        lo, hi = a.prompt_len
        for bs in a.batch_sizes:
            warm = dl.make_prompts(bs, lo, hi, dl.prompt_seed(a.seed, bs, 0))
            dl.generate(llm, warm, dl.make_sampling(kind, a.warmup_tokens))
            prompts = dl.make_prompts(bs, lo, hi, dl.prompt_seed(a.seed, bs, 1))
            timer.reset()
            timer.on = True
            _, recs, wall = dl.timed_generate(
                llm, meter, prompts, dl.make_sampling(kind, a.tokens)
            )
            timer.on = False
            row = {"bs": bs, **dl.summarize(recs, bs), "wall_s": wall}
            row["methods"] = timer.summary(len(recs))
            prof_path = out / f"profile-bs{bs}.txt"
            profile_tables(
                llm,
                dl.make_prompts(bs, lo, hi, dl.prompt_seed(a.seed, bs, 2)),
                dl.make_sampling(kind, 32),
                prof_path,
            )
            row["profile"] = prof_path.name
            doc["results"].append(row)
            dl.write_json(path, doc)
            print(f"[profile] {variant} BS {bs}: median {row['median_ms']:.3f} ms",
                  flush=True)  # fmt: skip
        doc["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - recorded
        doc["status"] = "error"
        doc["error"] = repr(e)[-2000:]
        doc["traceback"] = traceback.format_exc()[-6000:]
        print(doc["traceback"], file=sys.stderr, flush=True)
        code = 1
    finally:
        dl.write_json(path, doc)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
    return code


def compare(paths: list[str]) -> str:
    """A table of host µs per step per method, variant by variant."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    lines = []
    for bs in sorted({r["bs"] for d in docs for r in d.get("results", [])}):
        rows = {d["variant"]: next((r for r in d["results"] if r["bs"] == bs), None)
                for d in docs}  # fmt: skip
        names = sorted({m for r in rows.values() if r for m in r["methods"]})
        lines.append(f"## BS {bs}")
        lines.append("| | " + " | ".join(rows) + " |")
        lines.append("|---" * (len(rows) + 1) + "|")
        lines.append(
            "| median ms/step | "
            + " | ".join(f"{r['median_ms']:.3f}" if r else "-" for r in rows.values())
            + " |"
        )
        for m in names:
            cells = []
            for r in rows.values():
                x = r["methods"].get(m) if r else None
                cells.append("-" if not x else f"{x['us_per_step']:.1f}")
            lines.append(f"| {m} µs/step | " + " | ".join(cells) + " |")
        for r in rows.values():
            for m, x in (r or {}).get("methods", {}).items():
                if x.get("results"):
                    lines.append(f"\n{m} returned: {x['results']}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.side_by_side import split_passthrough

    argv, extra = split_passthrough(argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_profile")
    ap.add_argument("--variant", default="unknown")
    ap.add_argument("--out", default="out/step-profile")
    ap.add_argument("--compare", nargs="+", metavar="JSON")
    a = ap.parse_args(argv)
    if a.compare:
        print(compare(a.compare))
        return 0
    return run(a.variant, Path(a.out), extra)


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
