"""pytest plugin for the CPU test bed (``-p hsfork.pytest_cpu_testbed``).

The GPU hosts run torch 2.11.0+cu130; the CPU test bed runs the local torch
2.13.0 CPU build with vLLM installed for no device. Two gaps are bridged here,
and only when no accelerator is present:

- vLLM resolves no platform for a ``VLLM_TARGET_DEVICE=empty`` install, so
  configs cannot infer a device: ``HSFORK_CPU_TESTBED=1`` activates the test
  bed's platform plugin (``cpu_platform_plugin/``), which picks vLLM's CPU
  platform;
- ``torch.accelerator.empty_cache()`` raises on torch 2.13 without an
  accelerator (vLLM's test cleanup calls it): make it the no-op it is when
  there is nothing to empty;
- vLLM's CPU platform sets ``VLLM_SSM_CONV_STATE_LAYOUT=SD`` on a CPU with
  AMX tiles (``CpuPlatform.check_and_update_config``), which the GPU
  platforms it stands in for never do: tests of the conv-state layout then
  passed or failed with the CPU model. The test bed reports no AMX, so the
  layout follows the environment as on a GPU host (the CPU kernels that ask
  for AMX need vLLM's CPU extension, which the test bed does not build).
"""

from __future__ import annotations

import os


def _bridge() -> None:
    import torch

    if torch.accelerator.is_available():
        return
    original = torch.accelerator.empty_cache

    def empty_cache() -> None:
        if torch.accelerator.is_available():
            original()

    torch.accelerator.empty_cache = empty_cache
    torch.cpu._is_amx_tile_supported = lambda: False

    # vLLM's platform: resolved through the test bed's platform plugin
    os.environ.setdefault("HSFORK_CPU_TESTBED", "1")


# at import: ``-p`` plugins load before the tests' conftest imports vLLM
_bridge()
