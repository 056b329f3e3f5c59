"""lm-eval (``lm_eval run``, its ``local-completions`` and
``local-chat-completions`` models) against running servers with the task in
``serving/lm_eval_task``, and its results read back."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

from .servers import ServerSpec, log_tail, time_left


def lm_eval_command(a, srv: ServerSpec, out_dir: Path, chat: bool) -> list[str]:
    model = "local-chat-completions" if chat else "local-completions"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    margs = (
        f"model={a.served_name},base_url={srv.url}{path},"
        f"tokenizer_backend=None,num_concurrent={a.lm_eval_concurrency},"
        "max_retries=1,timeout=120"
    )
    cmd = shlex.split(a.lm_eval_cmd) + [
        "run",
        "--model",
        model,
        "--tasks",
        a.lm_eval_task,
        "--include_path",
        str(Path(a.lm_eval).resolve()),
        "--model_args",
        margs,
        "--output_path",
        str(out_dir),
        "--log_samples",
    ]
    if chat:
        cmd.append("--apply_chat_template")
    if a.lm_eval_limit:
        cmd += ["--limit", str(a.lm_eval_limit)]
    return cmd


def read_lm_eval(out_dir: Path, task: str) -> dict | None:
    files = sorted(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    res = json.loads(files[-1].read_text()).get("results", {}).get(task)
    return {k: v for k, v in (res or {}).items() if k != "alias"} or None


def run_lm_eval(a, servers, out: Path, deadline: float, log=print) -> dict:
    """lm-eval (completions and chat) against every server, all at once."""
    procs = []
    for srv in servers:
        for chat in (False, True):
            tag = f"{srv.name}-{'chat' if chat else 'completions'}"
            d = out / "lm_eval" / tag
            d.mkdir(parents=True, exist_ok=True)
            cmd = lm_eval_command(a, srv, d, chat)
            fh = open(out / "logs" / f"lm_eval-{tag}.log", "w")  # noqa: SIM115
            fh.write("$ " + shlex.join(cmd) + "\n")
            fh.flush()
            p = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
            procs.append((tag, p, fh, d))
    results = {}
    for tag, p, fh, d in procs:
        try:
            p.wait(timeout=time_left(deadline))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        fh.close()
        r = read_lm_eval(d, a.lm_eval_task)
        results[tag] = {"rc": p.returncode, "results": r}
        if r is None:
            results[tag]["log_tail"] = log_tail(fh.name, 15)
        log(f"[serve_check] lm-eval {tag}: rc={p.returncode} {json.dumps(r)}")
    return results
