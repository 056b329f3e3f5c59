"""``harness/gpu_slots.sh``: a GPU call's processes spread round-robin over
the host's GPUs, and left alone on a host without any."""

from pathlib import Path

from conftest import run_until_done

REPO = Path(__file__).resolve().parents[1]
SLOTS = REPO / "harness" / "gpu_slots.sh"


def _seen(env: dict, n: int = 5) -> list[str]:
    script = (
        f"source {SLOTS}\n"
        f"for k in $(seq 0 {n - 1}); do\n"
        '  on_gpu "$k" bash -c \'echo "[${CUDA_VISIBLE_DEVICES-unset}]"\'\n'
        "done\n"
    )
    base = {"PATH": "/usr/bin:/bin"}  # no nvidia-smi
    proc = run_until_done(
        ["bash", "-c", script], what="on_gpu over five processes", env=base | env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_processes_go_round_robin_over_the_listed_gpus():
    assert _seen({"HS_GPUS": "0 1 2 3"}) == ["[0]", "[1]", "[2]", "[3]", "[0]"]
    # a caller's CUDA_VISIBLE_DEVICES is the list to spread over
    assert _seen({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["[2]", "[3]", "[2]", "[3]", "[2]"]


def test_without_gpus_the_environment_is_left_as_it_is():
    assert _seen({}) == ["[unset]"] * 5
    # the CPU tests' setting (no GPU visible) stays
    assert _seen({"CUDA_VISIBLE_DEVICES": ""}) == ["[]"] * 5
