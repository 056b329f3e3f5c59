# SPDX-License-Identifier: Apache-2.0
"""On the GPU host, from the bundle: the fork imports, its compiled
extensions load on CUDA, and it carries this repo's patch stack."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_fork_imports_with_our_label():
    import vllm
    from vllm import LLM  # noqa: F401

    from hsfork.fork import fork_version

    assert vllm.__version__ == fork_version()


def test_compiled_ops_run_on_cuda():
    import torch
    import vllm._custom_ops as ops  # loads vllm._C_stable_libtorch

    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
