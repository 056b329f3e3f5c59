"""``vllm serve`` end to end: speculative servers against a non-speculative
reference, over the OpenAI-compatible API, in one bounded call.

    python -m serving.serve_check --model DIR --out OUT --prompts fastapply \\
        --server ref=none --server ngram=ngram --server mtp=mtp --deadline 540

What it does, in order, within ``--deadline`` seconds (a watchdog kills
everything it started and exits at the deadline plus a grace; ``--deadline
0``: no deadline, each step waits for its condition, as dry runs on a busy
CPU host want):

1. launches one ``vllm serve DIR`` per ``--server NAME=SPEC`` (the first is
   the reference; SPEC is ``none``, a preset of ``PRESETS`` or a JSON
   speculative config), side by side on one GPU on distinct ports, each in
   its own process group (``--gpu-mem`` and ``--kv-bytes`` split the GPU;
   the fixed KV size avoids memory profiling that the neighbours would
   disturb), with the engine flags of ``--engine-args``; logs under
   ``OUT/logs``. ``--attach NAME=URL`` uses a running server instead;
2. waits for every ``/health``;
3. sends the same ``--n`` requests to every server, ``--concurrency`` in
   flight per server (all servers at once): greedy (temperature 0),
   bounded ``max_tokens``, heterogeneous prompts (``--prompts``), over
   ``/v1/completions`` and ``/v1/chat/completions``, streaming (chunks
   concatenated) and not, in a fixed rotation. Every request asks for the
   token ids (vLLM's ``return_token_ids``); the reference's also ask for
   the top-k log-probabilities (``--logprobs ref``, ``prompts.TOP_K``);
4. scrapes each server's ``/metrics`` before and after: the spec-decode
   counters (``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``,
   ``_num_accepted_tokens``, per position) give the acceptance rate and the
   mean acceptance length ``1 + accepted / drafts``;
5. compares each candidate with the reference per request: text, token ids
   and finish reason. A differing request is judged token by token,
   margin-aware as ``harness.compare`` does: the reference server scores
   ``prompt + candidate tokens`` teacher-forced (``prompt_logprobs``); a
   position where the candidate's token is below the reference's top choice
   by less than the tie margin is a *tie*, by more a *divergence*; the
   margin is ``--tie-margin`` (bf16 noise) or twice the noise measured on
   the reference's own answers, whichever is larger (``compare.rescore``).
   Without that (``--no-rescore``) only the first difference is judged,
   from the reference's own top-k;
6. optionally runs lm-eval against every server (``--lm-eval TASK_DIR``,
   see ``serving/lm_eval_task``);
7. writes ``OUT/serve_check.json`` (every response, every judgement, the
   metrics) and ``OUT/serve_check.md`` (the summary), prints the summary,
   and stops the servers (SIGTERM to each group, SIGKILL after a grace).

Verdict per candidate: ``PASS`` when every request is identical to the
reference, ``PASS-TIES`` when the only differences are ties, ``FAIL`` when
a request diverged, failed or is missing, or returned the same tokens with
another text. ``--control NAME`` marks a negative control (e.g. the same
server on upstream v0.26.0 through ``--server-cmd``): expected to fail,
reported, not part of the verdict. Exit status 0 when every candidate that
is not a control passes (ties included), 1 otherwise, 2 on a usage error,
3 when the reference did not come up, 124 when the watchdog fired.

This module is the command line and the order of the steps; each job is its
own module: ``serving.servers`` (launch, ``/health``, stop: steps 1, 2, 7),
``serving.prompts`` (the request sets), ``serving.client`` (the load, step
3), ``serving.metrics`` (step 4), ``serving.compare`` (step 5),
``serving.lmeval`` (step 6) and ``serving.report`` (the summary).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from . import CheckError
from .client import run_requests
from .compare import TIE_MARGIN, compare, exact_match, finalize, rescore, summarize
from .lmeval import run_lm_eval
from .metrics import metrics_delta, scrape_all
from .prompts import build_requests
from .report import markdown
from .servers import (
    PRESETS,
    QWEN35_ENGINE_ARGS,
    add_server_args,
    default_vllm_cmd,
    launch,
    log_facts,
    log_tail,
    name_values,
    server_specs,
    stop,
    wait_ready,
)


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python -m serving.serve_check",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="model directory for vllm serve")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/serve_check")
    ap.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="a server: SPEC none | "
        + " | ".join(p for p in PRESETS if p != "none")
        + " | JSON; the first is the reference (default: ref=none ngram=ngram)",
    )
    ap.add_argument(
        "--server-args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="extra vllm serve arguments for one server",
    )
    ap.add_argument(
        "--server-cmd",
        action="append",
        default=[],
        metavar="NAME=CMD",
        help="the command (taking `serve MODEL ...`) for one server, e.g. "
        "another vLLM install: 'env PYTHONPATH=... python3 -m "
        "vllm.entrypoints.cli.main'",
    )
    ap.add_argument(
        "--control",
        action="append",
        default=[],
        metavar="NAME",
        help="a negative control: a candidate expected to FAIL (e.g. upstream "
        "v0.26.0); its verdict does not decide the exit status",
    )
    ap.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="use a running server for NAME instead of launching one",
    )
    ap.add_argument("--prompts", default="fastapply", choices=["fastapply", "text"])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="prompt set seed")
    ap.add_argument(
        "--deadline",
        type=float,
        default=540.0,
        help="seconds for everything; the watchdog fires 20 s later (0: no "
        "deadline and no watchdog; every step waits for its condition)",
    )
    ap.add_argument(
        "--client-budget",
        type=float,
        default=120.0,
        help="seconds kept for the requests after the servers are up (with a deadline)",
    )
    ap.add_argument(
        "--vllm-cmd",
        default=None,
        help="command that takes `serve MODEL ...` (default: vllm on "
        "PATH, else python -m vllm.entrypoints.cli.main)",
    )
    add_server_args(
        ap,
        port=8100,
        cache_root="/tmp/serve-check-cache",
        gpu_mem=0.1,
        engine_args=QWEN35_ENGINE_ARGS,
    )
    ap.add_argument(
        "--stagger", type=float, default=2.0, help="seconds between server launches"
    )
    ap.add_argument("--logprobs", choices=["ref", "all", "none"], default="ref")
    ap.add_argument("--tie-margin", type=float, default=TIE_MARGIN)
    ap.add_argument("--no-rescore", action="store_true")
    ap.add_argument(
        "--lm-eval",
        default=None,
        metavar="TASK_DIR",
        help="run lm-eval (completions and chat) on every server",
    )
    ap.add_argument("--lm-eval-task", default="fastapply")
    ap.add_argument(
        "--lm-eval-cmd", default=f"{shlex.quote(sys.executable)} -m lm_eval"
    )
    ap.add_argument("--lm-eval-limit", type=int, default=0)
    ap.add_argument("--lm-eval-concurrency", type=int, default=16)
    a = ap.parse_args(argv)
    if not a.server:
        a.server = ["ref=none", "ngram=ngram"]
    if a.vllm_cmd is None:
        a.vllm_cmd = default_vllm_cmd()
    return a


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    try:
        a = parse_args(argv)
        servers = server_specs(a)
        if len(servers) < 2:
            raise CheckError("need a reference and at least one candidate (--server)")
        by_name = {s.name: s for s in servers}
        for name, cmd in name_values(a.server_cmd, "--server-cmd").items():
            if name not in by_name:
                raise CheckError(f"--server-cmd for unknown server {name!r}")
            by_name[name].cmd = cmd
        for name in a.control:
            if name not in by_name or name == servers[0].name:
                raise CheckError(f"--control {name!r}: not a candidate server")
            by_name[name].control = True
        for name, url in name_values(a.attach, "--attach").items():
            if name not in by_name:
                raise CheckError(f"--attach for unknown server {name!r}")
            by_name[name].url, by_name[name].attached = url.rstrip("/"), True
        reqs = build_requests(a.prompts, a.n, a.seed, a.max_tokens)
    except CheckError as e:
        print(f"serve_check: error: {e}", file=sys.stderr)
        return 2
    deadline = t_start + a.deadline if a.deadline > 0 else math.inf
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    # the watchdog: whatever hangs, the servers go and the process ends
    report: dict = {}

    def fire():
        log("[serve_check] watchdog: deadline passed, stopping the servers")
        stop(servers, grace=5)
        with contextlib.suppress(Exception):
            report["verdict"] = "TIMEOUT"
            report["total_s"] = round(time.monotonic() - t_start, 1)
            (out / "serve_check.json").write_text(json.dumps(report, indent=1))
            (out / "serve_check.md").write_text(
                f"# serve_check\n\nVerdict: **TIMEOUT** after {report['total_s']} s "
                "(the watchdog stopped the servers; logs under logs/).\n"
            )
        os._exit(124)

    dog = None
    if not math.isinf(deadline):
        dog = threading.Timer(max(1.0, deadline + 20 - time.monotonic()), fire)
        dog.daemon = True
        dog.start()

    def on_signal(signum, frame):
        stop(servers, grace=5)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    report.update(
        {
            "schema": "hsfork-serve-check/1",
            "config": {
                "model": a.model,
                "prompts": a.prompts,
                "n": a.n,
                "concurrency": a.concurrency,
                "max_tokens": a.max_tokens,
                "seed": a.seed,
                "tie_margin": a.tie_margin,
                "logprobs": a.logprobs,
                "max_model_len": a.max_model_len,
                "gpu_mem": a.gpu_mem,
                "kv_bytes": a.kv_bytes,
                "engine_args": a.engine_args,
                "vllm_cmd": a.vllm_cmd,
                "deadline": a.deadline,
            },
            "reference": servers[0].name,
            "requests": [asdict(r) for r in reqs],
            "servers": [],
            "candidates": {},
            "failed": {},
        }
    )
    rc = 1
    try:
        for i, s in enumerate(servers):
            if not s.attached:
                if i and a.stagger:
                    time.sleep(a.stagger)
                launch(a, s, out / "logs")
                log(f"[serve_check] launched {s.name} on {s.url} (log {s.log})")
        ready_by = (
            t_start + max(a.deadline / 2, a.deadline - a.client_budget)
            if not math.isinf(deadline)
            else math.inf
        )
        failed = asyncio.run(wait_ready(servers, ready_by, log))
        for name in failed:
            report["failed"][name] = log_tail(by_name[name].log, 40)
        ref = servers[0]
        if ref.name in failed:
            raise CheckError("the reference server did not come up")
        live = [s for s in servers if s.name not in failed]
        if len(live) < 2:
            raise CheckError("no candidate server came up")
        scrape_s = None if math.isinf(deadline) else 20.0
        before = asyncio.run(scrape_all(live, scrape_s))
        logprobs_for = {
            "ref": {ref.name},
            "all": {s.name for s in live},
            "none": set(),
        }[a.logprobs]
        log(
            f"[serve_check] {len(reqs)} requests x {len(live)} servers, "
            f"{a.concurrency} in flight each"
        )
        results = asyncio.run(
            run_requests(
                live, reqs, a.served_name, a.concurrency, logprobs_for, deadline - 15
            )
        )
        after = asyncio.run(scrape_all(live, scrape_s))
        for s in live:
            res = results[s.name]
            toks = sum(len(r["token_ids"] or []) for r in res)
            s_info = {
                "name": s.name,
                "spec": s.spec,
                "url": s.url,
                "version": s.version,
                "ready_s": s.ready_s,
                "client_s": s.client_s,
                "errors": sum(r["error"] is not None for r in res),
                "output_tokens": toks,
                "tokens_per_s": round(toks / s.client_s, 1) if s.client_s else None,
                "exact_match": exact_match(reqs, res),
                "spec_metrics": metrics_delta(before.get(s.name), after.get(s.name)),
                "log_facts": log_facts(s.log) if s.log else [],
                "results": res,
            }
            report["servers"].append(s_info)
        ref_res = results[ref.name]
        for s in live[1:]:
            rows = compare(reqs, ref_res, results[s.name], a.tie_margin)
            for pos, row in enumerate(rows):
                row["idx_pos"] = pos
            judged = None
            if not a.no_rescore and time.monotonic() < deadline - 10:
                judged = asyncio.run(
                    rescore(
                        ref.url,
                        a.served_name,
                        rows,
                        ref_res,
                        results[s.name],
                        a.tie_margin,
                        deadline - 5,
                    )
                )
            finalize(rows, judged["margin"] if judged else None)
            for row in rows:
                row.pop("idx_pos", None)
            report["candidates"][s.name] = {
                "summary": summarize(rows, len(reqs)),
                "tie_margin": judged,
                "rows": rows,
            }
        for name in failed:
            report["candidates"][name] = {
                "summary": {
                    "verdict": "FAIL",
                    "error": "server did not come up",
                    "missing": len(reqs),
                },
                "rows": [],
            }
        if a.lm_eval and time.monotonic() < deadline - 30:
            report["lm_eval"] = run_lm_eval(a, live, out, deadline - 5, log)
        for name, c in report["candidates"].items():
            if by_name[name].control:
                c["control"] = True
                c["summary"]["control_outcome"] = (
                    "expected-fail"
                    if c["summary"]["verdict"] == "FAIL"
                    else "unexpected-pass (the check did not tell it apart)"
                )
        verdicts = [
            c["summary"]["verdict"]
            for name, c in report["candidates"].items()
            if not by_name[name].control
        ]
        ok = all(v in ("PASS", "PASS-TIES") for v in verdicts) and bool(verdicts)
        report["verdict"] = "PASS" if ok else "FAIL"
        rc = 0 if ok else 1
    except CheckError as e:
        log(f"[serve_check] error: {e}")
        report["verdict"] = "ERROR"
        report["error"] = str(e)
        rc = 3
    finally:
        stop(servers)
        if dog is not None:
            dog.cancel()
        for s in report["servers"]:
            s["exit_code"] = by_name[s["name"]].exit_code
        report["total_s"] = round(time.monotonic() - t_start, 1)
        (out / "serve_check.json").write_text(json.dumps(report, indent=1) + "\n")
        md = markdown(report)
        (out / "serve_check.md").write_text(md)
        print(md, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
