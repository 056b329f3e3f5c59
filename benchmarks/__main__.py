"""``python -m benchmarks --help``: the jobs of this package (the dispatch is
``serving.cli``'s)."""

from __future__ import annotations

import sys

from serving.cli import Job, dispatch

JOBS = [
    Job(
        "serve-bench",
        "benchmarks.serve_bench",
        "{run,summary,bandwidth,client} [...]",
        "`vllm bench serve` against the fork's and upstream's `vllm serve`, "
        "one server at a time, over a concurrency list; `summary` turns the "
        "result JSONs into tables and a plot, `bandwidth` measures the device "
        "copy bandwidth for the weight-read floor.",
    ),
    Job(
        "decode-latency",
        "benchmarks.decode_latency",
        "--mode none --variant fork --out OUT.json [...]",
        "Per-step decode latency of one vLLM install, one in-process engine, "
        "one mode (none, n-gram never matching, scripted drafter, MTP).",
    ),
    Job(
        "side-by-side",
        "benchmarks.side_by_side",
        "--modes none,ngram_nomatch [--deadline S] [-- DECODE_LATENCY_ARGS]",
        "decode-latency for the fork and upstream v0.26.0 in one GPU call, "
        "process pairs interleaved, then the ratio report.",
    ),
    Job(
        "plot",
        "benchmarks.plot",
        "IN [IN ...] --out DIR --run NAME",
        "Fork/upstream ratio table and plot from decode-latency JSONs.",
    ),
    Job(
        "configs-report",
        "benchmarks.configs_report",
        "IN --baseline LABEL --out DIR --run NAME",
        "Several configurations of one install side by side (e.g. the "
        "TurboQuant set): step time and tokens/s per batch size.",
    ),
    Job(
        "step-profile",
        "benchmarks.step_profile",
        "--variant fork --out DIR [-- DECODE_LATENCY_ARGS]",
        "Where the time of a decode step goes: host time per runner method "
        "and a torch.profiler table.",
    ),
]

INTRO = """Fork-versus-upstream benchmarks: decode latency per step and `vllm bench
serve` throughput/TPOT, each fork and upstream side by side on one GPU.
Start with benchmarks/README.md."""

OUTRO = """GPU calls (shell, from the repository root; the environment each reads
is described at the top of each script):
  bash benchmarks/gpu_serve_bench.sh fastapply | qwen9b    serve-bench on a GPU
  bash benchmarks/gpu_runs.sh profile | tq | mtp-mrv2      decode-latency runs
Their CPU dry runs against fake servers and engines: tests/test_serve_bench.py,
tests/test_benchmarks.py."""


def main(argv: list[str] | None = None) -> int:
    return dispatch("python -m benchmarks", INTRO, JOBS, OUTRO, argv)


if __name__ == "__main__":
    sys.exit(main())
