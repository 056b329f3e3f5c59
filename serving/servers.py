"""Server lifecycle for ``serving.serve_check`` and
``benchmarks.serve_bench``: the speculative presets, the ``vllm serve``
command line of one server, its launch (own process group, own port, own
log), the wait for ``/health``, and the stop (SIGTERM to the group, SIGKILL
after a grace); start-up facts and log tails for the reports."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import CheckError

PRESETS: dict[str, dict | None] = {
    "none": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 64,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 10,
    },
    # the fork only: each request verifies as many of its up to 64 drafts as
    # its observed acceptance is worth (draft_length_policy; V1 runner)
    "ngram-acceptance": {
        "method": "ngram",
        "num_speculative_tokens": 64,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 10,
        "draft_length_policy": "acceptance",
    },
    "ngram8": {
        "method": "ngram",
        "num_speculative_tokens": 8,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 10,
    },
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
    "mtp1": {"method": "mtp", "num_speculative_tokens": 1},
}


# what a Qwen3.5 checkpoint needs on the GPU hosts (harness.equivalence's
# engine_kwargs, as command-line flags)
QWEN35_ENGINE_ARGS = (
    "--gdn-prefill-backend triton --language-model-only "
    '--limit-mm-per-prompt \'{"image": 0, "video": 0}\''
)


def time_left(deadline: float, floor: float = 1.0) -> float | None:
    """Seconds to a ``time.monotonic()`` deadline (at least ``floor``), or
    None (wait without a limit) when there is no deadline (``math.inf``)."""
    if math.isinf(deadline):
        return None
    return max(floor, deadline - time.monotonic())


def name_values(items, what: str) -> dict[str, str]:
    """``["NAME=VALUE", ...]`` (repeated options such as ``--server``) as a
    dict; CheckError names the option of an item without ``=``."""
    out = {}
    for it in items:
        if "=" not in it:
            raise CheckError(f"{what} {it!r}: expected NAME=VALUE")
        k, v = it.split("=", 1)
        out[k.strip()] = v
    return out


def parse_spec(text: str) -> dict | None:
    text = text.strip()
    if text in PRESETS:
        return PRESETS[text]
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckError(
            f"speculative config {text!r}: not a preset "
            f"({', '.join(PRESETS)}) nor JSON: {e}"
        ) from None
    if spec is not None and not isinstance(spec, dict):
        raise CheckError(f"speculative config {text!r} is not a JSON object")
    return spec


@dataclass
class ServerSpec:
    name: str
    spec: dict | None
    url: str = ""
    port: int = 0
    extra: list[str] = field(default_factory=list)
    cmd: str | None = None  # overrides --vllm-cmd for this server
    control: bool = False  # expected to fail (a negative control)
    attached: bool = False
    proc: subprocess.Popen | None = None
    log: str = ""
    started: float = 0.0
    ready_s: float | None = None
    client_s: float | None = None
    exit_code: int | None = None
    version: str | None = None


def server_specs(a) -> list[ServerSpec]:
    """The servers of ``--server NAME=SPEC`` (the reference first), with
    their ``--server-args NAME=ARGS``."""
    servers = [
        ServerSpec(name, parse_spec(s))
        for name, s in name_values(a.server, "--server").items()
    ]
    by_name = {s.name: s for s in servers}
    for name, extra in name_values(a.server_args, "--server-args").items():
        if name not in by_name:
            raise CheckError(f"--server-args for unknown server {name!r}")
        by_name[name].extra = shlex.split(extra)
    return servers


def default_vllm_cmd() -> str:
    """The command that takes ``serve MODEL ...``: ``vllm`` on PATH, else
    this Python's ``-m vllm.entrypoints.cli.main``."""
    exe = shutil.which("vllm")
    if exe:
        return shlex.quote(exe)
    return f"{shlex.quote(sys.executable)} -m vllm.entrypoints.cli.main"


def free_port(start: int) -> int:
    port = start
    while port < start + 1000:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                port += 1
    raise CheckError(f"no free port from {start}")


def server_command(a, srv: ServerSpec) -> list[str]:
    cmd = shlex.split(srv.cmd or a.vllm_cmd) + [
        "serve",
        a.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(srv.port),
        "--served-model-name",
        a.served_name,
        "--seed",
        "0",
        "--max-model-len",
        str(a.max_model_len),
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--gpu-memory-utilization",
        str(a.gpu_mem),
    ]
    if a.kv_bytes:
        cmd += ["--kv-cache-memory-bytes", str(int(float(a.kv_bytes)))]
    cmd += shlex.split(a.engine_args or "")
    cmd += srv.extra
    if srv.spec is not None:
        cmd += ["--speculative-config", json.dumps(srv.spec)]
    return cmd


def add_server_args(
    ap: argparse.ArgumentParser,
    *,
    port: int,
    cache_root: str,
    gpu_mem: float,
    engine_args: str,
) -> None:
    """The `vllm serve` settings server_command and launch read (shared
    with benchmarks/serve_bench.py), with the caller's defaults."""
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument(
        "--cache-root",
        default=cache_root,
        help="VLLM_CACHE_ROOT per server under this ('' to share the default)",
    )
    ap.add_argument("--served-name", default="model")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--gpu-mem",
        type=float,
        default=gpu_mem,
        help="--gpu-memory-utilization of each server (checked at start)",
    )
    ap.add_argument(
        "--kv-bytes",
        default="4e9",
        help="--kv-cache-memory-bytes of each server ('' to profile)",
    )
    ap.add_argument(
        "--engine-args",
        default=engine_args,
        help="vllm serve flags for every server",
    )


def launch(a, srv: ServerSpec, logs: Path) -> None:
    srv.port = free_port(a.port)
    a.port = srv.port + 1
    srv.url = f"http://127.0.0.1:{srv.port}"
    srv.log = str(logs / f"{srv.name}.log")
    cmd = server_command(a, srv)
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if a.cache_root:
        # one compile cache per server: servers that start together would
        # otherwise compile the same graphs into the same directory
        env["VLLM_CACHE_ROOT"] = str(Path(a.cache_root) / srv.name)
    with open(srv.log, "w") as fh:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        srv.proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    srv.started = time.monotonic()


async def wait_ready(servers, deadline: float, log=print) -> list[str]:
    """Poll ``/health`` until every server answers 200; the names of those
    that died or were not ready by ``deadline`` (``math.inf``: wait until
    each is healthy or has exited)."""
    import aiohttp

    pending = {s.name: s for s in servers}
    failed: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as sess:
        while pending and time.monotonic() < deadline:
            for name, s in list(pending.items()):
                if s.proc is not None and s.proc.poll() is not None:
                    log(f"[serve_check] {name} exited with {s.proc.returncode}")
                    failed.append(name)
                    del pending[name]
                    continue
                try:
                    async with sess.get(s.url + "/health") as r:
                        if r.status == 200:
                            s.ready_s = round(time.monotonic() - s.started, 1)
                            log(f"[serve_check] {name} ready after {s.ready_s} s")
                            with contextlib.suppress(Exception):
                                async with sess.get(s.url + "/version") as v:
                                    s.version = (await v.json()).get("version")
                            del pending[name]
                except Exception:  # noqa: BLE001 - not up yet
                    pass
            if pending:
                await asyncio.sleep(0.25)
    for name in pending:
        log(f"[serve_check] {name} not ready by the deadline")
        failed.append(name)
    return failed


def stop(servers, grace: float = 20.0) -> None:
    """SIGTERM to each launched server's process group, SIGKILL after
    ``grace`` seconds."""
    live = [s for s in servers if s.proc is not None and s.proc.poll() is None]
    for s in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(s.proc.pid, signal.SIGTERM)
    end = time.monotonic() + grace
    for s in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(timeout=max(0.1, end - time.monotonic()))
    for s in servers:
        if s.proc is None:
            continue
        # the group may hold children (the engine core) after the leader left
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(s.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(timeout=5)
        s.exit_code = s.proc.returncode


def log_tail(path: str, n: int = 30) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keep = [ln for ln in lines if not re.search(r"\] (GET|POST) |Uvicorn|HTTP/1.1", ln)]
    return "\n".join(keep[-n:])


_FACTS = re.compile(
    r"GPU KV cache size: .*|Maximum concurrency for .*|"
    r"Loading weights took .*|Model loading took .*|"
    r"init engine .* took .*|Available KV cache memory: .*"
)


def log_facts(path: str) -> list[str]:
    """Start-up facts from a vLLM server log (KV cache size, maximum
    concurrency, load and init times)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return [m.group(0).strip() for m in _FACTS.finditer(text)][:12]
