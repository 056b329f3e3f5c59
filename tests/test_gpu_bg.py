"""hsfork/gpu_bg.sh: background jobs that outlive the call starting them."""

import os
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _sh(script: str, bg: Path) -> str:
    return subprocess.run(
        ["bash", "-c", f"source {REPO}/hsfork/gpu_bg.sh\n{script}"],
        env={**os.environ, "HS_BG": str(bg)},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,  # a hang guard only: every step waits on a condition
    ).stdout


def test_a_job_outlives_its_caller_in_a_session_of_its_own(tmp_path):
    bg, go = tmp_path / "bg", tmp_path / "go"
    # the job waits for a file, so it is running until the test says so
    job = f"while [ ! -e {go} ]; do sleep 0.1; done; echo hi > \\$BG_OUT/r"
    try:
        out = _sh(f'bg_start j "{job}"; bg_status; bg_pack {tmp_path}/o j', bg)
        assert "[bg] j started" in out and "[bg] j RUNNING" in out
        assert "j still running: not packed" in out
        pid = int((bg / "j.pid").read_text())
        # the caller has returned; the job runs on, leading its own session
        assert os.getsid(pid) == pid != os.getsid(0)
    finally:
        go.touch()  # the job ends whatever failed above
    out = _sh(f"bg_wait $((SECONDS + 100)) j; bg_pack {tmp_path}/o j", bg)
    assert "[bg] j done" in out and "[bg] packed j" in out
    with tarfile.open(tmp_path / "o" / "bg-j.tgz") as t:
        assert t.extractfile("j/r").read() == b"hi\n"
        assert "j.log" in t.getnames()
