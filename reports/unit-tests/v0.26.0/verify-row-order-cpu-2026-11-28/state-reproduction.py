# SPDX-License-Identifier: Apache-2.0
"""Cell (A): Bailing, V1 runner, align mode, scripted accept_then_zero, k=4.

The V1 runner reorders a step's rows with the smallest reorder threshold of
all attention builders. Bailing's MLA layers run TRITON_MLA, whose builder is
SINGLE_ONLY, so that threshold is 1 (not 1 + k): a verify row of 1 + k tokens
is a "long_extend" like the prompt tails that align mode leaves (the
scheduler stops a prompt's first chunk at its last block boundary), and keeps
its place among them. Bailing's builder counts as decodes only the rows
before the first prefilling one (split_decodes_and_prefills), so the verify
row runs on the prefill path: it reads the first slot of its window, ignores
its accepted count, folds all 1 + k tokens into that one slot and writes none
of the per-draft slots. The next step reads slot num_accepted - 1: stale.

The step reproduced is step 1 of the first wave of the failing cell
(harness make_prompts(8, 0): lengths 122 145 54 103 29 150 62 159, block 32):
step 0 ran every prompt up to its last block boundary (prompt 4, 29 tokens,
whole); step 1 runs the seven prompt tails and prompt 4's first verify row
(4 drafts, all accepted). Prompt 4's generated position 6 is the output of
step 2, the first step that reads the stale slot: where the drift starts.
"""

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.config import CUDAGraphMode
from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
from vllm.model_executor.layers.mamba.linear.bailing_linear_attn import (
    BailingMoELinearAttention,
    clear_linear_attention_cache_for_new_sequences,
)
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.linear_attn import (
    BailingLinearAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.mla.triton_mla import TritonMLAMetadataBuilder
from vllm.v1.attention.backends.utils import (
    reorder_batch_to_split_decodes_and_prefills,
)
from vllm.v1.kv_cache_interface import MambaSpec

K = 4
BS = 32
WIDTH = 10  # block-table columns per request (enough for 160 tokens + k)
HEADS = 2
D = 64

PROMPTS = [122, 145, 54, 103, 29, 150, 62, 159]
# step 1 of the first wave: (num_computed, num_scheduled, drafts)
STEP1 = []
for p in PROMPTS:
    if p < BS:  # whole prompt in step 0, now its first verify row
        STEP1.append((p, 1 + K, K))
    else:  # step 0 stopped at the last block boundary; the tail now
        STEP1.append((p // BS * BS, p % BS, 0))


class _Batch:
    """What reorder_batch_to_split_decodes_and_prefills reads of InputBatch."""

    def __init__(self):
        self.req_ids = [f"r{i}" for i in range(len(PROMPTS))]
        self.num_computed_tokens_cpu = np.array([s[0] for s in STEP1])
        self.num_prompt_tokens = np.array(PROMPTS)

    def swap_states(self, i, j):
        r = self.req_ids
        r[i], r[j] = r[j], r[i]
        for a in (self.num_computed_tokens_cpu, self.num_prompt_tokens):
            a[[i, j]] = a[[j, i]]


def _v1_threshold() -> int:
    # TRITON_MLA keeps the base threshold 1 (no spec-as-decode support);
    # Bailing's builder asks for 1 + k; the V1 runner takes the minimum
    # (GPUModelRunner.calculate_reorder_batch_threshold).
    assert TritonMLAMetadataBuilder.query_len_support == QueryLenSupport.SINGLE_ONLY
    return min(1, 1 + K)


def _v1_order() -> list[int]:
    batch = _Batch()
    sched = SimpleNamespace(
        num_scheduled_tokens={f"r{i}": s[1] for i, s in enumerate(STEP1)},
        scheduled_spec_decode_tokens={
            f"r{i}": [1] * s[2] for i, s in enumerate(STEP1) if s[2]
        },
    )
    reorder_batch_to_split_decodes_and_prefills(
        batch, sched, decode_threshold=_v1_threshold()
    )
    return [int(r[1:]) for r in batch.req_ids]


def _builder(k: int = K) -> BailingLinearAttentionMetadataBuilder:
    b = object.__new__(BailingLinearAttentionMetadataBuilder)
    b.kv_cache_spec = MambaSpec(
        block_size=BS,
        shapes=((HEADS, D, D),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        num_speculative_blocks=k,
    )
    b.vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(mamba_cache_mode="align")
    )
    b.compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE)
    b.num_spec_tokens = k
    b.use_spec_decode = True
    b.decode_cudagraph_max_bs = 8
    b.reorder_batch_threshold = 1 + k
    return b


def _block_ids(req: int) -> list[int]:
    return [WIDTH * req + j + 1 for j in range(WIDTH)]


def _common(step, order: list[int]) -> CommonAttentionMetadata:
    """The step's common metadata, rows in ``order``; ``step``: per prompt
    (num_computed, num_scheduled, drafts)."""
    rows = [step[i] for i in order]
    qlens = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    seq_lens = torch.tensor([r[0] + r[1] for r in rows], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        num_reqs=len(rows),
        num_actual_tokens=int(qlens.sum()),
        max_query_len=int(qlens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.tensor(
            [_block_ids(i) for i in order], dtype=torch.int32
        ),
        slot_mapping=torch.zeros(int(qlens.sum()), dtype=torch.int64),
        is_prefilling=torch.tensor([step[i][0] < PROMPTS[i] for i in order]),
    )


def _metadata(order: list[int]):
    rows = [STEP1[i] for i in order]
    common = _common(STEP1, order)
    # accepted counts after preprocess_mamba (prompt 4 crossed into block 1:
    # its state was copied there and its count reset to 1); the runner's
    # num_decode_draft_tokens: k for the verify row, -1 for prompt chunks
    acc = torch.ones(len(rows), dtype=torch.int32)
    drafts = torch.tensor(
        [K if STEP1[i][2] else -1 for i in order], dtype=torch.int32
    )
    md = _builder().build(
        0, common, num_accepted_tokens=acc, num_decode_draft_tokens_cpu=drafts
    )
    return md, rows


def test_v1_puts_the_verify_row_before_prompt_tails():
    order = _v1_order()
    # on the fork all eight rows are "long_extend" at threshold 1: no swap,
    # prompt 4's verify row stays behind four prompt tails (index 4)
    assert order.index(4) == 0, order


def test_verify_row_is_a_decode_row_in_the_v1_order():
    order = _v1_order()
    md, _ = _metadata(order)
    pos = order.index(4)
    # prompt 4's verify row must run on the speculative decode path
    assert pos < md.num_decodes, (
        f"verify row at position {pos} of {order} runs as a prefill: "
        f"num_decodes={md.num_decodes}, num_prefills={md.num_prefills}"
    )


def _ref_states(s0, k, v, slope, n):
    """State after each of the first n tokens (decode recurrence)."""
    out, s = [], s0.clone()
    decay = torch.exp(-slope)[:, None, None]
    for t in range(n):
        s = decay * s + torch.einsum("hd,he->hde", k[t], v[t])
        out.append(s.clone())
    return out


@pytest.mark.parametrize("accepted", [1 + K, 1], ids=["all-accepted", "all-rejected"])
@torch.inference_mode()
def test_next_step_reads_the_state_of_the_last_accepted_token(accepted):
    _run_step_and_check(accepted, [i for i in _v1_order() if i in (3, 4)])


@pytest.mark.parametrize("accepted", [1 + K, 1], ids=["all-accepted", "all-rejected"])
@torch.inference_mode()
def test_control_verify_row_first(accepted):
    """Control for the reference math: the order a threshold of 1 + k gives
    (v0.33.0's TRITON_MLA is UNIFORM; Falcon-H1/Zamba2 use TRITON_ATTN)."""
    _run_step_and_check(accepted, [4, 3])


def _run_step_and_check(accepted, order):
    """Run the step through the layer's own dispatch (the real builder,
    linear_attention_prefill_and_mix, the lightning prefill kernel and the
    speculative decode kernel under TRITON_INTERPRET), with two of its rows:
    prompt 3's 7-token tail and prompt 4's verify row, in the order the V1
    runner gives them (fork: tail first). Then check the slot the next step
    of prompt 4 reads: window[num_accepted - 1] (the all-rejected case moves
    to window 0 next step, and preprocess_mamba copies that same slot)."""
    md, rows = _metadata(order)
    gen = torch.Generator().manual_seed(0)
    n_tok = sum(r[1] for r in rows)
    q, k, v = (0.15 * torch.randn(n_tok, HEADS, D, generator=gen) for _ in range(3))
    num_blocks = WIDTH * len(PROMPTS) + 1
    # every slot holds something else (stale): random garbage
    kv_cache = torch.randn(num_blocks, HEADS, D, D, generator=gen)
    slope = torch.tensor([0.25, 0.5])
    seq4 = STEP1[4][0] + STEP1[4][1]
    start = (seq4 - 1) // BS  # the window of prompt 4 this step and next
    window = _block_ids(4)[start : start + 1 + K]
    s0 = kv_cache[window[0]].clone()  # where preprocess_mamba put its state
    q4 = sum(STEP1[i][1] for i in order[: order.index(4)])  # its first token
    ref = _ref_states(s0, k[q4:], v[q4:], slope, 1 + K)

    layer = SimpleNamespace(tp_slope=slope, BLOCK=256, layer_idx=0)
    layer._decode_infer = partial(BailingMoELinearAttention._decode_infer, layer)
    clear_linear_attention_cache_for_new_sequences(
        kv_cache, md.state_indices_tensor, md
    )
    if md.num_prefills == 0:
        layer._decode_infer(q, k, v, kv_cache, md.state_indices_tensor, md)
    else:
        BailingMoELinearAttention._prefill_and_mix_infer(
            layer, q, k, v, kv_cache, md.state_indices_tensor, md
        )

    # next step (no drafts, same window: seq_len 35 or 31 -> the same start
    # for the all-accepted case) reads window[accepted - 1]
    got = kv_cache[window[accepted - 1]]
    want = ref[accepted - 1]
    err = (got - want).abs().max().item()
    assert err < 1e-3, (
        f"slot window[{accepted - 1}] = block {window[accepted - 1]} does not "
        f"hold the state after {accepted} tokens (max err {err:.3g}); "
        f"num_decodes={md.num_decodes} num_prefills={md.num_prefills}"
    )


def test_cell_b_mtp_k3_first_wave_step1_order():
    """Cell (B): MTP k=3 (use_eagle: the scheduler backs the prompt's first
    chunk off one more block, scheduler.py:383-385), so prompts 2 (54), 4
    (29) and 6 (62) finish in step 0 and verify (1 + 3 tokens, all drafts
    rejected in that cell) in step 1 among the tails of 0, 1, 3, 5, 7.
    Prompt 2's verify row sits behind two tails: it runs as a prefill and
    folds its 3 rejected drafts into the state the next step reads."""
    k = 3
    step1 = []
    for p in PROMPTS:
        lcp = max(p - p % BS - BS, 0)
        step1.append((p, 1 + k, k) if lcp == 0 else (lcp, p - lcp, 0))
    batch = _Batch()
    batch.num_computed_tokens_cpu = np.array([s[0] for s in step1])
    sched = SimpleNamespace(
        num_scheduled_tokens={f"r{i}": s[1] for i, s in enumerate(step1)},
        scheduled_spec_decode_tokens={
            f"r{i}": [1] * s[2] for i, s in enumerate(step1) if s[2]
        },
    )
    reorder_batch_to_split_decodes_and_prefills(batch, sched, decode_threshold=1)
    order = [int(r[1:]) for r in batch.req_ids]
    rows = [step1[i] for i in order]
    common = _common(step1, order)
    b = _builder(k)
    md = b.build(
        0,
        common,
        num_accepted_tokens=torch.ones(len(rows), dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.tensor(
            [k if step1[i][2] else -1 for i in order], dtype=torch.int32
        ),
    )
    verify_pos = [order.index(i) for i in (2, 4, 6)]
    assert all(p < md.num_decodes for p in verify_pos), (
        f"order {order}: verify rows of prompts 2, 4, 6 at {verify_pos}, "
        f"num_decodes={md.num_decodes}"
    )
