"""hsfork/gpu_bg.sh: background jobs that outlive the call starting them."""

import os
import tarfile
from pathlib import Path

from conftest import REPO, run_until_done


def _sh(script: str, bg: Path) -> str:
    done = run_until_done(
        ["bash", "-c", f"source {REPO}/hsfork/gpu_bg.sh\n{script}"],
        what=f"gpu_bg.sh: {script}",
        env={**os.environ, "HS_BG": str(bg)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


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
    # bg_wait's bound only guards against a job that never ends
    out = _sh(f"bg_wait $((SECONDS + 3600)) j; bg_pack {tmp_path}/o j", bg)
    assert "[bg] j done" in out, f"the job did not end after its go file: {out}"
    assert "[bg] packed j" in out
    with tarfile.open(tmp_path / "o" / "bg-j.tgz") as t:
        assert t.extractfile("j/r").read() == b"hi\n"
        assert "j.log" in t.getnames()
