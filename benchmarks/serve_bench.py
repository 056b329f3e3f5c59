"""``vllm bench serve`` for the fork and upstream v0.26.0, one server at a
time, in one bounded GPU call (issue 7 item 2).

    python -m benchmarks.serve_bench run --suite fastapply --model DIR \\
        --tokenizer DIR/tokenizer --variant fork=CMD --variant upstream=CMD \\
        --specs none,ngram,mtp --concurrency 1,8,32 --out OUT --deadline 520
    python -m benchmarks.serve_bench summary OUT [OUT ...] --out DIR --name NAME
    python -m benchmarks.serve_bench bandwidth [--gib 2] [--device cuda]
    python -m benchmarks.serve_bench client RUNS.json [--parse-only]

``run``: for each speculative config of ``--specs`` (presets of
``serving.serve_check.PRESETS``), a pair of servers, fork and upstream
(each ``--variant NAME=CMD``, a command that takes ``serve MODEL ...``),
the order alternating from pair to pair (fork first, upstream first, ...).
Each server is launched alone on the GPU with ``serving.serve_check``'s
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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "hsfork-serve-bench/1"
SUITES = {
    # defaults per suite: specs, concurrency list, dataset
    "fastapply": {"specs": "none,ngram,mtp", "concurrency": "1,8,32"},
    "qwen9b": {"specs": "none", "concurrency": "1,8,32,64"},
}
METRICS = (
    "output_throughput",
    "median_tpot_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "median_ttft_ms",
    "mean_ttft_ms",
    "duration",
    "completed",
    "failed",
    "total_output_tokens",
    "total_input_tokens",
    "request_throughput",
    "spec_decode_acceptance_length",
    "spec_decode_acceptance_rate",
)


class BenchError(RuntimeError):
    """A usage or setup error, printed without a traceback."""


def _csv_ints(text: str) -> list[int]:
    vals = [int(x) for x in str(text).replace(" ", ",").split(",") if x]
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return vals


def _csv(text: str) -> list[str]:
    return [x for x in str(text).replace(" ", ",").split(",") if x]


def num_prompts(conc: int, minimum: int, mult: int) -> int:
    return max(minimum, mult * conc)


# ---------------------------------------------------------------------------
# prompts


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


# ---------------------------------------------------------------------------
# `vllm bench serve` command lines


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


# ---------------------------------------------------------------------------
# the weight-read floor


def safetensors_sizes(path: str | Path) -> dict[str, int]:
    """``{tensor name: bytes}`` from a safetensors file's header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    return {
        k: v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in head.items()
        if k != "__metadata__"
    }


def decode_weight_bytes(model_dir: str | Path) -> dict:
    """Bytes of the weights one decode step of the served language model
    reads: every ``model.language_model.*`` tensor except the embedding
    table (a decode step gathers a few rows of it) plus ``lm_head`` (read
    whole; the embedding table when the checkpoint ties it). Not counted:
    the vision tower (``--language-model-only``), the MTP layer (no
    speculation), KV cache and recurrent state."""
    model_dir = Path(model_dir)
    sizes: dict[str, int] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        sizes.update(safetensors_sizes(f))
    if not sizes:
        raise BenchError(f"no safetensors in {model_dir}")
    return decode_bytes_of(sizes)


def decode_bytes_of(sizes: dict[str, int]) -> dict:
    """``decode_weight_bytes`` from ``{tensor name: bytes}``."""
    embed = "model.language_model.embed_tokens.weight"
    body = sum(
        b
        for k, b in sizes.items()
        if k.startswith("model.language_model.") and k != embed
    )
    head = sum(b for k, b in sizes.items() if k.startswith("lm_head."))
    tied = head == 0 and embed in sizes
    if tied:
        head = sizes[embed]
    other = sum(sizes.values()) - body - head - (0 if tied else sizes.get(embed, 0))
    return {
        "decode_bytes": body + head,
        "language_model_bytes": body,
        "lm_head_bytes": head,
        "tied": tied,
        "embed_bytes": sizes.get(embed, 0),
        "not_read_bytes": other,
        "checkpoint_bytes": sum(sizes.values()),
    }


def weight_read_floor_ms(weight_bytes: float, bandwidth_gbps: float) -> float:
    """Milliseconds to read ``weight_bytes`` at ``bandwidth_gbps`` (GB/s,
    10^9 bytes)."""
    if bandwidth_gbps <= 0:
        raise ValueError("bandwidth must be positive")
    return weight_bytes / (bandwidth_gbps * 1e9) * 1e3


def measure_bandwidth(
    nbytes: int = 2 << 30, iters: int = 20, device: str = "cuda"
) -> dict:
    """Device-to-device copy of an ``nbytes`` tensor, ``iters`` times after
    a warm-up; bandwidth counts the bytes read and written (2 * nbytes per
    copy), as a weight read streams them: GB/s = 2 * nbytes * iters / s."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    cuda = device.startswith("cuda")
    for _ in range(3):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        secs = start.elapsed_time(end) / 1e3
        name = torch.cuda.get_device_name()
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        secs = time.perf_counter() - t0
        name = device
    gbps = 2 * nbytes * iters / secs / 1e9
    del src, dst
    return {
        "copy_gbps": round(gbps, 1),
        "nbytes": nbytes,
        "iters": iters,
        "seconds": round(secs, 6),
        "device": name,
        "method": "dst.copy_(src), bytes read + written",
    }


# ---------------------------------------------------------------------------
# the client: `vllm bench serve` once per concurrency


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


# ---------------------------------------------------------------------------
# the orchestration


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
    from serving import serve_check as sc

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
    sc.add_server_args(
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
    from serving import serve_check as sc

    t_start = time.time()
    try:
        a = parse_run_args(argv)
        variants: dict[str, str] = {}
        for item in a.variant:
            if "=" not in item:
                raise BenchError(f"--variant {item!r}: expected NAME=CMD")
            k, v = item.split("=", 1)
            variants[k.strip()] = v
        for s in a.specs:
            if s not in sc.PRESETS:
                raise BenchError(f"unknown spec {s!r} ({', '.join(sc.PRESETS)})")
        meta_kv = {}
        for item in a.meta:
            if "=" not in item:
                raise BenchError(f"--meta {item!r}: expected KEY=VALUE")
            k, v = item.split("=", 1)
            meta_kv[k.strip()] = v
    except (BenchError, sc.CheckError) as e:
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
            "specs": {s: sc.PRESETS[s] for s in a.specs},
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
            sc.stop([state["srv"]], grace=3)
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
            sc.stop([state["srv"]], grace=3)
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
                meta["bandwidth_error"] = sc.log_tail(str(bw_log), 20)
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
                    a, sc, variants[variant], spec, variant, out, deadline,
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
            sc.stop([state["srv"]], grace=10)
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


def server_setup(a, sc, cmd: str, spec: str, variant: str):
    """``serving.serve_check``'s launcher arguments and server for one
    ``(spec, variant)`` server (its command line: ``sc.server_command``)."""
    name = f"{spec}-{variant}"
    ns = sc.parse_args(
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
    return ns, sc.ServerSpec(name, sc.PRESETS[spec])


def one_server(a, sc, cmd, spec, variant, out, deadline, dataset_path, state, log):
    """Start one server, benchmark it at every concurrency, stop it."""
    t0 = time.time()
    ns, srv = server_setup(a, sc, cmd, spec, variant)
    name = srv.name
    info: dict = {"name": name, "spec": spec, "variant": variant, "cmd": cmd}
    # one compile cache per variant (VLLM_CACHE_ROOT): servers never
    # overlap, and a variant's later servers may reuse what its first built
    cache = str(Path(a.cache_root) / variant) if a.cache_root else None
    env_before = os.environ.get("VLLM_CACHE_ROOT")
    if cache:
        os.environ["VLLM_CACHE_ROOT"] = cache
    try:
        sc.launch(ns, srv, out / "logs")
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
        failed = asyncio.run(sc.wait_ready([srv], ready_by, log))
        if failed:
            info.update(status="not-ready", log_tail=sc.log_tail(srv.log, 40))
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
        sc.stop([srv], grace=15)
        if srv.proc is not None:
            _group_gone(srv.proc.pid, 15)
        state["srv"] = None
        info["exit_code"] = srv.exit_code
        info["stop_s"] = round(time.time() - t_stop, 1)
        info["facts"] = sc.log_facts(srv.log)
        info["total_s"] = round(time.time() - t0, 1)


# ---------------------------------------------------------------------------
# summary: tables and plots


def load_results(inputs) -> tuple[list[dict], dict]:
    """vLLM's saved results among ``inputs`` (files or folders, searched
    recursively; those with ``suite``/``spec``/``variant`` metadata), and
    the merged ``meta.json`` of the folders."""
    from .plot import json_docs

    runs, meta = [], {"exact_match": {}, "servers": [], "skipped": []}
    for f, doc in json_docs(inputs):
        if not isinstance(doc, dict):
            continue
        if doc.get("schema") == SCHEMA:
            for k in ("exact_match",):
                meta[k].update(doc.get(k) or {})
            for k in ("servers", "skipped"):
                meta[k] += doc.get(k) or []
            for k in ("weights", "bandwidth", "suite", "config", "meta"):
                if doc.get(k) is not None:
                    meta.setdefault(k, doc[k])
        elif (
            "output_throughput" in doc
            and "max_concurrency" in doc
            and all(doc.get(k) for k in ("suite", "spec", "variant"))
        ):
            doc["_file"] = f.name
            runs.append(doc)
    # a server skipped by one call and run by a later one is not skipped
    ran = {(s.get("spec"), s.get("variant")) for s in meta["servers"]}
    meta["skipped"] = [
        s for s in meta["skipped"] if (s.get("spec"), s.get("variant")) not in ran
    ]
    return runs, meta


def _row(doc: dict, meta: dict) -> dict:
    r = {
        "suite": doc["suite"],
        "spec": doc["spec"],
        "variant": doc["variant"],
        "conc": int(doc["max_concurrency"]),
        "num_prompts": doc.get("num_prompts"),
    }
    for k in METRICS:
        r[k] = doc.get(k)
    r["exact_match"] = meta["exact_match"].get(doc["_file"][:-5])
    return r


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def summarize_runs(runs: list[dict], meta: dict) -> dict:
    """Rows per (suite, spec, variant, concurrency) (repeats averaged),
    speedups over ``none`` (tok/s ratio and TPOT ratio, same variant and
    concurrency), fork/upstream ratios, the BS=1 weight-read floor."""
    groups: dict[tuple, list[dict]] = {}
    for doc in runs:
        r = _row(doc, meta)
        groups.setdefault((r["suite"], r["spec"], r["variant"], r["conc"]), []).append(
            r
        )
    rows = []
    for _key, rs in sorted(groups.items(), key=lambda kv: _order(kv[0])):
        row = dict(rs[0])
        row["repeats"] = len(rs)
        for k in METRICS + ("exact_match",):
            vals = [x[k] for x in rs if isinstance(x[k], (int, float))]
            row[k] = sum(vals) / len(vals) if vals else None
        rows.append(row)
    idx = {(r["suite"], r["spec"], r["variant"], r["conc"]): r for r in rows}
    speedups = []
    for r in rows:
        if r["spec"] == "none":
            continue
        base = idx.get((r["suite"], "none", r["variant"], r["conc"]))
        if not base:
            continue
        speedups.append(
            {
                "suite": r["suite"],
                "spec": r["spec"],
                "variant": r["variant"],
                "conc": r["conc"],
                "tput_speedup": _ratio(
                    r["output_throughput"], base["output_throughput"]
                ),
                "tpot_speedup": _ratio(base["median_tpot_ms"], r["median_tpot_ms"]),
                "exact_match": r["exact_match"],
                "acceptance_length": r["spec_decode_acceptance_length"],
            }
        )
    ratios = []
    for r in rows:
        if r["variant"] != "fork":
            continue
        up = idx.get((r["suite"], r["spec"], "upstream", r["conc"]))
        if not up:
            continue
        ratios.append(
            {
                "suite": r["suite"],
                "spec": r["spec"],
                "conc": r["conc"],
                "tput_ratio": _ratio(r["output_throughput"], up["output_throughput"]),
                "tpot_ratio": _ratio(r["median_tpot_ms"], up["median_tpot_ms"]),
                "mean_tpot_ratio": _ratio(r["mean_tpot_ms"], up["mean_tpot_ms"]),
            }
        )
    floor = None
    w, bw = meta.get("weights"), meta.get("bandwidth")
    if w and bw and bw.get("copy_gbps"):
        f_ms = weight_read_floor_ms(w["decode_bytes"], bw["copy_gbps"])
        floor = {
            "decode_bytes": w["decode_bytes"],
            "copy_gbps": bw["copy_gbps"],
            "floor_ms": f_ms,
            "device": bw.get("device"),
            "bs1": {},
        }
        for r in rows:
            if r["spec"] == "none" and r["conc"] == 1 and r["median_tpot_ms"]:
                floor["bs1"][r["variant"]] = {
                    "median_tpot_ms": r["median_tpot_ms"],
                    "over_floor": r["median_tpot_ms"] / f_ms,
                    "floor_share": f_ms / r["median_tpot_ms"],
                }
    return {
        "schema": SCHEMA + "-summary",
        "rows": rows,
        "speedups": speedups,
        "fork_over_upstream": ratios,
        "weight_read_floor": floor,
        "weights": w,
        "bandwidth": bw,
        "servers": [
            {
                k: s.get(k)
                for k in (
                    "name",
                    "status",
                    "ready_s",
                    "client_s",
                    "total_s",
                    "version",
                    "exit_code",
                )
            }
            for s in meta.get("servers", [])
        ],
        "skipped": meta.get("skipped", []),
        "meta": meta.get("meta"),
        "config": meta.get("config"),
    }


SPEC_ORDER = ("none", "ngram", "ngram8", "mtp", "mtp1")
VARIANT_ORDER = ("fork", "upstream")


def _order(key):
    suite, spec, variant, conc = key
    s = SPEC_ORDER.index(spec) if spec in SPEC_ORDER else len(SPEC_ORDER)
    v = VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else 9
    return (suite, s, spec, v, variant, conc)


def _f(x, fmt="{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(summary: dict, title: str) -> str:
    lines = [f"# {title}", ""]
    cfg = summary.get("config") or {}
    if cfg:
        lines += [
            f"`vllm bench serve` (fork's client), {cfg.get('dataset')} prompts, "
            f"concurrency {cfg.get('concurrency')}, prompts per run "
            f"{cfg.get('prompts')}, greedy; one server at a time, fork and "
            "upstream interleaved. TPOT: (latency - TTFT) / (output tokens - 1) "
            "per request, median over requests.",
            "",
        ]
    lines += [
        "| spec | variant | conc | prompts | out tok/s | TPOT med ms | TPOT mean "
        "ms | TPOT p99 ms | ITL med ms | TTFT med ms | accept len | exact | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['spec']} | {r['variant']} | {r['conc']} | {r['num_prompts']} "
            f"| {_f(r['output_throughput'], '{:.1f}')} "
            f"| {_f(r['median_tpot_ms'], '{:.3f}')} "
            f"| {_f(r['mean_tpot_ms'], '{:.3f}')} | {_f(r['p99_tpot_ms'], '{:.3f}')} "
            f"| {_f(r['median_itl_ms'], '{:.3f}')} "
            f"| {_f(r['median_ttft_ms'], '{:.1f}')} "
            f"| {_f(r['spec_decode_acceptance_length'])} "
            f"| {_f(r['exact_match'], '{:.3f}')} | {_f(r['failed'], '{:.0f}')} |"
        )
    lines.append("")
    if summary["speedups"]:
        lines += [
            "## Speculation over no speculation (same variant, same concurrency)",
            "",
            "tok/s: output tokens/s ratio; TPOT: no-spec TPOT / spec TPOT.",
            "",
            "| spec | variant | conc | tok/s speedup | TPOT speedup | accept len "
            "| exact |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for s in summary["speedups"]:
            lines.append(
                f"| {s['spec']} | {s['variant']} | {s['conc']} "
                f"| {_f(s['tput_speedup'], '{:.2f}x')} "
                f"| {_f(s['tpot_speedup'], '{:.2f}x')} "
                f"| {_f(s['acceptance_length'])} "
                f"| {_f(s['exact_match'], '{:.3f}')} |"
            )
        lines.append("")
    if summary["fork_over_upstream"]:
        lines += [
            "## Fork / upstream",
            "",
            "| spec | conc | tok/s ratio | TPOT ratio (median) | TPOT ratio (mean) |",
            "|---|---:|---:|---:|---:|",
        ]
        for q in summary["fork_over_upstream"]:
            lines.append(
                f"| {q['spec']} | {q['conc']} | {_f(q['tput_ratio'], '{:.3f}')} "
                f"| {_f(q['tpot_ratio'], '{:.3f}')} "
                f"| {_f(q['mean_tpot_ratio'], '{:.3f}')} |"
            )
        lines.append("")
    fl = summary.get("weight_read_floor")
    if fl:
        lines += [
            "## BS=1 step time against the weight-read floor",
            "",
            f"Weights a decode step reads: {fl['decode_bytes'] / 1e9:.3f} GB; "
            f"device copy bandwidth {fl['copy_gbps']:.0f} GB/s ({fl['device']}); "
            f"floor {fl['floor_ms']:.3f} ms per step.",
            "",
            "| variant | TPOT med ms (BS 1) | / floor | floor share |",
            "|---|---:|---:|---:|",
        ]
        for v, b in fl["bs1"].items():
            lines.append(
                f"| {v} | {b['median_tpot_ms']:.3f} | {b['over_floor']:.2f}x "
                f"| {b['floor_share']:.1%} |"
            )
        lines.append("")
    if summary.get("servers"):
        lines += [
            "## Servers",
            "",
            "| server | status | ready s | client s | total s | exit |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for s in summary["servers"]:
            lines.append(
                f"| {s['name']} | {s['status']} | {_f(s['ready_s'], '{:.0f}')} "
                f"| {_f(s['client_s'], '{:.0f}')} | {_f(s['total_s'], '{:.0f}')} "
                f"| {s['exit_code']} |"
            )
        lines.append("")
    if summary.get("skipped"):
        lines.append(
            "Skipped for lack of time: "
            + ", ".join(f"{s['spec']}/{s['variant']}" for s in summary["skipped"])
            + "."
        )
        lines.append("")
    return "\n".join(lines)


def plot_png(summary: dict, path: Path, title: str) -> Path | None:
    """Output tok/s and median TPOT against concurrency, every (spec,
    variant), plus speedups over no speculation (or fork/upstream)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - the table is the result; the plot is extra
        return None
    rows = summary["rows"]
    if not rows:
        return None
    specs = sorted({r["spec"] for r in rows}, key=lambda s: _order(("", s, "", 0)))
    variants = sorted(
        {r["variant"] for r in rows}, key=lambda v: _order(("", "", v, 0))
    )
    third = bool(summary["speedups"]) or bool(summary["fork_over_upstream"])
    fig, axes = plt.subplots(1, 3 if third else 2, figsize=(15 if third else 10, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("o-", "s--", "^:", "d-.")
    concs = sorted({r["conc"] for r in rows})
    for i, spec in enumerate(specs):
        for j, v in enumerate(variants):
            rs = sorted(
                (r for r in rows if r["spec"] == spec and r["variant"] == v),
                key=lambda r: r["conc"],
            )
            kw = {"color": colors[i % len(colors)], "label": f"{spec} / {v}"}
            st = styles[j % len(styles)]
            pts = [(r["conc"], r["output_throughput"]) for r in rs]
            pts = [p for p in pts if p[1] is not None]
            if pts:
                axes[0].plot(*zip(*pts, strict=True), st, **kw)
            pts = [(r["conc"], r["median_tpot_ms"]) for r in rs]
            pts = [p for p in pts if p[1] is not None]
            if pts:
                axes[1].plot(*zip(*pts, strict=True), st, **kw)
    fl = summary.get("weight_read_floor")
    if fl:
        axes[1].axhline(fl["floor_ms"], color="red", ls=":", label="weight-read floor")
    axes[0].set_ylabel("output tokens / s")
    axes[1].set_ylabel("TPOT, median (ms)")
    if third:
        ax = axes[2]
        if summary["speedups"]:
            for i, spec in enumerate(specs):
                for j, v in enumerate(variants):
                    pts = sorted(
                        (s["conc"], s["tput_speedup"])
                        for s in summary["speedups"]
                        if s["spec"] == spec
                        and s["variant"] == v
                        and s["tput_speedup"] is not None
                    )
                    if pts:
                        ax.plot(
                            *zip(*pts, strict=True),
                            styles[j % len(styles)],
                            color=colors[i % len(colors)],
                            label=f"{spec} / {v}",
                        )
            ax.set_ylabel("tok/s over no speculation")
        else:
            for i, spec in enumerate(specs):
                pts = sorted(
                    (q["conc"], q["tpot_ratio"])
                    for q in summary["fork_over_upstream"]
                    if q["spec"] == spec and q["tpot_ratio"] is not None
                )
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True),
                        "o-",
                        color=colors[i % len(colors)],
                        label=f"{spec}: TPOT fork / upstream",
                    )
            ax.set_ylabel("fork / upstream (median TPOT)")
        ax.axhline(1.0, color="gray", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs)
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("max concurrency")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_write(inputs, out: str | Path, name: str) -> dict:
    runs, meta = load_results(inputs)
    summary = summarize_runs(runs, meta)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"vllm bench serve: {name}"
    dev = (summary.get("bandwidth") or {}).get("device")
    if dev:
        title += f" ({dev})"
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(summary, title))
    png = plot_png(summary, out / f"{name}.png", title)
    summary["png"] = str(png) if png else None
    return summary


def summary_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench summary")
    ap.add_argument("inputs", nargs="+", help="output folders or result JSONs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="serve-bench")
    a = ap.parse_args(argv)
    s = summary_write(a.inputs, a.out, a.name)
    print((Path(a.out) / f"{a.name}.md").read_text())
    return 0 if s["rows"] else 1


def bandwidth_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench bandwidth")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = measure_bandwidth(int(a.gib * (1 << 30)), a.iters, a.device)
    text = json.dumps(res)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {
        "run": run_main,
        "client": client_main,
        "summary": summary_main,
        "bandwidth": bandwidth_main,
    }
    if not argv or argv[0] not in cmds:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return cmds[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
