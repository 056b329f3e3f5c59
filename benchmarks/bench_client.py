"""Client load for ``benchmarks.serve_bench``: the ``vllm bench serve``
command line for one concurrency (``bench_argv``), the fast-apply prompts
as a ``--dataset-name custom`` JSONL with their known answers
(``write_fastapply_dataset``, ``exact_match``), and the ``client`` job that
runs the fork's own ``vllm bench serve`` once per concurrency in one process
(its parser and entry point, without paying the vLLM import per run).

    python -m benchmarks.serve_bench client RUNS.json [--parse-only]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

from . import BenchError


def num_prompts(conc: int, minimum: int, mult: int) -> int:
    return max(minimum, mult * conc)


def write_fastapply_dataset(path: str | Path, n: int, seed: int, max_tokens: int):
    """``n`` held-out fast-apply prompts as a ``--dataset-name custom``
    JSONL: ``prompt`` (text), ``output_tokens``, and ``answer`` (the
    expected text, ignored by vLLM)."""
    from harness import fastapply as fa
    from serving.make_model import prompt_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for p, ans in fa.make_eval_set(n, seed):
            row = {
                "prompt": prompt_text(p),
                "output_tokens": max_tokens,
                "answer": prompt_text(ans[:-1]),
            }
            f.write(json.dumps(row) + "\n")
    return path


def exact_match(result: dict, dataset: str | Path) -> float | None:
    """Share of responses equal to the known answers (custom dataset, in
    order: ``--disable-shuffle``, no oversampling); None without
    ``generated_texts`` (``--save-detailed``)."""
    texts = result.get("generated_texts")
    if not texts:
        return None
    answers = [
        json.loads(line)["answer"]
        for line in Path(dataset).read_text().splitlines()
        if line.strip()
    ]
    errors = result.get("errors") or [None] * len(texts)
    n = min(len(texts), len(answers))
    if n == 0:
        return None
    ok = sum(
        (not errors[i]) and (texts[i] or "").strip() == answers[i].strip()
        for i in range(n)
    )
    return round(ok / len(texts), 4)


def bench_argv(
    *,
    port: int,
    model: str,
    tokenizer: str,
    served_name: str,
    dataset: str,
    conc: int,
    prompts: int,
    result_dir: str | Path,
    result_filename: str,
    metadata: dict[str, str],
    dataset_path: str | Path | None = None,
    input_len: int = 256,
    output_len: int = 128,
    warmups: int | None = None,
    seed: int = 0,
) -> list[str]:
    """The arguments of ``vllm bench serve`` (after ``bench serve``) for one
    concurrency against ``127.0.0.1:port``."""
    argv = [
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model,
        "--served-model-name",
        served_name,
        "--tokenizer",
        tokenizer,
        "--max-concurrency",
        str(conc),
        "--num-prompts",
        str(prompts),
        "--request-rate",
        "inf",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--num-warmups",
        str(conc if warmups is None else warmups),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_filename,
        "--label",
        metadata.get("label", "serve-bench"),
    ]
    if dataset == "fastapply":
        if dataset_path is None:
            raise BenchError("the fastapply dataset needs its JSONL")
        argv += [
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(dataset_path),
            "--skip-chat-template",
            "--disable-shuffle",
            "--no-oversample",
            "--custom-output-len",
            str(output_len),
        ]
    elif dataset == "random":
        argv += [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(input_len),
            "--random-output-len",
            str(output_len),
            "--random-range-ratio",
            "0",
            "--ignore-eos",
        ]
    else:
        raise BenchError(f"unknown dataset {dataset!r} (fastapply, random)")
    argv += ["--metadata"] + [f"{k}={v}" for k, v in metadata.items()]
    return argv


def _bench_entry():
    """``vllm bench serve``'s parser builder and entry point, as the CLI
    (``vllm.entrypoints.cli.main``) sets them up."""
    with contextlib.suppress(Exception):
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

        cli_env_setup()
    from vllm import platforms

    # as `vllm bench ...` does: no device type inference on a host without one
    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # One tokenizer per process, as vLLM's own cached_get_tokenizer: every
    # concurrency of a server loads the same one, and loading it from a
    # folder without config.json (the fast-apply fixture's tokenizer/) costs
    # vLLM's config retry, a 2 s sleep, each time.
    with contextlib.suppress(ImportError, AttributeError):
        import functools

        import vllm.benchmarks.serve as bench_serve

        if not hasattr(bench_serve.get_tokenizer, "cache_info"):
            bench_serve.get_tokenizer = functools.lru_cache(bench_serve.get_tokenizer)

    def parse(argv: list[str]) -> argparse.Namespace:
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        BenchmarkServingSubcommand.add_cli_args(parser)
        return parser.parse_args(argv)

    return parse, BenchmarkServingSubcommand.cmd


def client_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench client")
    ap.add_argument("runs", help="JSON: {runs: [{name, argv}], deadline, status}")
    ap.add_argument(
        "--parse-only",
        action="store_true",
        help="print the parsed namespaces (RESULT <json>) and exit",
    )
    a = ap.parse_args(argv)
    spec = json.loads(Path(a.runs).read_text())
    # deadline: a time.time(); 0 or absent: none
    runs, deadline = spec["runs"], float(spec.get("deadline") or 0)
    bench_cli = spec.get("bench_cli")
    status_path = spec.get("status")
    status: list[dict] = []

    def save():
        if status_path:
            Path(status_path).write_text(json.dumps(status, indent=1) + "\n")

    parse = cmd = None
    if a.parse_only or not bench_cli:
        parse, cmd = _bench_entry()
    if a.parse_only:
        plain = (str, int, float, bool, type(None), list)
        out = [
            {k: v if isinstance(v, plain) else repr(v) for k, v in vars(ns).items()}
            for ns in (parse(r["argv"]) for r in runs)
        ]
        print("RESULT " + json.dumps(out, default=str), flush=True)
        return 0
    longest = 0.0
    rc = 0
    for r in runs:
        left = deadline - time.time() if deadline else math.inf
        need = max(longest * 1.2, 5.0)
        if left < need:
            status.append(
                {"name": r["name"], "status": "skipped", "reason": f"{left:.0f} s left"}
            )
            print(f"[client] skip {r['name']}: {left:.0f} s left", flush=True)
            save()
            continue
        t0 = time.time()
        print(f"[client] {r['name']}: vllm bench serve {shlex.join(r['argv'])}")
        sys.stdout.flush()
        try:
            if bench_cli:
                p = subprocess.run(
                    shlex.split(bench_cli) + r["argv"],
                    timeout=None if math.isinf(left) else max(1.0, left),
                    stdin=subprocess.DEVNULL,
                )
                if p.returncode:
                    raise RuntimeError(f"exit status {p.returncode}")
            else:
                cmd(parse(r["argv"]))
            st = {"name": r["name"], "status": "ok"}
        except BaseException as e:  # noqa: BLE001 - recorded; next concurrency
            if isinstance(e, KeyboardInterrupt):
                raise
            st = {"name": r["name"], "status": "error", "error": repr(e)[-800:]}
            rc = 1
            print(f"[client] {r['name']} failed: {e!r}", flush=True)
        st["wall_s"] = round(time.time() - t0, 2)
        longest = max(longest, st["wall_s"])
        status.append(st)
        save()
        sys.stdout.flush()
    return rc
