"""One entry point per package: ``python -m serving JOB ...`` and
``python -m benchmarks JOB ...`` name a job and pass the rest of the command
line to that job's own command line (its module's ``main``), so that a
newcomer finds every job in one ``--help``. ``dispatch`` is shared by both
packages (``benchmarks`` already builds on ``serving``); argparse
subcommands would parse each job's options twice, so the dispatch is these
few lines instead."""

from __future__ import annotations

import importlib
import sys
import textwrap
from typing import NamedTuple


class Job(NamedTuple):
    name: str
    module: str  # its main(argv) takes the rest of the command line
    usage: str  # what to run, after "python -m PACKAGE NAME"
    what: str  # one or two sentences for a newcomer


def help_text(prog: str, intro: str, jobs: list[Job], outro: str) -> str:
    lines = [
        f"usage: {prog} JOB [ARGS...]",
        f"       {prog} JOB --help    (that job's own options)",
        "",
        intro.strip(),
        "",
        "jobs:",
    ]
    for j in jobs:
        lines.append(f"  {j.name} {j.usage}".rstrip())
        lines += textwrap.wrap(
            f"{j.what} [{j.module}]",
            width=78,
            initial_indent="      ",
            subsequent_indent="      ",
        )
    return "\n".join(lines + ["", outro.strip(), ""])


def dispatch(
    prog: str, intro: str, jobs: list[Job], outro: str, argv: list[str] | None
) -> int:
    """Run the job ``argv[0]`` names with ``argv[1:]``; the help (status 0
    when asked for, 2 for an unknown job or none)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    by_name = {j.name: j for j in jobs}
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(help_text(prog, intro, jobs, outro))
        return 0 if argv else 2
    job = by_name.get(argv[0])
    if job is None:
        print(help_text(prog, intro, jobs, outro), file=sys.stderr)
        print(f"{prog}: unknown job {argv[0]!r}", file=sys.stderr)
        return 2
    rc = importlib.import_module(job.module).main(argv[1:])
    return int(rc or 0)


JOBS = [
    Job(
        "check",
        "serving.serve_check",
        "--model DIR --server ref=none --server ngram=ngram [...]",
        "Launch a non-speculative reference and speculative `vllm serve`s side "
        "by side, send them the same greedy requests, and judge every "
        "response against the reference (PASS / PASS-TIES / FAIL).",
    ),
    Job(
        "soak",
        "serving.soak",
        "--model DIR --server ref=none --server cand=ngram [--fault kill-engine]",
        "Load a speculative `vllm serve` with many clients and mixed requests "
        "(stop strings, n=2, structured output, disconnects) for minutes or "
        "N requests, optionally kill its engine core and restart it; then "
        "check no request was lost, greedy answers match the reference, "
        "memory stayed flat and the counters agree.",
    ),
    Job(
        "bad-requests",
        "serving.bad_requests",
        "--url URL --model NAME --max-model-len N [--out OUT]",
        "Send malformed requests (negative max_tokens, prompts over the "
        "context, bad sampling values, invalid regexes, ...) to a running "
        "server: each must get a 4xx, the server must live on; a table.",
    ),
    Job(
        "make-model",
        "serving.make_model",
        "{qwen9b,fastapply} OUT [...]",
        "Write a model directory to serve: the Qwen3.5-9B shape with random "
        "weights, or the trained fast-apply fixture with a chat template.",
    ),
    Job(
        "tokenizer",
        "serving.tokenizer",
        "OUT",
        "Train the byte-level BPE tokenizer of the 9B-shaped model "
        "(deterministic, seconds).",
    ),
    Job(
        "refusals",
        "serving.refusals",
        "[--line v0.26.0|v0.33.0|both] [--no-cli] [--only ID]",
        "Try every speculative configuration refused for hybrid models at "
        "config time, as LLM(...) and as `vllm serve`, on the fork and on "
        "upstream (CPU); write the table to reports/serving/LINE/.",
    ),
    Job(
        "fake-server",
        "serving.fake_server",
        "MODEL --port P [--fake-mode fastapply]",
        "A fake `vllm serve` (same command line, no model) for CPU tests and dry runs.",
    ),
]

INTRO = """Serving end to end: `vllm serve` with and without speculation, compared
over the OpenAI-compatible API. Start with serving/README.md."""
OUTRO = """GPU calls (shell, from the repository root; the environment each reads
is described at the top of each script):
  bash serving/gpu_serve.sh fastapply [--lm-eval] | qwen9b   `check` on a GPU
  bash serving/gpu_quickstart.sh WHEEL_DIR DEPS_DIR          the README's install
  bash serving/install_lm_eval.sh download | TARGET          lm-eval offline
Their CPU dry runs against fake servers: tests/test_serving.py."""


def main(argv: list[str] | None = None) -> int:
    return dispatch("python -m serving", INTRO, JOBS, OUTRO, argv)
