# SPDX-License-Identifier: Apache-2.0
"""The generated offline model cache serves hub ids without a hub."""

from __future__ import annotations

import subprocess
import sys

from hsfork.fixtures import MODELS, write_model_cache


def test_cache_layout_is_deterministic(tmp_path):
    a = write_model_cache(tmp_path / "a")
    b = write_model_cache(tmp_path / "b")
    for repo_id in MODELS:
        folder = "models--" + repo_id.replace("/", "--")
        rev_a = (a / folder / "refs" / "main").read_text()
        assert rev_a == (b / folder / "refs" / "main").read_text()
        assert (a / folder / "snapshots" / rev_a / "config.json").is_file()


def test_configs_load_offline_through_transformers_and_vllm(tmp_path):
    cache = write_model_cache(tmp_path / "hub")
    code = """
import json
from transformers import AutoConfig
from vllm.transformers_utils.config import get_config
c = AutoConfig.from_pretrained("Qwen/Qwen3.5-0.8B")
t = c.text_config
v = get_config("Qwen/Qwen3.5-9B", trust_remote_code=False)
print(json.dumps([type(c).__name__, t.hidden_size, t.layer_types[:4],
                  v.text_config.hidden_size, v.text_config.num_hidden_layers,
                  v.text_config.vocab_size]))
"""
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "PATH": "/usr/bin:/bin",
        "CUDA_VISIBLE_DEVICES": "",
        "VLLM_TARGET_DEVICE": "empty",
        "HOME": str(tmp_path),
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    name, hidden, types, h9, l9, vocab = json.loads(out.stdout.strip().splitlines()[-1])
    assert name == "Qwen3_5Config"
    assert hidden == 1024
    assert types == ["linear_attention"] * 3 + ["full_attention"]
    assert (h9, l9, vocab) == (4096, 32, 248320)
