# SPDX-License-Identifier: Apache-2.0
"""s3-3 at scheduler level (CPU): the real v0.33.0 (fork) Scheduler, sync
scheduling, MRV2 semantics, MTP k=4 (num_lookahead_tokens=4,
num_prefill_lookahead_tokens=1, num_hash_lookahead_tokens=1), prefix caching,
chunked prefill budget 80, max_num_seqs 16, and a hand-made hybrid
KVCacheConfig of three groups in ONE block pool:
  g0 target FullAttentionSpec(80), g1 draft FullAttentionSpec(80) flagged
  is_eagle_group, g2 MambaSpec(80, align, num_speculative_blocks=4).

A fake MRV2 runner keeps append-only block tables per (request, group)
(NewRequestData / CachedRequestData.new_block_ids; replaced on resume) and a
content model of every PAGE (block id). Pages alias across groups (the fork
overlays the groups' bytes), so a page holds either attention slots (tagged by
group) or one Mamba state. Every write is checked against the scheduler's
ownership at that step; every wave-2 prefix hit is checked for content.

Writes modelled per scheduled row (c = computed before the step, q = query
length, n = drafts, a = accepted+1):
  target KV : positions [c, c+q)         via g0 table[pos // 80]
  draft KV  : positions [c, c+q) (draft prefill reuses target slot mapping)
              + AR steps at [c+a, c+a+k-1)   via g1 table
  Mamba     : preprocess_mamba_align_fused_kernel + precopy (src = prev
              state_idx + max(num_acc-1,0) -> dst = cdiv(c+q,80)-1 when the
              column changes), forward (spec rows: bt[r+t] = state after
              c+t+1 query tokens, t < q; prefill rows: bt[r] = state after c+q),
              postprocess_align (T = new_c - a + 1, aligned = new_c//80*80,
              copy bt[r + aligned - T] -> bt[aligned//80 - 1] when aligned >= T).
"""
import hashlib
import os
from unittest import mock

import pytest
import torch

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.utils.hashing import sha256

K, BS, MAXLEN, BUDGET = 4, 80, 2048, 80
TINY = os.path.join(os.path.dirname(__file__), "tiny")
# harness.equivalence.make_prompts(24, 17094, lo=24, hi=200) lengths (s3-3's
# prompt_seed and band 2, computed with the harness)
S3_3_LENS = [93, 33, 127, 144, 184, 48, 52, 158, 38, 145, 84, 117, 32, 121, 124,
             44, 25, 120, 50, 199, 105, 117, 70, 90]


def _tok(*key) -> int:
    return 10 + int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=4).digest(), "little") % 240


def _scheduler(num_blocks: int) -> Scheduler:
    mc = ModelConfig(model=TINY, dtype="float16", seed=0, skip_tokenizer_init=True,
                     max_model_len=MAXLEN)
    vc = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=BUDGET,
                                         max_model_len=MAXLEN, enable_chunked_prefill=True,
                                         is_encoder_decoder=False, watermark=0.0,
                                         async_scheduling=False),
        model_config=mc,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True,
                                 mamba_cache_mode="align"),
        # any method the CPU config accepts; the MTP-specific numbers are
        # patched in below (VllmConfig properties read by Scheduler.__init__)
        speculative_config=SpeculativeConfig(method="ngram_gpu", num_speculative_tokens=K,
                                             prompt_lookup_min=1, prompt_lookup_max=K),
    )
    vc.cache_config.num_gpu_blocks = num_blocks
    vc.cache_config.mamba_block_size = BS
    groups = [
        KVCacheGroupSpec(["model.layers.3.self_attn.attn"], FullAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)),
        KVCacheGroupSpec(["mtp.layers.0.self_attn.attn"], FullAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32),
            is_eagle_group=True),
        KVCacheGroupSpec(["model.layers.0.linear_attn"], MambaSpec(
            block_size=BS, shapes=((1, 1), (1, 1)), dtypes=(torch.float32, torch.float32),
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align",
            num_speculative_blocks=K)),
    ]
    register_all_kvcache_specs(vc)
    P = lambda v: property(lambda self: v)  # noqa: E731
    with mock.patch.object(VllmConfig, "num_lookahead_tokens", P(K)), \
         mock.patch.object(VllmConfig, "num_prefill_lookahead_tokens", P(1)), \
         mock.patch.object(VllmConfig, "num_hash_lookahead_tokens", P(1)), \
         mock.patch.object(VllmConfig, "use_v2_model_runner", P(True)):
        s = Scheduler(vllm_config=vc,
                      kv_cache_config=KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                                    kv_cache_groups=groups),
                      structured_output_manager=StructuredOutputManager(vc),
                      block_size=BS, hash_block_size=BS, log_stats=False)
    s.use_eagle = True
    assert s.use_v2_model_runner and s.num_lookahead_tokens == K
    assert s.num_hash_lookahead_tokens == 1 and s.num_prefill_lookahead == 1
    assert s.use_eagle_block_drop is False
    return s


def _boundary(step: int, length: int) -> int:
    """harness.drafter.boundary: drafts so that length+n ends on (even step)
    or one past (odd step) a block boundary, capped at k."""
    to_b = (-length) % BS
    n = to_b if step % 2 == 0 else to_b + 1
    return min(max(n, 0), K)


def _rolling(seq):
    out = [hash(())]
    h = out[0]
    for t in seq:
        h = hash((h, t))
        out.append(h)
    return out  # out[L] = key of seq[:L]


class Sim:
    def __init__(self, num_blocks, wave2_drafts="boundary", lens=S3_3_LENS, max_tokens=128):
        init_none_hash(sha256)
        self.sched = _scheduler(num_blocks)
        self.hasher = get_request_block_hasher(BS, sha256, 1)  # EngineCore passes num_hash_lookahead_tokens
        self.mgr = self.sched.kv_cache_manager.coordinator.single_type_managers
        self.wave2_drafts = wave2_drafts
        self.lens, self.max_tokens = lens, max_tokens
        self.table = {}        # rid -> [g0 cols, g1 cols, g2 cols] (append-only)
        self.state_idx = {}    # rid -> running Mamba column (MRV2 _mamba_state_idx)
        self.num_acc = {}      # rid -> num_accepted_tokens_gpu
        self.page = {}         # block id -> ("A", g, {slot: key}) | ("M", key)
        self.page_writer = {}  # block id -> (step, rid, group, col, what)
        self.dsteps = {}       # rid -> propose calls (boundary rule's step)
        self.ans = {}          # rid -> the model's (greedy) answer tokens
        self.step = 0
        self.viol = []         # ownership violations of writes
        self.read_viol = []    # reads from pages the request doesn't own
        self.hit_bad = []      # wave-2 hits whose content is wrong
        self.hit_info = []     # per wave-2 request geometry
        self.draft_hit_bad = 0  # draft-KV content wrong on a hit (affects drafts only)
        self.draft_hit_detail = []
        self.pad_rows = []
        self.chunk_cross = []  # prefill chunk crossing a boundary before its end
        self.mamba_read_bad = []  # a forward reads a state that isn't tokens[:c]
        self.max_c = {}

    # ------------------------------------------------------------ helpers
    def owner_cols(self):
        own = {}
        for g, m in enumerate(self.mgr):
            for rid, blocks in m.req_to_blocks.items():
                own[(rid, g)] = [b.block_id for b in blocks]
        return own

    def where(self, b):
        out = []
        for g, m in enumerate(self.mgr):
            for rid, blocks in m.req_to_blocks.items():
                for i, x in enumerate(blocks):
                    if x.block_id == b and not x.is_null:
                        out.append((rid, g, i))
        cached = b < len(self.sched.kv_cache_manager.block_pool.blocks) and \
            self.sched.kv_cache_manager.block_pool.blocks[b].block_hash is not None
        return out, cached

    def _check(self, own, rid, g, col, what, kind="w"):
        tbl = self.table[rid][g]
        if col < 0 or col >= len(tbl):
            (self.viol if kind == "w" else self.read_viol).append(
                dict(step=self.step, rid=rid, group=g, col=col, what=what, page=None,
                     why="column beyond runner table"))
            return None
        b = tbl[col]
        sc = own.get((rid, g), [])
        ok = col < len(sc) and sc[col] == b and b != 0
        if not ok:
            o, cached = self.where(b)
            (self.viol if kind == "w" else self.read_viol).append(
                dict(step=self.step, rid=rid, group=g, col=col, what=what, page=b,
                     sched_col=(sc[col] if col < len(sc) else "beyond"),
                     page_owners=o, page_hashed=cached))
        return b

    def _w_attn(self, own, rid, g, pos, key, what):
        b = self._check(own, rid, g, pos // BS, what)
        if b is None or b == 0:
            return
        pg = self.page.get(b)
        if pg is None or pg[0] != "A" or pg[1] != g:
            pg = ("A", g, {})
            self.page[b] = pg
        pg[2][pos % BS] = key
        self.page_writer[b] = (self.step, rid, g, pos // BS, what)

    def _w_mamba(self, own, rid, col, key, what):
        b = self._check(own, rid, 2, col, what)
        if b is None or b == 0:
            return
        self.page[b] = ("M", key)
        self.page_writer[b] = (self.step, rid, 2, col, what)

    def _r_mamba(self, own, rid, col, what):
        b = self._check(own, rid, 2, col, what, kind="r")
        if b is None:
            return None
        pg = self.page.get(b)
        return pg[1] if pg is not None and pg[0] == "M" else ("corrupt", b)

    # ------------------------------------------------------------ runner
    def execute(self, so):
        self.step += 1
        s = self.sched
        for nr in so.scheduled_new_reqs:
            rid = nr.req_id
            self.table[rid] = [list(x) for x in nr.block_ids]
            H = nr.num_computed_tokens
            # MambaHybrid add_request: running column seeded at (H-1)//80
            self.state_idx[rid] = (H - 1) // BS if H > 0 else -1
            self.num_acc[rid] = 1
            if rid.startswith("w2-") and H >= 0:
                self.check_hit(rid, H, nr)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                self.table[rid] = [list(x) for x in nb]
                H = cr.num_computed_tokens[i]
                self.state_idx[rid] = (H - 1) // BS if H > 0 else -1
                self.num_acc[rid] = 1
            elif nb is not None:
                for g, ids in enumerate(nb):
                    self.table[rid][g].extend(ids)
        own = self.owner_cols()
        new_c = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        for i, rid in enumerate(cr.req_ids):
            new_c[rid] = cr.num_computed_tokens[i]
        ids = list(so.num_scheduled_tokens)
        sampled = {}
        post = []
        for rid in ids:
            q = so.num_scheduled_tokens[rid]
            req = s.requests[rid]
            c = new_c[rid]
            assert c == req.num_computed_tokens - q, (rid, c, req.num_computed_tokens, q)
            drafts = list(so.scheduled_spec_decode_tokens.get(rid, ()))
            n = len(drafts)
            toks = list(req.all_token_ids)
            known = toks[: c + q - n]
            seq = known + drafts
            is_prefill = c < req.num_prompt_tokens and not (drafts and all(d == -1 for d in drafts))
            prefill_as_decode = bool(drafts) and all(d == -1 for d in drafts)
            if prefill_as_decode:
                self.pad_rows.append((self.step, rid, c, q))
            # sampling: the row samples when its query reaches the last known token
            samples = c + q - n >= len(toks)
            o = req.num_output_tokens
            if samples:
                a = 0
                while a < n and drafts[a] == self.ans[rid][o + a]:
                    a += 1
                out = self.ans[rid][o: o + a + 1]
                sampled[rid] = out
                acc = a + 1
            else:
                sampled[rid] = []
                acc = 0
            # all tokens known after the step (a prefill chunk knows its whole
            # prompt: MRV2 feeds next_prefill_tokens to the drafter)
            true_after = toks[: c + q - n] + sampled[rid] if samples else toks
            keys_seq = _rolling(seq)
            keys_true = _rolling(true_after)
            # ---- Mamba preprocess (state advance + pre-copy)
            prev = self.state_idx[rid]
            src_off = max(self.num_acc[rid] - 1, 0)
            r = (c + q + BS - 1) // BS - 1
            if prev >= 0 and prev != r:
                self.num_acc[rid] = 1
                st = self._r_mamba(own, rid, prev + src_off, "precopy-src")
                self._w_mamba(own, rid, r, st, "precopy-dst")
            self.state_idx[rid] = r
            # ---- forward: target KV
            for p in range(c, c + q):
                self._w_attn(own, rid, 0, p, keys_seq[p + 1], "target-kv")
            # ---- forward: GDN
            exp0 = keys_true[c] if c <= len(true_after) else None
            if is_prefill:
                if (c // BS) != ((c + q - 1) // BS) and (c + q) % BS != 0:
                    self.chunk_cross.append((self.step, rid, c, q))
                if c > 0:
                    st = self._r_mamba(own, rid, r, "prefill-read")
                    if st != exp0:
                        self.mamba_read_bad.append((self.step, rid, "prefill", c, q, r))
                self._w_mamba(own, rid, r, keys_seq[c + q], "prefill-state")
            else:
                st = self._r_mamba(own, rid, r + self.num_acc[rid] - 1, "spec-read")
                if st != exp0:
                    self.mamba_read_bad.append((self.step, rid, "spec", c, q, r, self.num_acc[rid]))
                for t in range(q):
                    self._w_mamba(own, rid, r + t, keys_seq[c + t + 1], f"spec-state t={t}")
            # ---- draft (MTP) KV: draft prefill over the query, then k-1 AR steps
            n_rej = (n + 1 - acc) if samples else 0
            for p in range(c, c + q):
                ok = p + 1 < len(true_after) and p < c + q - n_rej
                key = keys_true[p + 2] if ok else ("garbage", self.step)
                self._w_attn(own, rid, 1, p, key, "draft-prefill-kv")
            base = c + q - n_rej
            for st_ in range(K - 1):
                p = base + st_
                if p < MAXLEN:
                    self._w_attn(own, rid, 1, p, ("garbage-ar", self.step), f"draft-ar{st_}-kv")
            post.append((rid, r, c + q - n_rej, acc))
            self.max_c[rid] = c + q - n_rej
        # ---- Mamba postprocess (align)
        for rid, r, nc, acc in post:
            self.num_acc[rid] = max(acc, 1)
            T = nc - self.num_acc[rid] + 1
            aligned = nc // BS * BS
            if aligned >= T and aligned > 0:
                bias = aligned - T
                dest = aligned // BS - 1
                if r == dest:
                    self.num_acc[rid] = 1
                if not (r == dest and bias == 0):
                    st = self._r_mamba(own, rid, r + bias, "post-src")
                    self._w_mamba(own, rid, dest, st, f"postprocess dest (bias {bias})")
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=[sampled[r] for r in ids], logprobs=None,
                                 prompt_logprobs_dict={}, pooler_output=[])

    def check_hit(self, rid, H, nr):
        req = self.sched.requests[rid]
        Q = req.num_prompt_tokens
        toks = list(req.all_token_ids)
        keys = _rolling(toks)
        info = dict(rid=rid, Q=Q, Q_mod_80=Q % BS, H=H, step=self.step,
                    hash_block_size=self.sched.hash_block_size)
        bad = []
        if H > 0:
            h = H // BS
            assert H % BS == 0, ("non-aligned hit", rid, H)
            for g in (0, 1):
                for col in range(h):
                    b = self.table[rid][g][col]
                    pg = self.page.get(b)
                    for slot in range(BS):
                        p = col * BS + slot
                        want = keys[p + 1] if g == 0 else (keys[p + 2] if p + 2 <= len(toks) else None)
                        got = pg[2].get(slot) if pg is not None and pg[0] == "A" and pg[1] == g else None
                        if got != want:
                            if g == 0:
                                bad.append(dict(group=g, col=col, page=b, slot=slot,
                                                last_writer=self.page_writer.get(b)))
                            else:
                                self.draft_hit_bad += 1
                                self.draft_hit_detail.append((rid, col, slot, p, got if not isinstance(got, int) else "other-int", self.page_writer.get(b)))
                            break
            b = self.table[rid][2][h - 1]
            pg = self.page.get(b)
            if not (pg is not None and pg[0] == "M" and pg[1] == keys[H]):
                bad.append(dict(group=2, col=h - 1, page=b, last_writer=self.page_writer.get(b),
                                content=("M-other-prefix" if pg and pg[0] == "M" else pg and pg[0])))
            info["mamba_hit_writer"] = self.page_writer.get(b)
        if bad:
            self.hit_bad.append(dict(info, bad=bad))
        self.hit_info.append(info)

    # ------------------------------------------------------------ driver
    def add(self, rid, prompt):
        sp = SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)
        r = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                    pooling_params=None, block_hasher=self.hasher)
        self.ans[rid] = [_tok(rid, i) for i in range(self.max_tokens + K + 2)]
        self.sched.add_request(r)
        return r

    def run_wave(self, wave_reqs):
        s = self.sched
        guard = 0
        while s.has_requests() and guard < 20000:
            guard += 1
            so = s.schedule()
            out = self.execute(so)
            s.update_from_output(so, out)
            # EngineCore.post_step: drafts for the rows that sampled
            ids, dts = [], []
            for rid, toks in zip(out.req_ids, out.sampled_token_ids):
                req = s.requests.get(rid)
                if not toks or req is None or req.is_finished():
                    continue
                o = req.num_output_tokens
                if rid.startswith("w1-") or self.wave2_drafts == "boundary":
                    step = self.dsteps.get(rid, 0)
                    self.dsteps[rid] = step + 1
                    n = _boundary(step, req.num_tokens)
                    d = self.ans[rid][o: o + n]
                elif self.wave2_drafts == "mtp_wrong":
                    d = [(x + 1) % 250 + 10 for x in self.ans[rid][o: o + K]]
                else:  # mtp_right
                    d = self.ans[rid][o: o + K]
                ids.append(rid)
                dts.append(d)
            s.update_draft_token_ids(DraftTokenIds(ids, dts))
        return [r.is_finished() for r in wave_reqs]

    def run(self):
        w1 = []
        for i, L in enumerate(self.lens):
            prompt = [i % 250, 0, 7, 7, 7, 7, 7, 7] + [_tok("p", i, j) for j in range(L - 8)]
            w1.append(self.add(f"w1-{i}", prompt[:L]))
        fin1 = self.run_wave(w1)
        w2 = []
        for i, r in enumerate(w1):
            outs = list(r.output_token_ids)
            assert outs == self.ans[r.request_id][: len(outs)]
            keep = outs[: len(outs) * 3 // 4]
            prompt = list(r.prompt_token_ids) + keep + [_tok("tail", i, j) for j in range(4)]
            w2.append(self.add(f"w2-{i}", prompt))
        fin2 = self.run_wave(w2)
        self.preemptions = sum(r.num_preemptions for r in w1 + w2)
        return all(fin1) and all(fin2)


def _report(sim):
    print(f"\nsteps={sim.step} hash_block_size={sim.sched.hash_block_size} "
          f"preemptions={sim.preemptions}")
    print(f"write violations={len(sim.viol)} read violations={len(sim.read_viol)} "
          f"hit content bad={len(sim.hit_bad)} draft-KV hit mismatches={sim.draft_hit_bad} "
          f"mamba reads of wrong prefix={len(sim.mamba_read_bad)} pad rows={len(sim.pad_rows)} "
          f"chunk crossing boundary={len(sim.chunk_cross)}")
    for v in sim.viol[:6]:
        print("  VIOL", v)
    for v in sim.read_viol[:4]:
        print("  RVIOL", v)
    for v in sim.hit_bad[:6]:
        print("  HITBAD", v)
    for v in sim.draft_hit_detail[:4]:
        print("  DRAFT-HIT", v)
    for v in sim.mamba_read_bad[:6]:
        print("  MREAD", v)
    print("  pad rows:", sim.pad_rows[:10])
    for h in sim.hit_info:
        print("  W2", h)


@pytest.mark.parametrize("num_blocks", [200, 400, 2000])
@pytest.mark.parametrize("wave2_drafts", ["boundary", "mtp_wrong", "mtp_right"])
def test_s3_3_shape(num_blocks, wave2_drafts):
    sim = Sim(num_blocks, wave2_drafts)
    done = sim.run()
    _report(sim)
    assert done
    assert not sim.viol, sim.viol[:3]
    assert not sim.hit_bad, sim.hit_bad[:3]
    assert not sim.mamba_read_bad, sim.mamba_read_bad[:3]
