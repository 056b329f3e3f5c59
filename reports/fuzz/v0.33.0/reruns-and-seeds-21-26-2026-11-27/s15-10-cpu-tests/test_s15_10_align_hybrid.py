# SPDX-License-Identifier: Apache-2.0
"""s15-10 shape at scheduler level (CPU): async scheduling, k=3 drafts with
draft-model lookahead (3 KV slots), Qwen3.5-like hybrid KV config (one
attention group + one GDN group in mamba_cache_mode="align", block 80,
3 speculative state blocks), prefix caching on, budget 24, 16 requests with
4-16 token prompts, and a pool of 27 blocks (the fuzzer's "least + 16").

A fake V1 runner keeps its own append-only block tables (NewRequestData /
CachedRequestData, replaced on resume) and its exact num_computed (it knows
its own rejections). For every executed step it checks, per scheduled row:
  (a) placeholder rows: drafts scheduled for a row that was not a sampled row
      of the step before (V1 cannot fill them; verified as token 0),
  (b) the Mamba window the GDN kernels read/write in align mode
      (columns (seq_len-1)//80 .. +3 of the runner's table, seq_len from the
      runner's exact num_computed) holds no block that the scheduler has
      meanwhile handed to ANOTHER request (any group: shared pool),
  (c) the attention/draft-KV slots written (positions num_computed ..
      num_computed+n-1+k) fall in blocks the request still owns.
"""
import random
from collections import deque

import pytest
import torch

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

K, BS, MAXLEN = 3, 80, 400


def _scheduler(num_blocks: int, budget: int) -> AsyncScheduler:
    mc = ModelConfig(model="/tmp/s15-10/tiny", dtype="float16", seed=42,
                     skip_tokenizer_init=True, max_model_len=MAXLEN)
    vc = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget,
                                         max_model_len=MAXLEN, enable_chunked_prefill=True,
                                         is_encoder_decoder=False, watermark=0.0,
                                         async_scheduling=True),
        model_config=mc,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True,
                                 mamba_cache_mode="align"),
        speculative_config=SpeculativeConfig(method="ngram_gpu", num_speculative_tokens=K,
                                             prompt_lookup_min=1, prompt_lookup_max=K),
    )
    vc.cache_config.num_gpu_blocks = num_blocks
    vc.cache_config.mamba_block_size = BS
    groups = [
        KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size=BS, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32)),
        KVCacheGroupSpec(["linear_attn"], MambaSpec(
            block_size=BS, shapes=((1, 1), (1, 1)), dtypes=(torch.float32, torch.float32),
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align",
            num_speculative_blocks=K)),
    ]
    register_all_kvcache_specs(vc)
    s = AsyncScheduler(vllm_config=vc,
                       kv_cache_config=KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                                     kv_cache_groups=groups),
                       structured_output_manager=StructuredOutputManager(vc),
                       block_size=BS, hash_block_size=BS, log_stats=False)
    s.use_v2_model_runner = False
    s.num_lookahead_tokens = K  # draft_model: VllmConfig.num_lookahead_tokens == k
    return s


def _run(num_blocks, budget=24, seed=0, accept_p=0.07):
    init_none_hash(sha256)
    rng = random.Random(seed)
    sched = _scheduler(num_blocks, budget)
    hasher = get_request_block_hasher(BS, sha256)
    reqs = []
    for i in range(16):
        plen = rng.randint(4, 16)
        sp = SamplingParams(max_tokens=128, ignore_eos=True)
        r = Request(request_id=str(i), prompt_token_ids=[rng.randrange(250) for _ in range(plen)],
                    sampling_params=sp, pooling_params=None, block_hasher=hasher)
        reqs.append(r)
        sched.add_request(r)

    table: dict[str, list[list[int]]] = {}   # runner block tables (append-only)
    real_c: dict[str, int] = {}               # runner's exact num_computed
    prev_rows: set[str] = set()
    issues = {"placeholder_rows": [], "mamba_window_foreign": [], "kv_slot_foreign": []}
    queue: deque = deque()
    tok = [1000]
    mgr = sched.kv_cache_manager.coordinator.single_type_managers

    def owners():
        own = {}
        for g, m in enumerate(mgr):
            for rid, blocks in m.req_to_blocks.items():
                for b in blocks:
                    if not b.is_null:
                        own.setdefault(b.block_id, set()).add(rid)
        return own

    def execute(so):
        nonlocal prev_rows
        for nr in so.scheduled_new_reqs:
            table[nr.req_id] = [list(x) for x in nr.block_ids]
            real_c[nr.req_id] = nr.num_computed_tokens
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                table[rid] = [list(x) for x in nb]
                real_c[rid] = cr.num_computed_tokens[i]
            elif nb is not None:
                for g, ids in enumerate(nb):
                    table[rid][g].extend(ids)
        own = owners()
        rows, sampled = set(), {}
        for rid, n in so.num_scheduled_tokens.items():
            drafts = so.scheduled_spec_decode_tokens.get(rid, ())
            if drafts and rid not in prev_rows:
                issues["placeholder_rows"].append((so_idx[0], rid))
            c = real_c[rid]
            seq = c + n
            start = (seq - 1) // BS
            for col in range(start, start + 1 + K):
                if col < len(table[rid][1]):
                    b = table[rid][1][col]
                    o = own.get(b, set())
                    if b != 0 and o and rid not in o:
                        issues["mamba_window_foreign"].append((so_idx[0], rid, col, b, sorted(o)))
            for pos in range(c, min(seq + K, MAXLEN)):
                col = pos // BS
                if col < len(table[rid][0]):
                    b = table[rid][0][col]
                    o = own.get(b, set())
                    if o and rid not in o:
                        issues["kv_slot_foreign"].append((so_idx[0], rid, pos, b, sorted(o)))
            r = sched.requests[rid]
            if seq >= r.num_tokens - (len(drafts)) and (drafts or seq >= r.num_prompt_tokens):
                acc = 0
                while acc < len(drafts) and rng.random() < accept_p:
                    acc += 1
                sampled[rid] = list(range(tok[0], tok[0] + 1 + acc))
                tok[0] += 1 + acc
                real_c[rid] = seq - (len(drafts) - acc)
                rows.add(rid)
            else:
                sampled[rid] = []
                real_c[rid] = seq
        prev_rows = rows
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=[sampled[r] for r in ids], logprobs=None,
                                 prompt_logprobs_dict={}, pooler_output=[])

    so_idx = [0]
    steps = 0
    while (sched.has_requests() or queue) and steps < 20000:
        steps += 1
        if sched.has_requests() and len(queue) < 2:
            so = sched.schedule()
            so_idx[0] += 1
            queue.appendleft((so, execute(so) if so.total_num_scheduled_tokens else None))
            if len(queue) < 2:
                continue
        so, out = queue.pop()
        if out is not None:
            sched.update_from_output(so, out)
    npre = sum(r.num_preemptions for r in reqs)
    done = sum(r.is_finished() for r in reqs)
    return issues, npre, done, so_idx[0]


@pytest.mark.parametrize("num_blocks", [27, 200])
def test_s15_10_shape(num_blocks):
    issues, npre, done, nsteps = _run(num_blocks)
    print(f"\npool={num_blocks} steps={nsteps} preemptions={npre} finished={done}/16")
    for k, v in issues.items():
        print(f"  {k}: {len(v)}  e.g. {v[:4]}")
    assert done == 16
    assert not issues["mamba_window_foreign"] and not issues["kv_slot_foreign"]
    assert not issues["placeholder_rows"]
