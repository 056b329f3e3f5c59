"""vLLM platform plugin installed only into the CPU test bed's venv.

The fork is installed there for no device (``VLLM_TARGET_DEVICE=empty``), for
which vLLM resolves no platform, so configs cannot infer a device. With
``HSFORK_CPU_TESTBED=1`` and no CUDA device this plugin selects vLLM's own
CPU platform; otherwise it stays inactive.
"""

import os


def cpu_platform() -> str | None:
    if os.environ.get("HSFORK_CPU_TESTBED") != "1":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return "vllm.platforms.cpu.CpuPlatform"
