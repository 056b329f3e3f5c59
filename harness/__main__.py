"""``python -m harness JOB [ARGS...]``: one entry point for the harness's jobs.

Each job hands its arguments to an existing module's command line
(``python -m harness JOB --help`` shows that module's options), so both
spellings work: ``python -m harness equivalence --slice v1-smoke`` is
``python -m harness.equivalence --slice v1-smoke``. Nothing here imports vLLM;
the job's module is imported only when the job runs.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    module: str  # harness.<module>
    prefix: tuple[str, ...]  # arguments put before the user's
    help: str


JOBS: dict[str, Job] = {
    "equivalence": Job(
        "equivalence",
        (),
        "run one slice of the equivalence matrix (speculative vs "
        "non-speculative greedy, cell by cell; needs vLLM and a GPU)",
    ),
    "full-matrix": Job(
        "full_matrix",
        (),
        "the whole matrix: 'slices N' prints the slices of GPU call N, "
        "'summarize DIR' writes FULL.md and heatmaps",
    ),
    "summarize": Job(
        "full_matrix",
        ("summarize",),
        "write FULL.md and heatmaps from the reports in DIR "
        "(= full-matrix summarize DIR)",
    ),
    "support-table": Job(
        "support_table",
        (),
        "the README's support table (model family x drafter) from a line's "
        "newest whole-matrix report; --readme FILE rewrites its marked region, "
        "--check only compares",
    ),
    "report": Job(
        "report",
        (),
        "markdown table of slice reports (JSON), fork and upstream side by side",
    ),
    "fastapply": Job(
        "fastapply",
        (),
        "the fast-apply fixture: train, eval, train-mtp, vllm, report, stats",
    ),
    "fastapply-train": Job(
        "fastapply",
        ("train",),
        "train the fast-apply fixture (= fastapply train)",
    ),
    "fastapply-eval": Job(
        "fastapply",
        ("eval",),
        "transformers greedy exact match of a fixture (= fastapply eval)",
    ),
    "models": Job(
        "models",
        (),
        "write a tiny random-weight hybrid model fixture (KIND OUT)",
    ),
}


def usage() -> str:
    width = max(map(len, JOBS))
    lines = [
        "usage: python -m harness JOB [ARGS...]",
        "",
        "The equivalence harness's jobs; 'python -m harness JOB --help' shows",
        "a job's options.",
        "",
        "jobs:",
    ]
    for name, job in JOBS.items():
        text = textwrap.wrap(job.help, 78 - width - 4, break_on_hyphens=False)
        lines.append(f"  {name:<{width}}  {text[0]}")
        lines += [" " * (width + 4) + t for t in text[1:]]
    return "\n".join(lines) + "\n"


def _entry(module: str) -> Callable[[list[str]], object]:
    mod = importlib.import_module(f"harness.{module}")
    if module == "report":  # its command line is the __main__ block

        def main(argv: list[str]) -> None:
            print(mod.side_by_side(argv), end="")

        return main
    return mod.main


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0
    name, rest = args[0], args[1:]
    job = JOBS.get(name)
    if job is None:
        sys.stderr.write(f"python -m harness: unknown job {name!r}\n\n" + usage())
        return 2
    # argparse names the program after argv[0]: the module that runs the job
    sys.argv[0] = f"python -m harness.{job.module}"
    rc = _entry(job.module)([*job.prefix, *rest])
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
