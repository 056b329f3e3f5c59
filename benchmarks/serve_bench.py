"""``vllm bench serve`` for the fork and upstream v0.26.0, one server at a
time, in one bounded GPU call (issue 7 item 2).

    python -m benchmarks.serve_bench run --suite fastapply --model DIR \\
        --tokenizer DIR/tokenizer --variant fork=CMD --variant upstream=CMD \\
        --specs none,ngram,mtp --concurrency 1,8,32 --out OUT --deadline 520
    python -m benchmarks.serve_bench summary OUT [OUT ...] --out DIR --name NAME
    python -m benchmarks.serve_bench bandwidth [--gib 2] [--device cuda]
    python -m benchmarks.serve_bench client RUNS.json [--parse-only]

``run``: for each speculative config of ``--specs`` (presets of
``serving.servers.PRESETS``), a pair of servers, fork and upstream
(each ``--variant NAME=CMD``, a command that takes ``serve MODEL ...``),
the order alternating from pair to pair (fork first, upstream first, ...).
Each server is launched alone on the GPU with ``serving.servers``'
launcher (own process group, own port, fixed KV cache size, log file),
waited for on ``/health``, benchmarked with ``vllm bench serve`` once per
``--concurrency`` value (``--max-concurrency C``, ``--num-prompts
max(prompts-min, prompts-mult * C)``, greedy, results saved with
``--save-result --save-detailed``), and stopped (SIGTERM then SIGKILL to
its group) before the next one starts. The benchmark client is the fork's
``vllm bench serve`` for every server, run in one process per server
(``client``: the same parser and entry point as the CLI, without paying the
vLLM import per concurrency); ``--bench-cli 'vllm bench serve'`` runs the
CLI itself once per concurrency instead.

Prompts: ``--dataset fastapply``: ``harness.fastapply.make_eval_set``
prompts as text (``serving.make_model.prompt_text``) in a JSONL for
``--dataset-name custom`` (``--skip-chat-template``, ``--disable-shuffle``,
EOS ends each answer, ``--custom-output-len`` caps it); every response is
also checked against the known answer (exact match). ``--dataset random``:
vLLM's random dataset, ``--input-len`` / ``--output-len``, ``ignore_eos``.

Time: ``--deadline`` seconds for everything. A pair starts only if twice
the longest server seen so far (``--server-estimate`` before any) fits; a
server that is not healthy in time is given up; the client skips a
concurrency that would end past the deadline; a watchdog stops everything
20 s after it. ``--deadline 0``: no deadline, no skips, no watchdog; every
step waits for its condition (dry runs on a busy CPU host). Outputs,
written as they come: ``OUT/runs/*.json`` (vLLM's
saved results, with ``suite``, ``spec``, ``variant`` as metadata),
``OUT/logs/`` (server and client logs), ``OUT/meta.json`` (servers,
timings, skips, exact match, bandwidth, weight bytes) and the summary
``OUT/<suite>.md``, ``.json``, ``.png`` (refreshed after every server).

``bandwidth``: device-to-device copy bandwidth of a large tensor (CUDA
events), for the weight-read floor of a decode step: the bytes of the
weights a decode step reads (``decode_weight_bytes``: the language model
without its embedding table, plus ``lm_head``; read from the safetensors
headers) over that bandwidth.

This module is ``run`` (the servers' lifecycle and the order of the steps)
and the dispatch to the other jobs, each its own module:
``benchmarks.bench_client`` (``client``: prompts, ``vllm bench serve``
command lines and runs), ``benchmarks.serve_report`` (``summary``: tables
and plot) and ``benchmarks.weight_floor`` (``bandwidth``, decode weight
bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from serving import CheckError
from serving import servers as sv

from . import BenchError
from .bench_client import (
    bench_argv,
    client_main,
    exact_match,
    num_prompts,
    write_fastapply_dataset,
)
from .serve_report import SCHEMA, summary_main, summary_write
from .weight_floor import bandwidth_main, decode_weight_bytes

REPO = Path(__file__).resolve().parent.parent


SUITES = {
    # defaults per suite: specs, concurrency list, dataset
    "fastapply": {"specs": "none,ngram,mtp", "concurrency": "1,8,32"},
    "qwen9b": {"specs": "none", "concurrency": "1,8,32,64"},
}


def _csv_ints(text: str) -> list[int]:
    vals = [int(x) for x in str(text).replace(" ", ",").split(",") if x]
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return vals


def _csv(text: str) -> list[str]:
    return [x for x in str(text).replace(" ", ",").split(",") if x]


def plan(specs: list[str], variants: list[str]) -> list[list[tuple[str, str]]]:
    """Pairs of ``(spec, variant)``, one pair per spec, the variant order
    rotating from pair to pair (fork-upstream, upstream-fork, ...)."""
    out = []
    for i, spec in enumerate(specs):
        k = i % len(variants)
        order = variants[k:] + variants[:k]
        out.append([(spec, v) for v in order])
    return out


def _left(deadline: float) -> float | None:
    """Seconds to a ``time.time()`` deadline (at least 1), None (no limit)
    without one (``math.inf``)."""
    return None if math.isinf(deadline) else max(1.0, deadline - time.time())


def _group_gone(pid: int, wait: float) -> bool:
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return True
        time.sleep(0.2)
    return False


def _kill_group(proc: subprocess.Popen | None, grace: float = 5.0) -> None:
    if proc is None or (proc.poll() is not None and _group_gone(proc.pid, 0.01)):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def parse_run_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench run")
    ap.add_argument("--suite", required=True, help="fastapply | qwen9b | any name")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", default=None, help="default: --model")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=CMD",
        help="a vLLM install: the command that takes `serve MODEL ...` "
        "(default: fork=<python> -m vllm.entrypoints.cli.main)",
    )
    ap.add_argument("--specs", default=None, help="comma list of presets")
    ap.add_argument("--concurrency", type=_csv_ints, default=None)
    ap.add_argument("--dataset", choices=["fastapply", "random"], default=None)
    ap.add_argument("--prompts-min", type=int, default=16)
    ap.add_argument("--prompts-mult", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/serve-bench")
    ap.add_argument(
        "--deadline",
        type=float,
        default=520.0,
        help="seconds for everything (0: no deadline, no watchdog)",
    )
    ap.add_argument(
        "--server-estimate",
        type=float,
        default=150.0,
        help="seconds for one server (start + benchmark) before any ran",
    )
    ap.add_argument(
        "--bench-cli",
        default=None,
        help="run this command (e.g. 'vllm bench serve') per concurrency "
        "instead of the in-process client",
    )
    ap.add_argument("--python", default=sys.executable)
    sv.add_server_args(
        ap, port=8200, cache_root="/tmp/serve-bench-cache", gpu_mem=0.3, engine_args=""
    )
    ap.add_argument(
        "--bandwidth",
        action="store_true",
        help="measure the device copy bandwidth first (weight-read floor)",
    )
    ap.add_argument("--bandwidth-device", default="cuda")
    ap.add_argument("--bandwidth-gib", type=float, default=2.0)
    ap.add_argument(
        "--weights",
        action="store_true",
        help="record the bytes a decode step reads (from --model's safetensors)",
    )
    ap.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    defaults = SUITES.get(a.suite, SUITES["qwen9b"])
    a.specs = _csv(a.specs or defaults["specs"])
    a.concurrency = a.concurrency or _csv_ints(defaults["concurrency"])
    a.dataset = a.dataset or ("fastapply" if a.suite == "fastapply" else "random")
    a.tokenizer = a.tokenizer or a.model
    if not a.variant:
        a.variant = [f"fork={shlex.quote(a.python)} -m vllm.entrypoints.cli.main"]
    return a


def run_main(argv: list[str]) -> int:
    t_start = time.time()
    try:
        a = parse_run_args(argv)
        variants = sv.name_values(a.variant, "--variant")
        for s in a.specs:
            if s not in sv.PRESETS:
                raise BenchError(f"unknown spec {s!r} ({', '.join(sv.PRESETS)})")
        meta_kv = sv.name_values(a.meta, "--meta")
    except (BenchError, CheckError) as e:
        print(f"serve_bench: error: {e}", file=sys.stderr)
        return 2
    # a time.time(); math.inf without a deadline
    deadline = t_start + a.deadline if a.deadline > 0 else math.inf
    out = Path(a.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[serve_bench {time.time() - t_start:5.0f}s] {msg}", flush=True)

    meta: dict = {
        "schema": SCHEMA,
        "suite": a.suite,
        "config": {
            "model": a.model,
            "tokenizer": a.tokenizer,
            "variants": variants,
            "specs": {s: sv.PRESETS[s] for s in a.specs},
            "concurrency": a.concurrency,
            "dataset": a.dataset,
            "prompts": {
                c: num_prompts(c, a.prompts_min, a.prompts_mult) for c in a.concurrency
            },
            "input_len": a.input_len,
            "output_len": a.output_len,
            "engine_args": a.engine_args,
            "max_model_len": a.max_model_len,
            "max_num_seqs": a.max_num_seqs,
            "kv_bytes": a.kv_bytes,
            "deadline": a.deadline,
            "client": a.bench_cli or "in-process vllm bench serve",
        },
        "meta": meta_kv,
        "servers": [],
        "skipped": [],
        "exact_match": {},
    }
    state: dict = {"srv": None, "client": None}

    def write_meta():
        meta["total_s"] = round(time.time() - t_start, 1)
        (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")

    def report():
        write_meta()
        with contextlib.suppress(Exception):
            summary_write([out], out, a.suite)

    def fire():
        log("watchdog: deadline passed, stopping everything")
        _kill_group(state["client"], 2)
        if state["srv"] is not None:
            sv.stop([state["srv"]], grace=3)
        meta["watchdog"] = True
        with contextlib.suppress(Exception):
            report()
        os._exit(124)

    dog = None
    if not math.isinf(deadline):
        dog = threading.Timer(max(1.0, deadline + 20 - time.time()), fire)
        dog.daemon = True
        dog.start()

    def on_signal(signum, frame):
        _kill_group(state["client"], 2)
        if state["srv"] is not None:
            sv.stop([state["srv"]], grace=3)
        os._exit(128 + signum)

    old_handlers = {
        sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
    }

    rc = 0
    try:
        if a.weights:
            try:
                meta["weights"] = decode_weight_bytes(a.model)
                log(f"decode weight bytes: {meta['weights']['decode_bytes']:,}")
            except Exception as e:  # noqa: BLE001 - the floor is extra
                meta["weights_error"] = repr(e)[:500]
        if a.bandwidth:
            bw_log = out / "logs" / "bandwidth.log"
            cmd = [
                a.python,
                "-m",
                "benchmarks.serve_bench",
                "bandwidth",
                "--device",
                a.bandwidth_device,
                "--gib",
                str(a.bandwidth_gib),
                "--out",
                str(out / "bandwidth.json"),
            ]
            with open(bw_log, "w") as fh:
                p = subprocess.run(
                    cmd,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    timeout=_left(deadline),
                    cwd=REPO,
                )
            if p.returncode == 0:
                meta["bandwidth"] = json.loads((out / "bandwidth.json").read_text())
                log(f"copy bandwidth {meta['bandwidth']['copy_gbps']} GB/s")
            else:
                meta["bandwidth_error"] = sv.log_tail(str(bw_log), 20)
        dataset_path = None
        if a.dataset == "fastapply":
            n = max(meta["config"]["prompts"].values())
            dataset_path = write_fastapply_dataset(
                out / "fastapply-prompts.jsonl", n, a.seed, a.output_len
            )
        write_meta()
        longest = 0.0
        for pair in plan(a.specs, list(variants)):
            est = longest or a.server_estimate
            left = deadline - time.time()
            if left < len(pair) * est:
                log(f"skip {pair}: {left:.0f} s left, a server takes ~{est:.0f} s")
                meta["skipped"] += [
                    {"spec": s, "variant": v, "reason": f"{left:.0f} s left"}
                    for s, v in pair
                ]
                write_meta()
                continue
            for spec, variant in pair:
                left = deadline - time.time()
                if left < est * 0.6:
                    log(f"skip {spec}/{variant}: {left:.0f} s left")
                    meta["skipped"].append(
                        {"spec": spec, "variant": variant, "reason": f"{left:.0f} s"}
                    )
                    continue
                info = one_server(
                    a, variants[variant], spec, variant, out, deadline,
                    dataset_path, state, log,
                )  # fmt: skip
                meta["servers"].append(info)
                for name, em in info.pop("exact_match", {}).items():
                    meta["exact_match"][name] = em
                longest = max(longest, info["total_s"])
                if info.get("status") != "ok":
                    rc = 1
                report()
    except BenchError as e:
        log(f"error: {e}")
        meta["error"] = str(e)
        rc = 2
    finally:
        _kill_group(state["client"], 2)
        if state["srv"] is not None:
            sv.stop([state["srv"]], grace=10)
        if dog is not None:
            dog.cancel()
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        report()
    if meta["skipped"] and rc == 0:
        rc = 1
    md = out / f"{a.suite}.md"
    if md.exists():
        print(md.read_text(), flush=True)
    return rc


def server_setup(a, cmd: str, spec: str, variant: str):
    """``serving.serve_check``'s launcher arguments and server for one
    ``(spec, variant)`` server (its command line:
    ``serving.servers.server_command``)."""
    from serving import serve_check

    name = f"{spec}-{variant}"
    ns = serve_check.parse_args(
        [
            "--model",
            a.model,
            "--vllm-cmd",
            cmd,
            "--port",
            str(a.port),
            "--served-name",
            a.served_name,
            "--max-model-len",
            str(a.max_model_len),
            "--max-num-seqs",
            str(a.max_num_seqs),
            "--gpu-mem",
            str(a.gpu_mem),
            "--kv-bytes",
            a.kv_bytes,
            "--engine-args",
            a.engine_args,
            "--cache-root",
            "",
        ]
    )
    return ns, sv.ServerSpec(name, sv.PRESETS[spec])


def one_server(a, cmd, spec, variant, out, deadline, dataset_path, state, log):
    """Start one server, benchmark it at every concurrency, stop it."""
    t0 = time.time()
    ns, srv = server_setup(a, cmd, spec, variant)
    name = srv.name
    info: dict = {"name": name, "spec": spec, "variant": variant, "cmd": cmd}
    # one compile cache per variant (VLLM_CACHE_ROOT): servers never
    # overlap, and a variant's later servers may reuse what its first built
    cache = str(Path(a.cache_root) / variant) if a.cache_root else None
    env_before = os.environ.get("VLLM_CACHE_ROOT")
    if cache:
        os.environ["VLLM_CACHE_ROOT"] = cache
    try:
        sv.launch(ns, srv, out / "logs")
    finally:
        if env_before is None:
            os.environ.pop("VLLM_CACHE_ROOT", None)
        else:
            os.environ["VLLM_CACHE_ROOT"] = env_before
    state["srv"] = srv
    log(f"launched {name} on {srv.url}")
    info["server_log"] = srv.log
    try:
        import asyncio

        # wait_ready takes a monotonic deadline
        ready_by = time.monotonic() + max(1.0, deadline - 15 - time.time())
        failed = asyncio.run(sv.wait_ready([srv], ready_by, log))
        if failed:
            info.update(status="not-ready", log_tail=sv.log_tail(srv.log, 40))
            log(f"{name} did not come up")
            return info
        info["ready_s"] = srv.ready_s
        info["version"] = srv.version
        log(f"{name} ready after {srv.ready_s} s")
        runs = []
        for c in a.concurrency:
            fn = f"{a.suite}-{spec}-{variant}-c{c}.json"
            runs.append(
                {
                    "name": fn[:-5],
                    "result": str(out / "runs" / fn),
                    "argv": bench_argv(
                        port=srv.port,
                        model=a.model,
                        tokenizer=a.tokenizer,
                        served_name=a.served_name,
                        dataset=a.dataset,
                        conc=c,
                        prompts=num_prompts(c, a.prompts_min, a.prompts_mult),
                        result_dir=out / "runs",
                        result_filename=fn,
                        metadata={
                            "suite": a.suite,
                            "spec": spec,
                            "variant": variant,
                            "label": name,
                        },
                        dataset_path=dataset_path,
                        input_len=a.input_len,
                        output_len=a.output_len,
                        seed=a.seed,
                    ),
                }
            )
        spec_file = out / "logs" / f"{name}-client.json"
        status_file = out / "logs" / f"{name}-client-status.json"
        spec_file.write_text(
            json.dumps(
                {
                    "runs": runs,
                    "deadline": 0 if math.isinf(deadline) else deadline - 10,
                    "bench_cli": a.bench_cli,
                    "status": str(status_file),
                },
                indent=1,
            )
        )
        client_log = out / "logs" / f"{name}-client.log"
        t_client = time.time()
        with open(client_log, "w") as fh:
            proc = subprocess.Popen(
                [a.python, "-m", "benchmarks.serve_bench", "client", str(spec_file)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                start_new_session=True,
            )
            state["client"] = proc
            try:
                proc.wait(timeout=_left(deadline - 5))
            except subprocess.TimeoutExpired:
                log(f"{name}: client past the deadline, stopped")
                _kill_group(proc, 2)
            state["client"] = None
        info["client_s"] = round(time.time() - t_client, 1)
        info["client_rc"] = proc.returncode
        with contextlib.suppress(OSError, ValueError):
            info["runs"] = json.loads(status_file.read_text())
        done = [r for r in runs if Path(r["result"]).exists()]
        info["status"] = "ok" if len(done) == len(runs) else "partial"
        if dataset_path is not None:
            ems = {}
            for r in done:
                with contextlib.suppress(OSError, ValueError):
                    res = json.loads(Path(r["result"]).read_text())
                    ems[r["name"]] = exact_match(res, dataset_path)
            info["exact_match"] = ems
        log(
            f"{name}: {len(done)}/{len(runs)} concurrencies in {info['client_s']} s"
            + (f" (client log {client_log})" if info["status"] != "ok" else "")
        )
        return info
    finally:
        t_stop = time.time()
        sv.stop([srv], grace=15)
        if srv.proc is not None:
            _group_gone(srv.proc.pid, 15)
        state["srv"] = None
        info["exit_code"] = srv.exit_code
        info["stop_s"] = round(time.time() - t_stop, 1)
        info["facts"] = sv.log_facts(srv.log)
        info["total_s"] = round(time.time() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {
        "run": run_main,
        "client": client_main,
        "summary": summary_main,
        "bandwidth": bandwidth_main,
    }
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.split("\n\n")[1])
        return 0
    if not argv or argv[0] not in cmds:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return cmds[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
