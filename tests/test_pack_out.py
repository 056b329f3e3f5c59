"""``harness/pack_out.sh``: a GPU call's results packed into one archive,
and a partial archive kept up to date that survives the call being killed."""

import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

from conftest import HANG_GUARD_S, run_until_done

REPO = Path(__file__).resolve().parents[1]
PACK = REPO / "harness" / "pack_out.sh"


def _members(archive: Path) -> set[str]:
    with tarfile.open(archive) as t:
        return {m.name for m in t.getmembers() if m.isfile()}


def test_a_killed_call_leaves_a_whole_partial_archive(tmp_path):
    script = f"""
        OUT={tmp_path}; PACK_EVERY=0.2; source {PACK}
        mkdir -p "$OUT/reports" "$OUT/logs"
        echo one > "$OUT/reports/a.json"; echo log > "$OUT/logs/a.log"
        pack_start equivalence reports logs
        i=0
        while :; do i=$((i + 1)); echo "$i" > "$OUT/reports/n.txt"; sleep 0.05; done
    """
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    partial = tmp_path / "equivalence-partial.tgz"
    end = time.monotonic() + HANG_GUARD_S
    try:
        # the condition: a partial archive that holds what was written
        while not (
            partial.exists() and {"reports/a.json", "logs/a.log"} <= _members(partial)
        ):
            assert proc.poll() is None, "the script ended on its own"
            assert time.monotonic() < end, "hang guard: no partial archive appeared"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the call's limit, no grace
        proc.wait()
    assert {"reports/a.json", "logs/a.log"} <= _members(partial)


def test_the_final_archive_replaces_the_partial_one(tmp_path):
    script = f"""
        OUT={tmp_path}; PACK_EVERY=0.2; source {PACK}
        mkdir -p "$OUT/fuzz" "$OUT/logs"
        pack_start rerun fuzz logs
        echo x > "$OUT/fuzz/run.jsonl"
        until [ -f "$OUT/rerun-partial.tgz" ]; do sleep 0.05; done
        echo y > "$OUT/logs/late.log"
        pack_final rerun fuzz logs
    """
    proc = run_until_done(["bash", "-c", script], what="pack_start + pack_final")
    assert proc.returncode == 0, proc.stderr
    left = sorted(p.name for p in tmp_path.iterdir())
    assert (
        len(left) == 1
        and left[0].startswith("rerun-")
        and left[0] != ("rerun-partial.tgz")
    ), left
    assert _members(tmp_path / left[0]) == {"fuzz/run.jsonl", "logs/late.log"}


def test_pack_final_skips_folders_that_do_not_exist(tmp_path):
    script = f"""
        OUT={tmp_path}; source {PACK}
        mkdir -p "$OUT/equivalence"; echo r > "$OUT/equivalence/r.md"
        pack_final equivalence equivalence logs
    """
    proc = run_until_done(["bash", "-c", script], what="pack_final")
    assert proc.returncode == 0, proc.stderr
    (archive,) = tmp_path.glob("equivalence-*.tgz")
    assert _members(archive) == {"equivalence/r.md"}
