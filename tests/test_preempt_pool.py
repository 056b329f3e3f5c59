"""The preemption cells' KV pools preempt: vLLM's own scheduler and KV cache
manager, on its CPU platform and without a model, run each preemption
cell's requests over the pool the harness gives it (``harness.fuzz_pool``
around vLLM's ``get_kv_cache_configs``, the cell's slack) and count the
requests they preempt.

On the GPU the n-gram k=8 cells reported ``vllm:num_preemptions`` 0 (an
invalid cell) while the scripted k=4 cells preempted: a request holds
1 + k state blocks per Mamba group for its whole life, so at k=8 the least
pool plus 2 admitted two requests, which never outgrew it.

The attention block sizes are the ones the v0.33.0 GPU engines picked for
these cells (``accept.block_size`` in their reports: the platform raises it
until an attention page holds the recurrent state, which grows with k);
both fixtures have three Mamba groups beside one attention group. The pools
the hook gives here (84 and 82 blocks for the n-gram cells before their
slack changed) are the ones in those engines' logs.

The same driver checks that ``decode_latency --refill``'s cap holds vLLM's
scheduler to BS running requests.

Hand-written: vLLM's scheduler tests build their own small configs
(tests/v1/core/utils.py, not in the released package); this drives the
scheduler the same way with the hybrid groups and the harness's pool.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# (fixture, k) -> the attention block size of the GPU engine
BLOCK = {("qwen3_5", 4): 80, ("qwen3_5", 8): 96,
         ("nemotron_h", 4): 144, ("nemotron_h", 8): 160}  # fmt: skip
MAMBA_GROUPS = 3


def test_every_preemption_cell_preempts_in_vllms_scheduler():
    """Each preemption cell of the matrix: more requests are preempted than
    none, with the requests it decodes (16 prompts of 24-200 tokens, each
    growing by PREEMPT_TOKENS) and no drafts (the drafts a step verifies
    come on top of its tokens: they only make a pool tighter)."""
    pytest.importorskip("vllm")
    from conftest import in_cpu_testbed

    rows = in_cpu_testbed(__file__, "_preemptions")
    assert {(r["model"], r["drafter"]) for r in rows} == {
        (m, d) for m in ("qwen3_5", "nemotron_h") for d in ("scripted:random", "ngram")
    }
    for r in rows:
        assert r["finished"] == r["requests"], r
        assert r["preemptions"] > 0, r


def _preemptions() -> list[dict]:
    """One row per preemption cell of v1-matrix-{q,n}-preempt."""
    from harness.equivalence import PREEMPT_TOKENS, make_prompts, slice_cells

    rows = []
    for part in ("q-preempt", "n-preempt"):
        for cell in slice_cells(f"v1-matrix-{part}"):
            assert cell.preempt and cell.max_tokens == PREEMPT_TOKENS
            override = cell.extra.get("num_gpu_blocks_override")
            pool, preempted, finished = _run(
                BLOCK[cell.model, cell.k], cell.k, cell.batch, override,
                make_prompts(16, 0, lo=24, hi=200), PREEMPT_TOKENS,
            )  # fmt: skip
            rows.append({"model": cell.model, "drafter": cell.drafter,
                         "k": cell.k, "pool": pool, "requests": 16,
                         "finished": finished, "preemptions": preempted})  # fmt: skip
    return rows


def _run(bs, k, seqs, override, prompts, max_tokens):
    """(pool blocks, requests preempted, requests finished) of ``prompts``
    decoding ``max_tokens`` each, ``seqs`` at a time, one token a step."""
    sched, kvc, hasher = _scheduler(bs, k, seqs, override)
    preempted, finished, _ = _drive(sched, hasher, prompts, max_tokens)
    return kvc.num_blocks, preempted, finished


def _scheduler(bs, k, seqs, override):
    """vLLM's scheduler over the harness's pool for a cell of attention
    block size ``bs``, n-gram k, ``max_num_seqs`` ``seqs``: (scheduler, its
    KV cache config, the request block hasher)."""
    import inspect
    import tempfile

    import torch
    import vllm.v1.engine.core as core
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from harness import fuzz_pool

    mml = 512
    # the scheduler reads lengths and limits from the model config, not its
    # layers: a tiny text-only config (no multimodal processor to build)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["OPTForCausalLM"], "model_type": "opt",
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "ffn_dim": 128, "vocab_size": 1000, "max_position_embeddings": 2048,
        "word_embed_proj_dim": 64, "torch_dtype": "float16",
    }))  # fmt: skip
    mc = ModelConfig(model=str(folder), dtype="float16", skip_tokenizer_init=True,
                     enforce_eager=True, max_model_len=mml)  # fmt: skip
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=False),
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=SchedulerConfig(
            max_num_seqs=seqs, max_num_batched_tokens=8192, max_model_len=mml,
            enable_chunked_prefill=True, is_encoder_decoder=False,
        ),
        speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=k, prompt_lookup_min=2,
            prompt_lookup_max=min(10, k),
        ),
    )  # fmt: skip
    if hasattr(vc.cache_config, "kv_cache_layout"):
        vc.cache_config.kv_cache_layout = "NHD"  # the engine core resolves it
    att = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64,
                            dtype=torch.float32)  # fmt: skip
    page = att.page_size_bytes
    state = MambaSpec(block_size=mml, shapes=((1,),), dtypes=(torch.float32,),
                      page_size_padded=page, mamba_cache_mode="none",
                      num_speculative_blocks=k)  # fmt: skip
    specs = {f"layers.{i}.mixer": state for i in range(MAMBA_GROUPS)}
    specs["layers.3.attn"] = att
    orig = getattr(core.get_kv_cache_configs, "__wrapped__", core.get_kv_cache_configs)
    args = [vc, [specs], [10**12]]
    if "global_kv_cache_groups" in inspect.signature(orig).parameters:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

        args.append(get_global_kv_cache_groups(vc, [specs]))
    # what harness.equivalence.engine_kwargs asks for a preemption cell
    vc.cache_config.num_gpu_blocks_override = override or fuzz_pool.POOL_BASE + 2
    (kvc,) = fuzz_pool.sized(orig)(*args)
    vc.cache_config.num_gpu_blocks = kvc.num_blocks  # as the engine core sets it
    register_all_kvcache_specs(vc)
    block, hash_block = resolve_kv_cache_block_sizes(kvc, vc)
    sched = Scheduler(vllm_config=vc, kv_cache_config=kvc,
                      structured_output_manager=StructuredOutputManager(vc),
                      block_size=block, hash_block_size=hash_block,
                      log_stats=True)  # fmt: skip
    init_none_hash(sha256)
    return sched, kvc, get_request_block_hasher(bs, sha256)


def _drive(sched, hasher, prompts, max_tokens):
    """Add ``prompts`` and step ``sched`` until they finish, one token a
    step: (requests preempted, requests finished, the most requests running
    after any step)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, 2)
        sched.add_request(Request(request_id=str(i), prompt_token_ids=p,
                                  sampling_params=sp, pooling_params=None,
                                  block_hasher=hasher))  # fmt: skip
    preempted = steps = most = 0
    # a hang guard only: each step decodes a token of every running request
    bound = 100 * len(prompts) * max_tokens
    while sched.get_num_unfinished_requests() and steps < bound:
        out = sched.schedule()
        steps += 1
        most = max(most, len(sched.running))
        preempted += len(getattr(out, "preempted_req_ids", None) or ())
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = sched.requests[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid]
            sampled.append([] if done < req.num_tokens else [5])  # mid-prefill
        sched.update_from_output(
            out,
            ModelRunnerOutput(req_ids=ids,
                              req_id_to_index={r: n for n, r in enumerate(ids)},
                              sampled_token_ids=sampled),
        )  # fmt: skip
    finished = len(prompts) - sched.get_num_unfinished_requests()
    return preempted, finished, most


def test_refill_cap_holds_vllms_scheduler_to_bs_running():
    """``decode_latency --refill`` keeps BS requests in flight by lowering
    the in-process scheduler's own admission limit; vLLM's scheduler, with
    ``max_num_seqs`` 16 and a pool that holds all 12 requests at once,
    runs at most 4 at once under a cap of 4, all finish, and the limit is
    back at 16 afterwards; without the cap it runs all 12 together."""
    pytest.importorskip("vllm")
    from conftest import in_cpu_testbed

    got = in_cpu_testbed(__file__, "_refilled")
    assert got == {"most": 4, "finished": 12, "restored": True, "uncapped": 12}


def _refilled() -> dict:
    from types import SimpleNamespace

    from benchmarks.decode_latency import concurrency_cap
    from harness.equivalence import make_prompts

    # a pool that holds all 12 at once (2,000 blocks): without the cap
    # vLLM runs all of them together
    sched, _, hasher = _scheduler(80, 4, 16, 2000)
    before = {n: getattr(sched, n) for n in ("max_num_running_reqs",
              "max_num_active_reqs") if hasattr(sched, n)}  # fmt: skip
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(
        engine_core=SimpleNamespace(scheduler=sched))))  # fmt: skip
    with concurrency_cap(llm, 4):
        _, finished, most = _drive(sched, hasher, make_prompts(12, 0, lo=24, hi=60), 8)
    after = {n: getattr(sched, n) for n in before}
    # the control: the same requests on a scheduler of its own, no cap
    free, _, free_hasher = _scheduler(80, 4, 16, 2000)
    _, _, uncapped = _drive(free, free_hasher, make_prompts(12, 0, lo=24, hi=60), 8)
    return {"most": most, "finished": finished, "restored": after == before,
            "uncapped": uncapped}  # fmt: skip
