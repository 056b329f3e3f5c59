"""``vllm serve`` under a long, mixed load, and killed in the middle of one:
the soak and fault checks of a speculative server (issue: reliability).

    python -m serving.soak --model DIR --out OUT --server ref=none \\
        --server cand=ngram --clients 256 --duration 300 --deadline 560
    python -m serving.soak ... --requests 2000            # stop by count
    python -m serving.soak ... --fault kill-engine --kill-after 400

In order (the servers through ``serving.servers``, as ``serve_check``):

1. launches the candidate, waits for ``/health``, scrapes ``/metrics``, then
   launches the reference (first ``--server``, normally without
   speculation), which starts while the load runs (servers that start
   together compete for the host's cores while they compile);
2. **load** on the candidate: ``--clients`` concurrent clients, each sending
   one request after another until ``--duration`` seconds or ``--requests``
   requests have started. Request ``i`` is the prompt set's request ``i``
   (heterogeneous prompts, completions and chat, streamed and not) with a
   feature by ``i % 10``: 3 a stop string, 5 two sampled completions
   (``n=2``, seeded), 7 structured output (a regex, with the fast-apply
   prompts), 9 a client that disconnects after the first streamed chunk,
   and with ``--long-tokens N`` 1 a long answer (``N`` tokens,
   ``ignore_eos``: requests that keep growing while others are admitted,
   so that a small pool preempts); the rest greedy as they are. Every
   ``--sample-s`` seconds it samples the candidate's host memory (RSS of
   the server and its processes, psutil), its GPU memory (``nvidia-smi``,
   where there is one), the requests done and the candidate's own gauges
   (``/metrics``: requests running and waiting, KV cache use, preemptions so
   far; each sample a log line). Once the reference is up, each greedy
   request the candidate completed goes to it as well, once per distinct
   request (``--no-ref-during-load``: only in step 5);
3. with ``--fault kill-engine``: after ``--kill-after`` requests have
   completed, SIGKILLs the candidate's engine-core process (a process under
   it whose command line names ``EngineCore``), waits until every request
   in flight has ended and the API server is no longer healthy (each wait
   bounded by ``--fault-timeout``, a hang guard), launches the candidate
   again and sends it ``--replay`` greedy requests that completed before the
   kill: each must come back identical;
4. with ``--bad-requests``, sends the loaded candidate the malformed
   requests of ``serving.bad_requests`` (each must get a 4xx;
   ``OUT/bad_requests.md``); then checks the candidate is alive
   (``/health``), scrapes ``/metrics`` again
   (accepted draft tokens <= draft tokens; preemptions, which
   ``--expect-preemption`` requires);
5. replays on the reference every distinct greedy request that completed
   and that it has not answered during the load (stop strings and
   structured output included; each answer compared with every copy of its
   request) and compares, margin-aware
   as ``serve_check`` does (teacher-forced by the reference, with a tie
   margin of twice the noise measured on the reference's own answers); a
   structured output request is judged at its first difference only, from
   the reference run's own top-k (teacher forcing does not see the grammar);
   checks each ``n=2`` request returned two finished choices;
6. writes ``OUT/soak.json`` (every request's outcome, the samples, the
   metrics, the verdicts), ``OUT/soak.md`` and ``OUT/soak.png`` (memory and
   requests over time, matplotlib), stops the servers.

Outcomes: ``ok``; ``error`` (an explicit error: an HTTP error status or an
error object in the stream); ``disconnected`` (the client's own doing);
``lost`` (no response and no error: a reset connection, a stream cut
without a finish reason). Verdict ``PASS`` when no request is lost, no
greedy request diverged (ties allowed), every ``n=2`` request is whole,
the candidate is alive at the end, the counters are consistent, host
memory is flat (the mean of the last third of the samples within
``--mem-tolerance`` of the middle third's; judged with 6 samples or more)
and, with the fault, the restarted server answers identically (a replayed
request that does not is judged against the reference, margin-aware: the
other side of a near-tie passes). Without a fault, explicit errors also
fail the soak.

Why by hand: ``vllm bench serve`` measures speed with one kind of request
and neither disconnects, compares outputs, nor kills the engine; this
reuses ``serve_check``'s parts (launch, client, metrics, comparison),
psutil for the server's processes and prometheus_client's parser for
``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from . import CheckError
from .client import send
from .compare import TIE_MARGIN, compare, finalize, rescore
from .metrics import metrics_delta, parse_metrics
from .prompts import Request, build_requests, payload
from .servers import (
    PRESETS,
    QWEN35_ENGINE_ARGS,
    ServerSpec,
    add_server_args,
    default_vllm_cmd,
    launch,
    log_tail,
    server_specs,
    stop,
    wait_ready,
)

FEATURES = {3: "stop", 5: "n2", 7: "regex", 9: "disconnect"}
# with --long-tokens (serving/gpu_soak.sh's n-gram soak): the fast-apply
# answers end after about 100 tokens, within one 208-token block of the
# n-gram k=64 align-mode layout: running requests barely grow, and the
# scheduler admits only what fits, so without growth it never preempts
LONG_INDEX = 1
# the fast-apply fixture's words: t<id>; its answers stop at " t16" now and
# then (1.5 % of answer tokens)
STOP_TEXT = {"fastapply": " t16", "text": "\n\n"}


@dataclass
class SoakRequest:
    req: Request
    feature: str  # plain | stop | n2 | regex | disconnect | long

    @property
    def greedy(self) -> bool:
        return self.feature not in ("n2", "disconnect")


def soak_request(
    pool: list[Request], i: int, prompts: str, long_tokens: int = 0
) -> SoakRequest:
    base = pool[i % len(pool)]
    feature = FEATURES.get(i % 10, "plain")
    if long_tokens and i % 10 == LONG_INDEX:
        feature = "long"
    if feature == "regex" and prompts != "fastapply":
        feature = "plain"  # the regex is written for the fixture's words
    req = replace(base, idx=i)
    if feature == "stop":
        req = replace(req, stop=[STOP_TEXT[prompts]])
    if feature == "disconnect":
        req = replace(req, stream=True)
    if feature == "n2":
        req = replace(req, stream=False)
    if feature == "long":
        req = replace(req, max_tokens=long_tokens)
    return SoakRequest(req, feature)


def soak_payload(sr: SoakRequest, model: str, logprobs: bool = False) -> dict:
    body = payload(sr.req, model, logprobs)
    if sr.feature == "n2":
        body.update(n=2, temperature=1.0, seed=sr.req.idx)
    if sr.feature == "regex":
        from harness.equivalence import REGEX

        body["structured_outputs"] = {"regex": REGEX}
    if sr.feature == "long":
        body["ignore_eos"] = True
    return body


def outcome(res: dict) -> str:
    """ok | error (explicit) | lost (no response, no error)."""
    err = res.get("error")
    if err is None:
        return "ok"
    if err.startswith(("HTTP ", "stream error")):
        return "error"
    return "lost"


async def send_disconnecting(session, url: str, sr: SoakRequest, body: dict) -> dict:
    """A streamed request whose client goes away after the first chunk."""
    import aiohttp

    path = "/v1/chat/completions" if sr.req.endpoint == "chat" else "/v1/completions"
    res = {"error": None, "disconnected": False, "chunks": 0}
    try:
        async with session.post(url + path, json=body) as r:
            if r.status != 200:
                res["error"] = f"HTTP {r.status}: {(await r.text())[:300]}"
                return res
            async for _ in r.content.iter_any():
                res["chunks"] += 1
                res["disconnected"] = True
                break  # leaving the block closes the connection
    except aiohttp.ClientError as e:
        res["error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def n2_whole(raw: dict) -> bool:
    """Two choices, each with a finish reason."""
    choices = raw.get("choices") or []
    return len(choices) == 2 and all(c.get("finish_reason") for c in choices)


async def send_n2(session, url: str, sr: SoakRequest, body: dict) -> dict:
    path = "/v1/chat/completions" if sr.req.endpoint == "chat" else "/v1/completions"
    res = {"error": None, "whole": False}
    try:
        async with session.post(url + path, json=body) as r:
            if r.status != 200:
                res["error"] = f"HTTP {r.status}: {(await r.text())[:300]}"
                return res
            res["whole"] = n2_whole(await r.json())
    except Exception as e:  # noqa: BLE001 - recorded per request
        res["error"] = f"{type(e).__name__}: {e}"[:300]
    return res


# ---------------------------------------------------------------------------
# the candidate's processes


def server_processes(pid: int) -> list:
    """A server and every process under it (psutil; the engine core is one
    of them)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def server_pids(pid: int) -> list[int]:
    return [p.pid for p in server_processes(pid)]


def engine_pids(pid: int) -> list[int]:
    """The engine-core processes under a server: vLLM names them
    ``VLLM::EngineCore...`` (process title)."""
    import psutil

    out = []
    for p in server_processes(pid)[1:]:
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in " ".join(p.cmdline()):
                out.append(p.pid)
    return out


def rss_mib(pid: int) -> float:
    import psutil

    total = 0
    for p in server_processes(pid):
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return round(total / (1 << 20), 1)


def gpu_mib(pids: list[int]) -> float | None:
    """GPU memory of the given processes (nvidia-smi), None without one."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        query = [
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ]
        out = subprocess.run(
            [exe, *query], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = 0.0
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            with contextlib.suppress(ValueError):
                used += float(parts[1])
    return used


def counter(text: str, name: str) -> float:
    """A Prometheus counter summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        smp.value
        for fam in text_string_to_metric_families(text or "")
        for smp in fam.samples
        if smp.name == name
    )


# /metrics series sampled during the load: {sample key: (metric, kind)}
GAUGES = {
    "preemptions": "vllm:num_preemptions_total",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
}


async def load_gauges(session, url: str) -> dict:
    """The candidate's ``GAUGES`` now (``{}`` when /metrics does not answer:
    a killed engine)."""
    status, text = await get_text(session, url + "/metrics")
    if status != 200:
        return {}
    return {k: round(counter(text, name), 4) for k, name in GAUGES.items()}


async def get_text(session, url: str) -> tuple[int, str]:
    try:
        async with session.get(url) as r:
            return r.status, await r.text()
    except Exception:  # noqa: BLE001 - a dead server
        return 0, ""


def memory_flat(samples: list[dict], tolerance: float) -> dict:
    """Host memory: the last third's mean against the middle third's (the
    first third is warm-up)."""
    rss = [s["rss_mib"] for s in samples if s.get("rss_mib")]
    if len(rss) < 6:
        return {"judged": False, "samples": len(rss)}
    third = len(rss) // 3
    mid = sum(rss[third : 2 * third]) / third
    last = sum(rss[-third:]) / third
    growth = (last - mid) / mid if mid else 0.0
    return {
        "judged": True,
        "samples": len(rss),
        "middle_mib": round(mid, 1),
        "last_mib": round(last, 1),
        "growth": round(growth, 4),
        "flat": growth <= tolerance,
    }


# ---------------------------------------------------------------------------
# the load


async def run_load(
    a,
    cand: ServerSpec,
    pool,
    log,
    deadline: float = math.inf,
    ref: ServerSpec | None = None,
    ref_answers: dict | None = None,
) -> dict:
    """Clients against the candidate until the duration or request count;
    the fault in the middle where asked. No request starts later than
    ``--check-reserve`` seconds before the deadline: the checks after the
    load need that time (``load_s`` in the report says how long it ran).

    With ``ref`` and ``ref_answers`` (a dict), the reference answers the
    greedy requests while the load runs: once it is up, each greedy request
    the candidate completed is sent to it, once per distinct body
    (``ref_key``), at most ``--ref-concurrency`` at a time, its answer kept
    in ``ref_answers``. After the load only what it has not answered yet is
    replayed: a replay of every distinct request after five minutes of load
    (long answers of thousands of tokens among them) outlasted the time
    left before the deadline."""
    import aiohttp

    t0 = time.monotonic()
    end = t0 + a.duration if a.duration > 0 else math.inf
    end = min(end, deadline - a.check_reserve)
    started = done = 0
    results: dict[int, dict] = {}
    samples: list[dict] = []
    in_flight: set[int] = set()
    fault: dict = {}
    killed = asyncio.Event()
    stop_load = asyncio.Event()

    def more() -> bool:
        # no new request once the engine is killed: those in flight drain
        if stop_load.is_set() or killed.is_set() or time.monotonic() >= end:
            return False
        return a.requests <= 0 or started < a.requests

    async def sample(session=None):
        pids = server_pids(cand.proc.pid) if cand.proc else []
        smp = {
            "t": round(time.monotonic() - t0, 2),
            "rss_mib": rss_mib(cand.proc.pid) if cand.proc else None,
            "gpu_mib": gpu_mib(pids),
            "done": done,
            "in_flight": len(in_flight),
        }
        if session is not None:
            # the scheduler's own gauges and the preemption counter, so that
            # a run cut before its summary still shows them (in its log)
            smp.update(await load_gauges(session, cand.url))
            log(
                f"[soak] t={smp['t']:.0f}s done={done} in_flight={len(in_flight)}"
                + "".join(f" {k}={smp[k]}" for k in GAUGES if k in smp)
            )
        samples.append(smp)

    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=a.request_timeout or None)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def client():
            nonlocal started, done
            while more():
                i = started
                started += 1
                sr = soak_request(pool, i, a.prompts, a.long_tokens)
                body = soak_payload(sr, a.served_name)
                in_flight.add(i)
                if sr.feature == "disconnect":
                    res = await send_disconnecting(session, cand.url, sr, body)
                elif sr.feature == "n2":
                    res = await send_n2(session, cand.url, sr, body)
                else:
                    limit = a.request_timeout or None
                    res = await send(session, cand.url, sr.req, body, limit)
                in_flight.discard(i)
                res["after_kill"] = killed.is_set()
                results[i] = res
                if (
                    feeding
                    and sr.greedy
                    and outcome(res) == "ok"
                    and not res.get("disconnected")
                ):
                    ref_queue.put_nowait(sr)
                done += 1
                if a.fault and not killed.is_set() and done >= a.kill_after:
                    killed.set()

        ref_queue: asyncio.Queue = asyncio.Queue()
        ref_sent: set[str] = set()

        async def ref_feeder():
            # the reference's start overlaps the load: wait for it
            while (await get_text(session, ref.url + "/health"))[0] != 200:
                await asyncio.sleep(2)
            log(f"[soak] {ref.name} up after {time.monotonic() - t0:.0f} s "
                "of load: answering the greedy requests as they complete")  # fmt: skip
            sem = asyncio.Semaphore(a.ref_concurrency)
            pending: set = set()

            async def one(key: str, sr: SoakRequest):
                async with sem:
                    res = await send(
                        session, ref.url, sr.req,
                        soak_payload(sr, a.served_name, True), None,
                    )  # fmt: skip
                if res.get("error") is None:
                    ref_answers[key] = res
                else:  # replayed again after the load
                    ref_sent.discard(key)

            while True:
                sr = await ref_queue.get()
                if sr is None:
                    break
                key = ref_key(sr, a.served_name)
                if key in ref_sent:
                    continue
                ref_sent.add(key)
                t = asyncio.create_task(one(key, sr))
                pending.add(t)
                t.add_done_callback(pending.discard)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

        async def sampler():
            await sample(session)
            while not stop_load.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop_load.wait(), a.sample_s)
                await sample(session)

        async def faulter():
            await killed.wait()
            fault["at_load_s"] = round(time.monotonic() - t0, 2)
            fault.update(await kill_engine(a, cand, session, in_flight, log))
            stop_load.set()

        async def release():
            # after the fault's waits: clients still waiting on a request
            # that never ends are stopped (the request counts as lost)
            await stop_load.wait()
            for t in tasks:
                if not t.done():
                    t.cancel()

        feeding = ref is not None and ref_answers is not None
        feeder = asyncio.create_task(ref_feeder()) if feeding else None
        tasks = [asyncio.create_task(client()) for _ in range(a.clients)]
        side = [asyncio.create_task(sampler()), asyncio.create_task(release())]
        if a.fault:
            side.append(asyncio.create_task(faulter()))
        await asyncio.gather(*tasks, return_exceptions=True)
        for i in range(started):
            if i not in results:
                results[i] = {"error": "no answer: still waiting when the load "
                              "stopped after the fault's hang guard"}  # fmt: skip
        if a.fault and not killed.is_set():
            fault["error"] = f"only {done} requests completed; none killed"
        if killed.is_set():
            await side[-1]  # the fault's waits end on their own (hang guard)
        stop_load.set()
        for t in side:
            if not t.done():
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await sample(session)
        if feeder is not None:
            # a reference that is up answers what is queued before the load
            # ends; one not up yet is not waited for here (step 5 replays)
            ref_queue.put_nowait(None)
            if (await get_text(session, ref.url + "/health"))[0] == 200:
                await feeder
            else:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder
    return {
        "results": results,
        "samples": samples,
        "fault": fault,
        "load_s": round(time.monotonic() - t0, 1),
        "started": started,
    }


async def kill_engine(a, cand: ServerSpec, session, in_flight: set, log) -> dict:
    """SIGKILL the engine core; then wait (bounded) for the requests in
    flight to end and the API server to stop being healthy."""
    pids = engine_pids(cand.proc.pid)
    out: dict = {"engine_pids": pids, "in_flight_at_kill": len(in_flight)}
    if not pids:
        out["error"] = "no EngineCore process under the candidate"
        return out
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    t_kill = time.monotonic()
    log(f"[soak] killed engine core {pids}; {len(in_flight)} requests in flight")
    guard = t_kill + a.fault_timeout
    status = 200
    while in_flight and time.monotonic() < guard:
        await asyncio.sleep(0.1)
    out["in_flight_ended"] = not in_flight
    out["in_flight_end_s"] = round(time.monotonic() - t_kill, 2)
    if in_flight:
        out["hung"] = sorted(in_flight)
    while time.monotonic() < guard:
        status, _ = await get_text(session, cand.url + "/health")
        if status != 200:
            break
        await asyncio.sleep(0.2)
    out["unhealthy_after_s"] = round(time.monotonic() - t_kill, 2)
    out["health_failed"] = status != 200
    return out


# ---------------------------------------------------------------------------
# checks after the load


async def replay(url: str, model: str, items, concurrency: int, logprobs: bool):
    """Send the given soak requests again (greedy ones: deterministic)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(sr):
            async with sem:
                return await send(
                    s, url, sr.req, soak_payload(sr, model, logprobs), None
                )

        return await asyncio.gather(*(one(sr) for sr in items))


def ref_key(sr: SoakRequest, model: str) -> str:
    """What the reference is sent for ``sr`` (its body, logprobs asked
    for): requests with equal keys have one reference answer."""
    return json.dumps(soak_payload(sr, model, True), sort_keys=True)


def distinct(items, model: str) -> tuple[list, list[int]]:
    """The distinct requests among ``items`` (by the body the reference is
    sent) and, for each item, the position of its request among them."""
    first: dict[str, int] = {}
    uniq, slot = [], []
    for sr in items:
        key = ref_key(sr, model)
        if key not in first:
            first[key] = len(uniq)
            uniq.append(sr)
        slot.append(first[key])
    return uniq, slot


def judge_restart(fault, greedy, items, ref_res, a, ref_url, deadline):
    """Rows (serving.compare) of the replayed requests whose answer after
    the restart differs from the one before the kill, judged against the
    reference server's answers: teacher-forced by the reference, structured
    output at its first difference."""
    pos_of = {i: p for p, i in enumerate(greedy)}
    # a differing answer with no reference answer to judge it by is an error
    unjudged = [
        {"idx": i, "status": "error", "error": "no reference answer"}
        for i in fault["restart_results"]
        if i not in pos_of
    ]
    again = [(i, g) for i, g in fault["restart_results"].items() if i in pos_of]
    if not again:
        return unjudged
    reqs = [items[pos_of[i]].req for i, _ in again]
    refs = [ref_res[pos_of[i]] for i, _ in again]
    cands = [g for _, g in again]
    rows = compare(reqs, refs, cands, a.tie_margin)
    for pos, (row, (i, _)) in enumerate(zip(rows, again, strict=True)):
        row["idx_pos"] = pos
        row["feature"] = items[pos_of[i]].feature
    judged = rescore_apart(ref_url, a.served_name, rows, refs, cands, a, deadline)
    finalize_apart(rows, judged)
    return rows + unjudged


def rescore_apart(url, model, rows, refs, cands, a, deadline) -> dict:
    """``serving.compare.rescore`` of the rows the reference can teacher-force
    (structured output cannot: the grammar is not in a prefill), the long
    answers (ignore_eos) apart: past the fixture's end of text its
    distributions are flat, and their noise would widen every other answer's
    margin. Returns the plain rows' judgement, the long rows' under
    ``"long"``."""
    plain = [r for r in rows if r["feature"] not in ("regex", "long")]
    judged = asyncio.run(
        rescore(url, model, plain, refs, cands, a.tie_margin, deadline)
    )
    long_rows = [r for r in rows if r["feature"] == "long"]
    if long_rows:
        judged["long"] = asyncio.run(
            rescore(url, model, long_rows, refs, cands, a.tie_margin, deadline)
        )
    return judged


def finalize_apart(rows: list[dict], judged: dict) -> None:
    """``serving.compare.finalize`` with the margin each row was measured
    under by ``rescore_apart``: a long answer whose teacher-forced rescoring
    did not come back is judged at its first difference with the long
    answers' margin, not the plain answers'."""
    long_rows = [r for r in rows if r["feature"] == "long"]
    finalize([r for r in rows if r["feature"] != "long"], judged["margin"])
    if long_rows:
        finalize(long_rows, judged.get("long", judged)["margin"])


def judge(rows: list[dict]) -> dict:
    return {
        s: sum(r["status"] == s for r in rows)
        for s in ("match", "tie", "diverged", "error")
    }


def plot(samples: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, ax = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax[0].plot(t, [s.get("rss_mib") or 0 for s in samples], label="host RSS (MiB)")
    gpu = [s.get("gpu_mib") for s in samples]
    if any(g is not None for g in gpu):
        ax[0].plot(t, [g or 0 for g in gpu], label="GPU memory (MiB)")
    ax[0].set_ylabel("MiB")
    ax[0].legend()
    ax[0].set_title(title)
    ax[1].plot(t, [s["done"] for s in samples], label="requests done")
    ax[1].plot(t, [s["in_flight"] for s in samples], label="in flight")
    if any("running" in s for s in samples):
        ax[1].plot(t, [s.get("running", 0) for s in samples], label="running (server)")
    ax[1].set_xlabel("seconds")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python -m serving.soak",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/soak")
    ap.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="reference then candidate: SPEC none | "
        + " | ".join(p for p in PRESETS if p != "none")
        + " | JSON (default: ref=none cand=ngram)",
    )
    ap.add_argument("--server-args", action="append", default=[], metavar="NAME=ARGS")
    ap.add_argument("--prompts", default="fastapply", choices=["fastapply", "text"])
    ap.add_argument("--pool", type=int, default=512, help="distinct prompts")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--duration", type=float, default=300.0, help="0: --requests")
    ap.add_argument("--requests", type=int, default=0, help="0: --duration")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--long-tokens",
        type=int,
        default=0,
        help="every tenth request (i %% 10 == 1) asks for this many tokens with "
        "ignore_eos (0: none)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="hang guard per request (0: none); a request past it counts as lost",
    )
    ap.add_argument("--fault", choices=["kill-engine"], default=None)
    ap.add_argument("--kill-after", type=int, default=200)
    ap.add_argument(
        "--fault-timeout",
        type=float,
        default=120.0,
        help="hang guard of each wait after the kill",
    )
    ap.add_argument("--replay", type=int, default=64)
    ap.add_argument("--ref-concurrency", type=int, default=64)
    ap.add_argument(
        "--no-ref-during-load",
        dest="ref_during_load",
        action="store_false",
        help="the reference answers the greedy requests only after the load "
        "(default: while it runs, as they complete)",
    )
    ap.add_argument(
        "--bad-requests",
        action="store_true",
        help="after the load, send the candidate serving.bad_requests' malformed "
        "requests (each must get a 4xx; bad_requests.md); the alive check follows",
    )
    ap.add_argument("--expect-preemption", action="store_true")
    ap.add_argument("--mem-tolerance", type=float, default=0.05)
    ap.add_argument("--tie-margin", type=float, default=TIE_MARGIN)
    ap.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="seconds from this process's start by which everything ends; 0: none",
    )
    ap.add_argument(
        "--check-reserve",
        type=float,
        default=120.0,
        help="seconds before the deadline at which the load stops starting "
        "requests (the reference replay and the judging follow)",
    )
    ap.add_argument("--vllm-cmd", default=None)
    add_server_args(
        ap,
        port=8300,
        cache_root="/tmp/soak-cache",
        gpu_mem=0.3,
        engine_args=QWEN35_ENGINE_ARGS,
    )
    a = ap.parse_args(argv)
    if not a.server:
        a.server = ["ref=none", "cand=ngram"]
    if a.duration <= 0 and a.requests <= 0:
        ap.error("give --duration or --requests")
    if a.vllm_cmd is None:
        a.vllm_cmd = default_vllm_cmd()
    return a


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    try:
        a = parse_args(argv)
        servers = server_specs(a)
        if len(servers) != 2:
            raise CheckError("need exactly a reference and a candidate (--server)")
        ref, cand = servers
        pool = build_requests(a.prompts, a.pool, a.seed, a.max_tokens)
    except (CheckError, KeyError) as e:
        print(f"soak: error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    # the deadline counts from this process's start, imports included, so
    # that a caller's hang guard a little past it never cuts the checks off
    import psutil

    started_ago = max(0.0, time.time() - psutil.Process().create_time())
    deadline = t_start - started_ago + a.deadline if a.deadline > 0 else math.inf

    def log(msg: str) -> None:
        print(msg, flush=True)

    def on_signal(signum, frame):
        stop([ref, cand], grace=5)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    report: dict = {"schema": "hsfork-soak/1", "config": vars(a).copy()}
    try:
        # the candidate starts alone (servers that start together compete
        # for the host's cores while they compile); the reference, needed
        # only after the load, starts when the load does
        launch(a, cand, out / "logs")
        log(f"[soak] launched {cand.name} on {cand.url}")
        if asyncio.run(wait_ready([cand], deadline, log)):
            raise CheckError(f"not ready: {cand.name}\n" + log_tail(cand.log))
        launch(a, ref, out / "logs")
        log(f"[soak] launched {ref.name} on {ref.url}")
        before = asyncio.run(_metrics_text(cand.url))
        ref_answers: dict[str, dict] = {}
        load = asyncio.run(
            run_load(
                a,
                cand,
                pool,
                log,
                deadline,
                ref=ref if a.ref_during_load else None,
                ref_answers=ref_answers,
            )  # fmt: skip
        )
        results = load["results"]
        fault = load["fault"]
        if a.fault and fault.get("engine_pids"):
            # the restarted candidate answers greedy requests of before the
            # kill as before
            stop([cand], grace=10)
            launch(a, cand, out / "logs")
            again = asyncio.run(wait_ready([cand], deadline, log))
            fault["restarted"] = not again
            before = ("", None)  # the restarted server's counters start at 0
            early = [
                i
                for i in sorted(results)
                if not results[i].get("after_kill")
                and outcome(results[i]) == "ok"
                and soak_request(pool, i, a.prompts, a.long_tokens).greedy
            ][: a.replay]
            if not again and early:
                items = [soak_request(pool, i, a.prompts, a.long_tokens) for i in early]
                got = asyncio.run(
                    replay(cand.url, a.served_name, items, a.ref_concurrency, False)
                )
                same = sum(
                    g.get("error") is None
                    and g["token_ids"] == results[i]["token_ids"]
                    and g["text"] == results[i]["text"]
                    for i, g in zip(early, got, strict=True)
                )
                fault["replayed"] = len(early)
                fault["identical_after_restart"] = same
                fault["restart_results"] = {
                    i: g
                    for i, g in zip(early, got, strict=True)
                    if g.get("error") is not None
                    or g["token_ids"] != results[i]["token_ids"]
                    or g["text"] != results[i]["text"]
                }
        bad = None
        if a.bad_requests:
            from serving import bad_requests

            bad = asyncio.run(
                bad_requests.run(
                    cand.url, a.served_name, a.max_model_len, a.fault_timeout
                )
            )
            (out / "bad_requests.md").write_text(bad_requests.markdown(bad))
            log(f"[soak] malformed requests: {bad['verdict']}")
        status, text = asyncio.run(_status_metrics(cand.url))
        alive = status == 200
        after = parse_metrics(text) if text else None
        spec = metrics_delta(before[1], after)
        preemptions = counter(text, "vllm:num_preemptions_total") - counter(
            before[0], "vllm:num_preemptions_total"
        )
        # outcomes
        kinds: dict[str, int] = {}
        per_feature: dict[str, dict[str, int]] = {}
        for i, res in results.items():
            sr = soak_request(pool, i, a.prompts, a.long_tokens)
            o = "disconnected" if res.get("disconnected") else outcome(res)
            kinds[o] = kinds.get(o, 0) + 1
            f = per_feature.setdefault(sr.feature, {})
            f[o] = f.get(o, 0) + 1
        n2_bad = [
            i
            for i, res in results.items()
            if soak_request(pool, i, a.prompts, a.long_tokens).feature == "n2"
            and outcome(res) == "ok"
            and not res.get("whole")
        ]
        # the reference: every greedy request that completed
        greedy = [
            i
            for i in sorted(results)
            if outcome(results[i]) == "ok"
            and not results[i].get("disconnected")
            and soak_request(pool, i, a.prompts, a.long_tokens).greedy
        ]
        items = [soak_request(pool, i, a.prompts, a.long_tokens) for i in greedy]
        if asyncio.run(wait_ready([ref], deadline, log)):
            raise CheckError(f"not ready: {ref.name}\n" + log_tail(ref.log))
        # the load draws its requests from a pool of prompts: a greedy
        # request sent many times has one reference answer
        uniq, slot = distinct(items, a.served_name)
        keys = [ref_key(sr, a.served_name) for sr in uniq]
        rest = [j for j, k in enumerate(keys) if k not in ref_answers]
        log(
            f"[soak] {len(uniq)} distinct of {len(items)} greedy requests: "
            f"{len(uniq) - len(rest)} answered by {ref.name} during the load, "
            f"replaying {len(rest)}"
        )
        again = asyncio.run(
            replay(
                ref.url,
                a.served_name,
                [uniq[j] for j in rest],
                a.ref_concurrency,
                True,
            )  # fmt: skip
        )
        got = dict(zip(rest, again, strict=True))
        ref_uniq = [
            got[j] if j in got else ref_answers[keys[j]] for j in range(len(uniq))
        ]
        ref_res = [ref_uniq[j] for j in slot]
        cand_res = [results[i] for i in greedy]
        rows = compare([sr.req for sr in items], ref_res, cand_res, a.tie_margin)
        for pos, row in enumerate(rows):
            row["idx_pos"] = pos
            row["feature"] = items[pos].feature
        judged = rescore_apart(
            ref.url, a.served_name, rows, ref_res, cand_res, a, deadline
        )
        # structured output: teacher forcing does not see the grammar, so
        # such a request is judged at its first difference only, from the
        # reference run's own top-k (a tie when the candidate's token is
        # within the measured margin of the reference's; later positions
        # have another context)
        finalize_apart(rows, judged)
        for r in rows:
            if r["feature"] == "regex" and r.get("judged"):
                r["judged"] = "structured output: first difference"
        counts = judge(rows)
        if fault.get("restart_results"):
            # the restarted server against the pre-kill answers: a request
            # that came back otherwise is judged against the reference as
            # the candidate's answers are (a near-tie can go the other way
            # in another batch)
            restart_rows = judge_restart(
                fault, greedy, items, ref_res, a, ref.url, deadline
            )
            fault.pop("restart_results")
            fault["restart_judged"] = judge(restart_rows)
            fault["restart_rows"] = [r for r in restart_rows if r["status"] != "match"]
        # a killed engine frees its memory: judge the samples before the kill
        kill_at = fault.get("at_load_s") if fault.get("engine_pids") else None
        mem = memory_flat(
            [x for x in load["samples"] if kill_at is None or x["t"] < kill_at],
            a.mem_tolerance,
        )
        checks = {
            "no_request_lost": kinds.get("lost", 0) == 0,
            "no_divergence": counts["diverged"] == 0 and counts["error"] == 0,
            "n2_whole": not n2_bad,
            "alive_at_end": alive,
            "accepted_le_drafted": spec is None
            or spec["accepted"] <= spec["draft_tokens"],
        }
        if mem["judged"]:
            checks["memory_flat"] = mem["flat"]
        if a.expect_preemption:
            checks["preempted"] = preemptions > 0
        if bad is not None:
            checks["malformed_requests_4xx"] = bad["verdict"] == "PASS"
        if a.fault:
            checks["engine_killed"] = bool(fault.get("engine_pids"))
            checks["in_flight_ended"] = bool(fault.get("in_flight_ended"))
            checks["health_failed"] = bool(fault.get("health_failed"))
            rj = fault.get("restart_judged") or {}
            checks["restart_identical"] = bool(fault.get("replayed")) and (
                fault.get("identical_after_restart") == fault.get("replayed")
                or (rj.get("diverged", 1) == 0 and rj.get("error", 1) == 0)
            )
        else:
            checks["no_error"] = kinds.get("error", 0) == 0
        verdict = "PASS" if all(checks.values()) else "FAIL"
        report.update(
            verdict=verdict,
            checks=checks,
            started=load["started"],
            load_s=load["load_s"],
            outcomes=kinds,
            per_feature=per_feature,
            n2_incomplete=n2_bad,
            comparison=counts,
            tie_margin=judged,
            compared=len(rows),
            replayed_distinct=len(uniq),
            ref_answered_during_load=len(uniq) - len(rest),
            ref_replayed_after_load=len(rest),
            rows=[r for r in rows if r["status"] != "match"],
            spec_metrics=spec,
            preemptions=preemptions,
            memory=mem,
            samples=load["samples"],
            fault=fault,
            bad_requests=bad,
            results={
                str(i): {
                    "feature": soak_request(pool, i, a.prompts, a.long_tokens).feature,
                    "outcome": "disconnected" if r.get("disconnected") else outcome(r),
                    "error": r.get("error"),
                    "latency_s": r.get("latency_s"),
                    "tokens": len(r.get("token_ids") or []),
                }
                for i, r in sorted(results.items())
            },
        )
        plot(load["samples"], out / "soak.png", f"soak: {cand.name} ({verdict})")
        (out / "soak.md").write_text(markdown(report))
        log((out / "soak.md").read_text())
        return 0 if verdict == "PASS" else 1
    except CheckError as e:
        report.update(verdict="ERROR", error=str(e))
        log(f"soak: {e}")
        return 3
    finally:
        stop([ref, cand])
        report["total_s"] = round(time.monotonic() - t_start, 1)
        (out / "soak.json").write_text(json.dumps(report, indent=1, default=str))


async def _metrics_text(url: str) -> tuple[str, dict | None]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        _, text = await get_text(s, url + "/metrics")
    return text, parse_metrics(text) if text else None


async def _status_metrics(url: str) -> tuple[int, str]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        status, _ = await get_text(s, url + "/health")
        _, text = await get_text(s, url + "/metrics")
    return status, text


def markdown(r: dict) -> str:
    lines = [
        f"# Soak: {r['verdict']}",
        "",
        f"{r['started']} requests in {r['load_s']} s "
        f"({r['config']['clients']} clients); outcomes: {r['outcomes']}.",
        f"Compared with the reference: {r['compared']} greedy requests "
        f"({r.get('replayed_distinct', r['compared'])} distinct ones replayed), "
        f"{r['comparison']}.",
        *(
            [
                f"Tie margin {m['margin']} nats: twice the noise measured on "
                f"{m['measured_on']} reference answers ({m['noise']}), at "
                f"least {m['floor']}."
            ]
            if (m := r.get("tie_margin"))
            else []
        ),
        *(
            [
                f"Long answers (ignore_eos) judged apart: tie margin "
                f"{m['margin']} nats, twice the noise measured on "
                f"{m['measured_on']} of their reference answers ({m['noise']})."
            ]
            if (m := (r.get("tie_margin") or {}).get("long"))
            else []
        ),
        f"Spec-decode counters: {r['spec_metrics']}; preemptions: {r['preemptions']}.",
        f"Host memory: {r['memory']}.",
        *(
            [
                "During the load (the candidate's /metrics): KV cache use up to "
                f"{max(s.get('kv_usage', 0) for s in smp):.0%}, up to "
                f"{max(s.get('running', 0) for s in smp):.0f} requests running and "
                f"{max(s.get('waiting', 0) for s in smp):.0f} waiting."
            ]
            if (smp := [s for s in r.get("samples") or [] if "running" in s])
            else []
        ),
        "",
        "| check | result |",
        "|---|---|",
        *(f"| {k} | {'ok' if v else '**FAILED**'} |" for k, v in r["checks"].items()),
        "",
        "Per feature: "
        + "; ".join(f"{k}: {v}" for k, v in sorted(r["per_feature"].items())),
    ]
    if r.get("fault"):
        lines += ["", f"Fault: {r['fault']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
