"""``harness/gpu_owed.sh``: the cells a support table owes, run and nothing
else: single-GPU cells over every GPU, TP=2 cells over a pair, each slice
filtered by the list (``harness.equivalence --cells``)."""

import json
import os
import sys
from pathlib import Path

from conftest import run_until_done

REPO = Path(__file__).resolve().parents[1]
OWED = REPO / "harness" / "gpu_owed.sh"


def _owed(tmp_path: Path) -> Path:
    """Three owed cells as `support-table --not-run` writes them: two of the
    fp8 slice, one TP=2 cell of tp2."""
    from harness.equivalence import slice_cells

    fp8 = slice_cells("fp8")[-2:]
    tp = [c for c in slice_cells("tp2") if c.graphs == "eager"][:1]
    rows = [{"slice": "fp8", **c.key()} for c in fp8]
    rows += [{"slice": "tp2", **c.key()} for c in tp]
    path = tmp_path / "owed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dry(tmp_path: Path, gpus: str) -> str:
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",  # no nvidia-smi
        "PYTHONPATH": str(REPO),
        "HS_DRY": "1",
        "HS_LINE": "v0.33.0",
        "HS_OWED": str(_owed(tmp_path)),
        "HS_GPUS": gpus,
        "OUT": str(tmp_path / "out"),
        "HOME": os.environ.get("HOME", "/tmp"),
    }
    proc = run_until_done(
        ["bash", str(OWED), "fork upstream", "120"],
        what="gpu_owed.sh's dry run",
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_owed_cells_go_to_one_matrix_call_per_kind(tmp_path: Path):
    from harness.equivalence import listed_cells, slice_cells

    out = _dry(tmp_path, "0 1")
    # one process per owed cell, each with the same allowance past the
    # deadline
    assert "[owed] v0.33.0: single-GPU: fp8:2; TP: tp2:1" in out
    cmds = [x for x in out.splitlines() if "gpu_matrix.sh" in x]
    assert len(cmds) == 2
    single, tp = cmds
    assert f"HS_CELLS={tmp_path}/out/owed-single.jsonl" in single
    assert "fork upstream fp8:2 120" in single and "HS_GPUS" not in single
    assert "HS_CELL_S=600" in single
    assert "HS_GPUS=0,1 HS_CELL_S=600" in tp and "tp2:1 120" in tp
    # each half's list selects exactly its cells of the slice
    d = tmp_path / "out"
    got = listed_cells(slice_cells("fp8"), d / "owed-single.jsonl")
    assert [c.key() for c in got] == [c.key() for c in slice_cells("fp8")[-2:]]
    (tp_cell,) = listed_cells(slice_cells("tp2"), d / "owed-tp.jsonl")
    assert tp_cell.graphs == "eager" and tp_cell.extra["tensor_parallel_size"] == 2


def test_a_host_of_one_gpu_leaves_the_tp_cells_out_and_says_so(tmp_path: Path):
    out = _dry(tmp_path, "0")
    assert "left out: the TP cells need 2 GPUs, this host has 1" in out
    assert sum("gpu_matrix.sh" in x for x in out.splitlines()) == 1
