# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures of our test suite (the fork's upstream tests use fork/tests).

Markers: ``gpu`` tests need a CUDA device and are skipped, with the reason
shown, elsewhere; every other test is a CPU test (marked ``cpu`` here).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU hosts)")
    config.addinivalue_line("markers", "cpu: runs on a CPU-only host")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    cuda = None
    for item in items:
        if "gpu" in item.keywords:
            if cuda is None:
                cuda = _has_cuda()
            if not cuda:
                item.add_marker(
                    pytest.mark.skip(
                        reason="needs a CUDA GPU: run on the GPU host from the bundle"
                    )
                )
        else:
            item.add_marker(pytest.mark.cpu)


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository on PYTHONPATH, plus
    ``extra``: for scripts run as subprocesses."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH", "")) if p
    )
    env.update(extra)
    return env


def in_cpu_testbed(path: str | Path, func: str):
    """``func()`` of the test module at ``path``, run in a subprocess on
    vLLM's CPU platform (``HSFORK_CPU_TESTBED``), its result passed back as
    JSON: for tests that build vLLM configs in a process of their own."""
    import json
    import sys

    code = (
        "import runpy, json\n"
        f"ns = runpy.run_path({str(path)!r})\n"
        f"print('RESULT', json.dumps(ns[{func!r}]()))\n"
    )
    p = run_until_done([sys.executable, "-c", code], cwd=REPO,
                       what=f"{func} of {Path(path).name} on the CPU testbed",
                       env=subprocess_env(HSFORK_CPU_TESTBED="1"))  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return json.loads(p.stdout.split("RESULT ", 1)[1])


# A guard against hangs only, never a performance budget: a dry run that
# takes minutes on an idle machine may take many times that on a busy one.
HANG_GUARD_S = 3600.0


def run_until_done(
    cmd, *, what: str, timeout: float = HANG_GUARD_S, **kw
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kw)`` that
    waits for the command to end; ``timeout`` only guards against a hang, and
    its failure names ``what`` it waited for, with the output so far."""
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, **kw
        )
    except subprocess.TimeoutExpired as e:

        def tail(x) -> str:
            if isinstance(x, bytes):
                x = x.decode(errors="replace")
            return (x or "")[-3000:]

        pytest.fail(
            f"hang guard: {what} had not ended after {timeout:.0f} s "
            f"(command: {cmd!r})\nstdout:\n{tail(e.stdout)}\n"
            f"stderr:\n{tail(e.stderr)}"
        )


def wait_until_healthy(
    url: str, proc: subprocess.Popen, *, what: str, timeout: float = HANG_GUARD_S
) -> None:
    """Wait until ``url``/health answers 200 (the server is up) or ``proc``
    exits (fail: it died); ``timeout`` only guards against a hang."""
    import time
    import urllib.request

    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode} before /health")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            pytest.fail(f"hang guard: {what} not healthy after {timeout:.0f} s")
        time.sleep(0.1)


def fake_output(tokens: list[int], logprobs, second: float = -3.0):
    """A stand-in for one completion of vLLM's ``RequestOutput``, as
    ``harness.equivalence.generate`` returns them: its token ids and, where
    log-probabilities were asked for, each position's token at -0.1 and the
    next id at ``second``."""
    from types import SimpleNamespace

    lps = None
    if logprobs:
        lps = [
            {t: SimpleNamespace(logprob=-0.1), t + 1: SimpleNamespace(logprob=second)}
            for t in tokens
        ]
    completion = SimpleNamespace(token_ids=tokens, logprobs=lps)
    return SimpleNamespace(outputs=[completion], prompt_logprobs=None)


def greedy_forced(model, dtype, model_dir, seqs, kv_cache_dtype="auto", **_):
    """A stand-in for ``harness.equivalence.teacher_forced`` under which
    every token of every sequence is the reference's decisive top choice."""
    from harness.compare import Position

    return [[Position(t, 0, 3.0) for t in c] for _, c in seqs]


def fake_engines(monkeypatch, generate, forced=greedy_forced) -> None:
    """``harness.equivalence.run_cells`` without vLLM: the given stand-ins
    for ``generate`` and ``teacher_forced``, and no model written."""
    import harness.equivalence as eq

    monkeypatch.setattr(eq, "generate", generate)
    monkeypatch.setattr(eq, "teacher_forced", forced)
    monkeypatch.setattr(
        "harness.models.write_model", lambda kind, out, seed=0, **kw: str(out)
    )


def free_port(span: int = 8) -> int:
    """A local port whose next ``span - 1`` ports are free too, outside the
    kernel's ephemeral range: the servers a test starts at port, port + 1,
    ... (``serving.servers.launch`` takes the next free one) are then not
    raced by the local ports of outgoing connections, which the kernel
    takes from that range. A soak test's candidate once waited for its
    reference at port + 1 while a connection held that port, and the
    reference started at port + 2."""
    import random
    import socket

    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        lo, hi = (int(x) for x in text.split()[:2])
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    ranges = [(10000, lo - span), (hi + 1, 65536 - span)]
    ranges = [(a, b) for a, b in ranges if b - a > 100]
    rng = random.Random()
    for _ in range(1000):
        a, b = rng.choice(ranges)
        port = rng.randrange(a, b)
        socks = []
        try:
            for p in range(port, port + span):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {span} free ports outside the ephemeral range")


def git_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GIT_AUTHOR_NAME="Test Author",
        GIT_AUTHOR_EMAIL="author@example.com",
        GIT_COMMITTER_NAME="Test Author",
        GIT_COMMITTER_EMAIL="author@example.com",
        GIT_CONFIG_NOSYSTEM="1",
    )
    return env


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=repo,
        env=git_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout


SYNTH_FILES = {
    "PKG-INFO": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\n",
    ".gitignore": "/vllm/_version.py\n*.egg-info/\nbenchmarks/*.json\n",
    "setup.py": "raise SystemExit('not built in tests')\n",
    "vllm/__init__.py": "from .core import LLM\n",
    "vllm/_version.py": "__version__ = '0.26.0'\n",
    "vllm/core.py": "".join(f"LINE_{i} = {i}\n" for i in range(40))
    + "class LLM: ...\n",
    "vllm/other.py": "X = 1\n",
    "vllm.egg-info/PKG-INFO": "generated\n",
    "benchmarks/data.json": '{"real": "source hidden by .gitignore"}\n',
    "tests/test_core.py": "def test_x():\n    assert True\n",
}


def make_sdist(path: Path, files: dict[str, str] = SYNTH_FILES) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            ti = tarfile.TarInfo(f"vllm-0.26.0/{name}")
            ti.size = len(data)
            ti.mode = 0o644
            tar.addfile(ti, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


@pytest.fixture
def synth(tmp_path, monkeypatch):
    """A synthetic upstream (tiny sdist) with its own pin, cache, fork/ and
    patches/, wired into hsfork through its HSFORK_* variables."""
    cache = tmp_path / "cache"
    cache.mkdir()
    sha = make_sdist(cache / "vllm-0.26.0.tar.gz")
    pin = tmp_path / "upstream.toml"
    pin.write_text(
        '[package]\nname = "vllm"\nversion = "0.26.0"\ntag = "v0.26.0"\n'
        'cuda = "13.0"\n\n[[files]]\nkind = "sdist"\n'
        f'filename = "vllm-0.26.0.tar.gz"\nsha256 = "{sha}"\n'
    )
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "series").write_text("")
    for key, value in {
        "HSFORK_PIN": pin,
        "HSFORK_CACHE": cache,
        "HSFORK_FORK": tmp_path / "fork",
        "HSFORK_PATCHES": patches,
        # never reach out to a real index from these tests
        "HSFORK_INDEX_URL": "http://127.0.0.1:9/simple",
    }.items():
        monkeypatch.setenv(key, str(value))
    for key, value in git_env().items():
        if key.startswith("GIT_"):
            monkeypatch.setenv(key, value)

    class Synth:
        root = tmp_path
        fork = tmp_path / "fork"
        patch_dir = patches
        sdist_sha = sha

    return Synth


@pytest.fixture
def qwen35_serve_flags() -> str:
    """The Qwen3.5 ``vllm serve`` flags of serving/host_env.sh (``$QWEN35``),
    as the GPU scripts expand them."""
    return subprocess.run(
        [
            "bash",
            "-c",
            f'eval "$(grep "^QWEN35=" {REPO}/serving/host_env.sh)"; echo "$QWEN35"',
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


# A worker that imports vLLM once (seconds on a CPU host) and then parses one
# request per stdin line: {"cmds": [...], "fields": [...]} -> a RESULT line.
SERVE_PARSE_WORKER = r"""
import json, sys, traceback
try:  # v0.33.0
    from vllm.entrypoints.common.cli_args import (
        make_arg_parser, validate_parsed_serve_args)
except ImportError:  # v0.26.0
    from vllm.entrypoints.openai.cli_args import (
        make_arg_parser, validate_parsed_serve_args)
from vllm.utils.argparse_utils import FlexibleArgumentParser
for line in sys.stdin:
    req = json.loads(line)
    try:
        out = []
        for cmd in req["cmds"]:
            ns = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd)
            validate_parsed_serve_args(ns)
            out.append({k: getattr(ns, k) for k in req["fields"]})
        print("RESULT " + json.dumps(out, default=str), flush=True)
    except BaseException:
        print("ERROR " + json.dumps(traceback.format_exc()), flush=True)
"""


@pytest.fixture(scope="session")
def parse_serve_args(tmp_path_factory):
    """``parse(cmds, fields)``: each argument list of ``vllm serve`` (without
    ``vllm serve``) through the installed vLLM's own serve parser and
    validation, in one worker process on the CPU test bed shared by the
    session; the requested fields of each parsed namespace."""
    import threading

    d = tmp_path_factory.mktemp("parse_serve")
    (d / "worker.py").write_text(SERVE_PARSE_WORKER)
    err_fh = open(d / "stderr.log", "w")  # noqa: SIM115 - closed at the end
    proc = subprocess.Popen(
        [sys.executable, str(d / "worker.py")],
        cwd=d,
        env=subprocess_env(HSFORK_CPU_TESTBED="1", VLLM_LOGGING_LEVEL="ERROR"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err_fh,
        text=True,
    )

    def answer() -> str:
        """The worker's next RESULT or ERROR line (other output skipped)."""
        got: list[str] = []

        def read():
            for line in proc.stdout:
                if line.startswith(("RESULT ", "ERROR ")):
                    got.append(line)
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(HANG_GUARD_S)  # a guard against hangs only
        if not got:
            err = (d / "stderr.log").read_text()[-3000:]
            state = "hung" if t.is_alive() else f"exited ({proc.poll()})"
            pytest.fail(f"vllm serve's parser worker {state} before answering:\n{err}")
        return got[0]

    def parse(cmds: list[list[str]], fields: list[str]) -> list[dict]:
        proc.stdin.write(json.dumps({"cmds": cmds, "fields": fields}) + "\n")
        proc.stdin.flush()
        line = answer()
        assert line.startswith("RESULT "), json.loads(line[6:])
        return json.loads(line[7:])

    yield parse
    proc.kill()  # holds nothing; its interpreter's exit takes seconds
    proc.wait()
    proc.stdin.close()
    err_fh.close()
