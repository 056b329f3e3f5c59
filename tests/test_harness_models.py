# SPDX-License-Identifier: Apache-2.0
"""Generated tiny models: deterministic, loadable, decisive, repetitive
enough for prompt lookup. Measured with transformers on the CPU in fp32."""

from __future__ import annotations

import hashlib

import pytest
import torch

from harness.equivalence import make_prompts
from harness.models import FAMILY_KINDS, FIXTURES, HAND_WRITTEN, KINDS, write_model


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("kind", KINDS)
def test_fixture_is_deterministic(tmp_path, kind):
    a = write_model(kind, tmp_path / "a", seed=3)
    b = write_model(kind, tmp_path / "b", seed=3)
    c = write_model(kind, tmp_path / "c", seed=4)
    assert _digest(a) == _digest(b) != _digest(c)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()


def _load(kind, path):
    import transformers

    # transformers' class has the name of vLLM's for every kind
    cls = getattr(transformers, FIXTURES[kind]["architecture"])
    return cls.from_pretrained(path, dtype=torch.float32).eval()


# the other hybrid families: transformers runs their mixers on its slow
# reference paths here (5-25 s a kind for this test), so CI checks their
# margins teacher-forced (test_family_margins_are_decisive); this test's
# numbers for them are in docs/harness.md
@pytest.mark.parametrize("kind", [k for k in KINDS if k not in FAMILY_KINDS])
def test_greedy_margins_are_decisive_and_output_repeats(tmp_path, kind):
    model = _load(kind, write_model(kind, tmp_path / "m"))
    gaps, hits, total = [], 0, 0
    for prompt in make_prompts(3, seed=1, lo=24, hi=48):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=40, do_sample=False, output_logits=True,
                return_dict_in_generate=True, eos_token_id=None,
            )  # fmt: skip
        for lg in out.logits:
            top = lg[0].float().topk(2).values
            gaps.append((top[0] - top[1]).item())
        seq = out.sequences[0].tolist()
        for i in range(len(prompt) + 2, len(seq)):
            total += 1
            bigram = seq[i - 2 : i]
            hits += any(seq[j : j + 2] == bigram for j in range(i - 2))
    gaps_t = torch.tensor(gaps)
    # fp32 kernels differ by ~1e-5 in these logits; every choice is far above
    assert gaps_t.min().item() > 1e-3, sorted(gaps)[:5]
    # and most are far above bf16 noise too
    assert (gaps_t > 0.05).float().mean().item() > 0.9
    # prompt lookup (bigrams) finds matches in a good share of the steps
    assert hits / total > 0.05


# a hand-written kind (Plamo2) has no transformers model to run
@pytest.mark.parametrize("kind", [k for k in FAMILY_KINDS if k not in HAND_WRITTEN])
def test_family_margins_are_decisive(kind):
    """One teacher-forced forward pass over two prompts (every position's
    next-token choice): far above fp32 kernel noise everywhere, above bf16
    noise almost everywhere."""
    from harness.models import build_model

    _, model = build_model(kind)
    gaps = []
    for prompt in make_prompts(2, seed=1, lo=32, hi=48):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0]
        top = logits.float().topk(2, dim=-1).values
        gaps += (top[:, 0] - top[:, 1]).tolist()
    gaps_t = torch.tensor(gaps)
    assert gaps_t.min().item() > 1e-3, sorted(gaps)[:5]
    assert (gaps_t > 0.05).float().mean().item() > 0.9


def test_prompts_are_heterogeneous_and_uniquely_headed():
    ps = make_prompts(16, seed=0)
    assert len({len(p) for p in ps}) > 8
    assert len({tuple(p[:8]) for p in ps}) == 16
    assert all(0 <= t < 250 for p in ps for t in p)
