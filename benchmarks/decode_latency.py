"""Per-step decode latency of one vLLM install, one engine, one mode.

    python -m benchmarks.decode_latency --mode none --variant fork \\
        --batch-sizes 1,8,32,64 --out out/none-fork.json

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, V1 runner) on a
Qwen3.5-9B-shaped model with dummy weights (``load_format="dummy"``; the
config is ``hsfork.fixtures.qwen3_5_9b``, plus a word-level tokenizer written
here). One engine serves every batch size of the mode:

- ``none``: no speculation;
- ``ngram_nomatch``: n-gram (prompt lookup) speculation that never matches:
  prompts of distinct random tokens and random sampling (temperature 1 over
  the 248k vocabulary of a dummy-weight model, whose logits are near-uniform),
  so no n-gram of the context recurs; the scheduled drafts are counted and
  must be 0;
- ``scripted70``: the scripted drafter (``benchmarks.scripted``) proposing k
  drafts per step with an accepted prefix drawn for a 70% expected
  acceptance rate, against greedy references made by this engine (see
  :func:`measure_scripted`);
- ``mtp``: the model's own MTP layer drafting ``--mtp-k`` tokens (greedy;
  with dummy weights its drafts are rarely accepted, so this measures the
  cost of verify steps of 1 + k tokens). ``--runner mrv2`` runs it on Model
  Runner V2, ``--kv-cache-dtype turboquant_*`` with a TurboQuant KV cache
  (``--tq-cudagraph downgrade``: TurboQuant's CUDA graph support lowered to
  single-token decodes, the workaround of upstream issue 40880).

``--label`` names the mode in the JSON and the reports (default: the mode),
so that one mode on two runners or caches reports as two rows.

Timing: the in-process engine's ``get_output`` (``EngineCore.step`` plus
``post_step``: schedule, model forward, sampling, drafting, output update;
it ends in a device-to-host copy of the sampled tokens, so no extra
synchronization is needed) is wrapped with ``time.perf_counter``, and the
scheduler's ``schedule`` is wrapped to classify each step. A step is a
*decode* step when none of its rows is a prefill (a new request, or a cached
one whose computed tokens are still short of its prompt); prefill and mixed
steps are excluded. Per batch size the latency statistics are taken over the
full-batch decode steps (all BS requests in the step).

``--refill``: instead of ``rounds`` closed batches of BS requests (each ends
with its slowest request, which under speculation with per-request
acceptance runs the tail alone), the ``rounds`` x BS requests are submitted
at once and the scheduler keeps at most BS of them running, so a finished
request's slot goes to the next one, as on a server at concurrency BS. The
row's ``tokens_per_s`` is then the in-flight throughput: every token emitted
over the time of every step, prefill rows of newcomers included, up to the
step that admits the last request (the batch then drains). vLLM has no
per-step knob for this; the cap is the in-process scheduler's own
admission limit (``max_num_running_reqs``, and ``max_num_active_reqs``
where the base has it), lowered for the run and restored.

One JSON object per process, rewritten after each batch size.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks import BenchError

SCHEMA = "hsfork-decode-latency/1"
MODES = ("none", "ngram_nomatch", "scripted70", "mtp")
DEFAULT_MODEL_DIR = "/tmp/hsfork-bench/qwen3_5_9b"
# Qwen3.5 special ids (hsfork.fixtures / the published tokenizer)
EOS_ID = 248044
SPECIALS = {
    EOS_ID: "<|endoftext|>",
    248053: "<|vision_start|>",
    248054: "<|vision_end|>",
    248056: "<|image_pad|>",
    248057: "<|video_pad|>",
}
# prompt tokens are drawn from [PROMPT_LO, PROMPT_HI): below the special ids
PROMPT_LO, PROMPT_HI = 1000, 240000


# ---------------------------------------------------------------------------
# arguments


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from e
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return values


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"need LO,HI: {text!r}") from e
    if not 8 <= a <= b:
        raise argparse.ArgumentTypeError(f"need 8 <= LO <= HI: {text!r}")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_latency",
        description="per-step decode latency of one vLLM install (one mode)",
    )
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--label", default=None, help="mode name in the report")
    ap.add_argument("--variant", default="unknown", help="label: fork | upstream")
    ap.add_argument("--repeat", type=int, default=0, help="label: repeat index")
    ap.add_argument("--out", required=True, help="JSON file to (re)write")
    ap.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32, 64])
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens per run")
    ap.add_argument("--warmup-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="measured runs per BS")
    ap.add_argument(
        "--refill",
        action="store_true",
        help="submit rounds x BS requests at once with at most BS running "
        "(a server at concurrency BS) instead of rounds closed batches",
    )
    ap.add_argument("--prompt-len", type=_range, default=(256, 512), help="LO,HI")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sampling",
        choices=("auto", "greedy", "random"),
        default="auto",
        help="auto: random (temperature 1) for none and ngram_nomatch, "
        "greedy for scripted70 (which needs it) and mtp",
    )
    ap.add_argument("--mtp-k", type=int, default=3)
    ap.add_argument("--runner", choices=("v1", "mrv2"), default="v1")
    ap.add_argument(
        "--cache-mode",
        choices=("none", "align"),
        default="none",
        help="align: prefix caching with the recurrent state cached at block "
        "boundaries (mamba_cache_mode='align' where the line takes it)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="e.g. turboquant_k8v4 (TurboQuant prefill falls back to SDPA "
        "where FlashAttention 2 is missing)",
    )
    ap.add_argument(
        "--tq-cudagraph",
        choices=("default", "downgrade"),
        default="default",
        help="downgrade: TurboQuant's CUDA graph support set to "
        "UNIFORM_SINGLE_TOKEN_DECODE (spec-verify steps leave full graphs)",
    )
    ap.add_argument("--ngram-k", type=int, default=8)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=10)
    ap.add_argument("--scripted-k", type=int, default=4)
    ap.add_argument("--accept-rate", type=float, default=0.7)
    ap.add_argument(
        "--trace",
        default=None,
        help="scripted70: replay these recorded (drafts, accepted) per step "
        "and request (harness.traces) instead of --accept-rate",
    )
    ap.add_argument(
        "--draft-policy",
        choices=("fixed", "acceptance"),
        default="fixed",
        help="scripted70: acceptance cuts each request's scripted drafts "
        "with the fork's per-request draft-length policy "
        "(vllm.v1.spec_decode.dynamic.acceptance), fed with the scripted rows",
    )
    ap.add_argument(
        "--uniform-draft-padding",
        action="store_true",
        help="scripted70 and ngram_nomatch: the fork's uniform_draft_padding "
        "(v0.26.0 stable patch 38): a step whose requests carry drafts, not "
        "all of them k, has them padded to k with rejected placeholders and "
        "replays the verify graph instead of running piecewise",
    )
    ap.add_argument(
        "--draft-token-cost",
        type=float,
        default=0.005,
        help="--draft-policy acceptance: its step-cost ratio t1/t0",
    )
    ap.add_argument(
        "--ref-iters",
        type=int,
        default=4,
        help="scripted: speculative reference passes (>= 1; the first is "
        "also the warm-up)",
    )
    ap.add_argument(
        "--attention-backend",
        choices=("FLASH_ATTN", "TRITON_ATTN"),
        default="FLASH_ATTN",
    )
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs/compile")
    ap.add_argument(
        "--capture-sizes",
        type=_int_list,
        default=None,
        help="cudagraph_capture_sizes (default: vLLM's)",
    )
    ap.add_argument(
        "--fixed-fusion",
        action="store_true",
        help="inductor fuses kernels horizontally by its heuristics alone "
        "(combo_kernels on, benchmark_combo_kernel off): the same compiled "
        "graph in every process, where vLLM's default times the candidate "
        "fusions in each process and may compile another graph each run",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    ap.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds after start: no batch size starts that would not end by then",
    )
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    a = ap.parse_args(argv)
    if max(a.batch_sizes) > a.max_num_seqs:
        ap.error(f"batch size {max(a.batch_sizes)} > --max-num-seqs {a.max_num_seqs}")
    k = spec_k(a)
    need = a.prompt_len[1] + a.tokens + k + 3
    if need > a.max_model_len:
        ap.error(f"prompt + tokens + drafts = {need} > --max-model-len")
    if a.tokens < 2 or a.warmup_tokens < 1 or a.rounds < 1:
        ap.error("--tokens >= 2, --warmup-tokens >= 1, --rounds >= 1")
    # a trace replays recorded draft lengths (n-gram up to 64); the hash
    # draws of --accept-rate give at most 32 drafts
    max_k = 64 if a.trace else 32
    if not 1 <= a.scripted_k <= max_k or not 0.0 <= a.accept_rate <= 1.0:
        ap.error(f"--scripted-k in 1..{max_k}, --accept-rate in [0, 1]")
    if a.draft_policy != "fixed" and a.mode != "scripted70":
        ap.error("--draft-policy is for scripted70")
    if a.uniform_draft_padding and a.mode not in ("scripted70", "ngram_nomatch"):
        ap.error("--uniform-draft-padding is for scripted70 and ngram_nomatch")
    if a.mode == "ngram_nomatch" and not (
        a.ngram_k >= 1 and 1 <= a.prompt_lookup_min <= a.prompt_lookup_max
    ):
        ap.error("--ngram-k >= 1 and 1 <= --prompt-lookup-min <= --prompt-lookup-max")
    if a.mode == "scripted70" and a.ref_iters < 1:
        ap.error("--ref-iters must be >= 1")
    if a.mode == "mtp" and not 1 <= a.mtp_k <= 32:
        ap.error("--mtp-k in 1..32")
    if a.tq_cudagraph != "default" and not a.kv_cache_dtype.startswith("turboquant_"):
        ap.error("--tq-cudagraph needs a turboquant_* --kv-cache-dtype")
    if a.label is None:
        a.label = a.mode
    if a.mode == "scripted70" and a.sampling == "random":
        ap.error("scripted70 needs greedy sampling (its drafts follow references)")
    return a


def spec_k(a: argparse.Namespace) -> int:
    return {
        "none": 0,
        "ngram_nomatch": a.ngram_k,
        "scripted70": a.scripted_k,
        "mtp": a.mtp_k,
    }[a.mode]


def sampling_kind(a: argparse.Namespace) -> str:
    if a.sampling != "auto":
        return a.sampling
    return "greedy" if a.mode in ("scripted70", "mtp") else "random"


def spec_config(a: argparse.Namespace) -> dict | None:
    if a.mode == "none":
        return None
    if a.mode == "ngram_nomatch":
        return {
            "method": "ngram",
            "num_speculative_tokens": a.ngram_k,
            "prompt_lookup_min": a.prompt_lookup_min,
            "prompt_lookup_max": a.prompt_lookup_max,
        }
    if a.mode == "mtp":
        return {"method": "mtp", "num_speculative_tokens": a.mtp_k}
    return {
        "method": "custom_class",
        "model": "benchmarks.scripted.RateProposer",
        "num_speculative_tokens": a.scripted_k,
    }


def engine_kwargs(a: argparse.Namespace, model_dir: str) -> dict:
    kw: dict = {
        "model": model_dir,
        "tokenizer": model_dir,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "seed": a.seed,
        "max_model_len": a.max_model_len,
        "max_num_seqs": a.max_num_seqs,
        "gpu_memory_utilization": a.gpu_memory_utilization,
        "enforce_eager": a.eager,
        "attention_backend": a.attention_backend,
        "gdn_prefill_backend": "triton",
        "language_model_only": True,
        "limit_mm_per_prompt": {"image": 0, "video": 0},
        "enable_prefix_caching": a.cache_mode != "none",
        # synchronous steps: each timed step is one schedule + forward + sample
        # (n-gram and custom_class drafting turn async scheduling off anyway)
        "async_scheduling": False,
        "disable_log_stats": True,
    }
    if a.cache_mode != "none":
        from harness import compat

        if compat.passes_mamba_cache_mode():
            kw["mamba_cache_mode"] = a.cache_mode
    if a.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = a.kv_cache_dtype
        # the cache dtype picks its attention backend (TurboQuant's own)
        kw.pop("attention_backend")
    if a.capture_sizes and not a.eager:
        kw["compilation_config"] = {"cudagraph_capture_sizes": sorted(a.capture_sizes)}
    if getattr(a, "fixed_fusion", False) and not a.eager:
        # vLLM sets both keys only when neither is given
        # (CompilationConfig.__post_init__)
        kw.setdefault("compilation_config", {})["inductor_compile_config"] = {
            "combo_kernels": True,
            "benchmark_combo_kernel": False,
        }
    spec = spec_config(a)
    if spec and getattr(a, "uniform_draft_padding", False):
        spec["uniform_draft_padding"] = True
    if spec:
        kw["speculative_config"] = spec
    return kw


# ---------------------------------------------------------------------------
# prompts and model directory


def make_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` prompts of lengths in [lo, hi] whose tokens are all distinct
    (within and across prompts), so no n-gram of any length recurs."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    if int(lengths.sum()) > PROMPT_HI - PROMPT_LO:
        raise ValueError("not enough distinct tokens for these prompts")
    pool = rng.permutation(PROMPT_HI - PROMPT_LO)[: int(lengths.sum())] + PROMPT_LO
    out, start = [], 0
    for n_tok in lengths.tolist():
        out.append(pool[start : start + n_tok].tolist())
        start += n_tok
    return out


def prompt_seed(seed: int, bs: int, purpose: int) -> int:
    return seed * 1_000_003 + bs * 101 + purpose


def tokenizer_json(vocab: int) -> dict:
    """harness.models' word-level tokenizer with Qwen3.5's special ids."""
    from harness.models import tokenizer_json as word_level

    return word_level(vocab, SPECIALS)


def model_vocab() -> int:
    from hsfork.fixtures import qwen3_5_9b

    return int(json.loads(qwen3_5_9b()["config.json"])["text_config"]["vocab_size"])


def model_files() -> dict[str, bytes]:
    from hsfork.fixtures import qwen3_5_9b

    files = dict(qwen3_5_9b())
    vocab = model_vocab()
    files["tokenizer.json"] = json.dumps(tokenizer_json(vocab)).encode()
    files["tokenizer_config.json"] = json.dumps(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": SPECIALS[EOS_ID],
            "pad_token": SPECIALS[EOS_ID],
            "unk_token": "t0",
            "model_max_length": 262144,
        }
    ).encode()
    files["generation_config.json"] = json.dumps(
        {"eos_token_id": EOS_ID, "do_sample": False}
    ).encode()
    return files


def write_model_dir(path: str | Path) -> Path:
    """Config and tokenizer of the Qwen3.5-9B shape (no weights: dummy
    load format). Idempotent, at a fixed path: the path is part of vLLM's
    compile-cache key."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for name, content in model_files().items():
        p = out / name
        if not p.exists() or p.read_bytes() != content:
            tmp = p.with_suffix(p.suffix + ".tmp")
            tmp.write_bytes(content)
            tmp.replace(p)
    return out


# ---------------------------------------------------------------------------
# step records and their aggregation (pure)


@dataclass
class StepRecord:
    dt: float  # seconds in get_output (EngineCore.step + post_step)
    rows: int  # requests scheduled
    prefill_rows: int  # of which prefill (new, or prompt not yet computed)
    tokens: int  # tokens scheduled
    drafts: int  # draft tokens scheduled (verified this step)
    out_tokens: int  # tokens emitted
    live_drafts: int  # drafts of rows that did not finish this step
    accepted: int  # accepted drafts of those rows
    finished: int  # rows that finished this step

    @property
    def decode(self) -> bool:
        return self.rows > 0 and self.prefill_rows == 0


def step_record(dt: float, sched, outputs, prompt_lens: dict[str, int]) -> StepRecord:
    """Summarize one engine step from its SchedulerOutput and its
    EngineCoreOutputs (duck-typed). ``prompt_lens`` is updated with the
    prompt lengths of newly scheduled requests."""
    spec = getattr(sched, "scheduled_spec_decode_tokens", None) or {}
    n_sched = sched.num_scheduled_tokens
    prefill = 0
    for nr in sched.scheduled_new_reqs:
        prompt_lens[nr.req_id] = len(nr.prompt_token_ids or ())
        prefill += 1
    cached = sched.scheduled_cached_reqs
    for j, rid in enumerate(cached.req_ids):
        plen = prompt_lens.get(rid)
        if plen is not None:
            is_prefill = cached.num_computed_tokens[j] < plen
        else:  # not seen as new: infer from the scheduled token count
            is_prefill = n_sched.get(rid, 0) != 1 + len(spec.get(rid, ()))
        prefill += int(is_prefill)
    # placeholders (-1: the fork's uniform_draft_padding) are no drafts
    drafts = sum(t >= 0 for v in spec.values() for t in v)
    out_tokens = live = accepted = finished = 0
    for o in getattr(outputs, "outputs", None) or ():
        n_new = len(o.new_token_ids)
        out_tokens += n_new
        if getattr(o, "finish_reason", None) is not None:
            finished += 1
            continue
        d = sum(t >= 0 for t in spec.get(o.request_id, ()))
        if d and n_new:
            live += d
            accepted += n_new - 1
    return StepRecord(
        dt=dt,
        rows=len(n_sched),
        prefill_rows=prefill,
        tokens=int(sched.total_num_scheduled_tokens),
        drafts=drafts,
        out_tokens=out_tokens,
        live_drafts=live,
        accepted=accepted,
        finished=finished,
    )


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q
    i = int(pos)
    j = min(i + 1, len(sorted_values) - 1)
    return sorted_values[i] + (sorted_values[j] - sorted_values[i]) * (pos - i)


def summarize(records: list[StepRecord], bs: int) -> dict:
    """Latency statistics of the decode steps of one batch size.

    Prefill and mixed steps are excluded; the statistics use the full-batch
    decode steps (``rows == bs``), or all decode steps when there is none.
    Throughput (tokens/s) is the tokens emitted by decode steps over their
    time. Acceptance counts the rows that did not finish in the step (a
    finishing row's output is cut at max_tokens)."""
    decode = [r for r in records if r.decode]
    full = [r for r in decode if r.rows == bs]
    basis = full or decode
    ms = sorted(r.dt * 1e3 for r in basis)
    out: dict = {
        "steps_total": len(records),
        "prefill_steps": len(records) - len(decode),
        "decode_steps": len(decode),
        "full_batch_decode_steps": len(full),
        "latency_basis": "full_batch" if full else "decode",
        "drafts_scheduled": sum(r.drafts for r in records),
        "decode_drafts_scheduled": sum(r.drafts for r in decode),
    }
    if ms:
        out.update(
            median_ms=statistics.median(ms),
            mean_ms=statistics.fmean(ms),
            stdev_ms=statistics.stdev(ms) if len(ms) > 1 else 0.0,
            p10_ms=_quantile(ms, 0.10),
            p90_ms=_quantile(ms, 0.90),
            min_ms=ms[0],
            max_ms=ms[-1],
        )
    else:
        out.update(
            median_ms=None,
            mean_ms=None,
            stdev_ms=None,
            p10_ms=None,
            p90_ms=None,
            min_ms=None,
            max_ms=None,
        )
    t = sum(r.dt for r in decode)
    toks = sum(r.out_tokens for r in decode)
    out.update(
        decode_time_s=t,
        decode_tokens=toks,
        tokens_per_s=(toks / t) if t > 0 else None,
        tokens_per_step=(toks / len(decode)) if decode else None,
        ms_per_token=(t * 1e3 / toks) if toks else None,
    )
    live = sum(r.live_drafts for r in records)
    acc = sum(r.accepted for r in records)
    out.update(
        drafts_verified=live,
        drafts_accepted=acc,
        acceptance=(acc / live) if live else None,
        accepted_per_step=(acc / len(decode)) if decode else None,
    )
    return out


def compact_steps(records: list[StepRecord]) -> list[list]:
    """Per-step rows [ms, rows, prefill_rows, drafts, accepted, out_tokens]."""
    return [
        [
            round(r.dt * 1e3, 4),
            r.rows,
            r.prefill_rows,
            r.drafts,
            r.accepted,
            r.out_tokens,
        ]
        for r in records
    ]


# ---------------------------------------------------------------------------
# the engine


class StepMeter:
    """Times every ``get_output`` of an in-process engine and records what
    the scheduler scheduled in it."""

    def __init__(self, llm) -> None:
        client = llm.llm_engine.engine_core
        if type(client).__name__ != "InprocClient":
            raise RuntimeError(
                f"need the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), "
                f"got {type(client).__name__}"
            )
        core = client.engine_core
        self.records: list[StepRecord] | None = None
        self.prompt_lens: dict[str, int] = {}
        self._last = None
        orig_schedule = core.scheduler.schedule
        orig_get = client.get_output

        def schedule(*args, **kwargs):
            out = orig_schedule(*args, **kwargs)
            self._last = out
            return out

        def get_output(*args, **kwargs):
            self._last = None
            t0 = time.perf_counter()
            out = orig_get(*args, **kwargs)
            dt = time.perf_counter() - t0
            if self.records is not None and self._last is not None:
                self.records.append(step_record(dt, self._last, out, self.prompt_lens))
            self._last = None
            return out

        core.scheduler.schedule = schedule
        client.get_output = get_output

    def start(self) -> None:
        self.prompt_lens.clear()
        self.records = []

    def stop(self) -> list[StepRecord]:
        recs, self.records = self.records or [], None
        return recs


def make_sampling(kind: str, max_tokens: int):
    from vllm import SamplingParams

    temp = 0.0 if kind == "greedy" else 1.0
    return SamplingParams(
        temperature=temp,
        top_p=1.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
    )


def generate(llm, prompts: list[list[int]], sp) -> list[list[int]]:
    from vllm.inputs import TokensPrompt

    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def timed_generate(llm, meter: StepMeter, prompts, sp):
    meter.start()
    t0 = time.perf_counter()
    try:
        tokens = generate(llm, prompts, sp)
    finally:
        wall = time.perf_counter() - t0
        recs = meter.stop()
    return tokens, recs, wall


def _base_row(bs: int, a: argparse.Namespace, recs, wall: float, tokens) -> dict:
    row = {"bs": bs, "tokens": a.tokens, "sampling": sampling_kind(a)}
    row.update(summarize(recs, bs))
    row["wall_s"] = wall
    row["e2e_ms_per_step"] = (wall * 1e3 / len(recs)) if recs else None
    row["out_len_ok"] = all(len(t) == a.tokens for t in tokens)
    row["steps"] = compact_steps(recs)
    if a.refill:
        row.update(in_flight(recs))
    return row


def in_flight(records: list[StepRecord]) -> dict:
    """A refilled run's throughput: the tokens emitted over the time of every
    step up to the last one that admits a request (a prefill row), mixed
    steps included; after it the batch drains. Overrides ``tokens_per_s``
    and says which steps it took (``in_flight_steps``); the JSON's
    ``config.refill`` says the run was refilled."""
    admits = [i for i, r in enumerate(records) if r.prefill_rows]
    window = records[: admits[-1] + 1] if admits else []
    secs = sum(r.dt for r in window)
    return {
        "in_flight_steps": len(window),
        "tokens_per_s": (sum(r.out_tokens for r in window) / secs) if secs else None,
    }


@contextlib.contextmanager
def concurrency_cap(llm, bs: int):
    """At most ``bs`` requests running in the in-process engine's scheduler
    for the duration (``--refill``)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    names = [n for n in ("max_num_running_reqs", "max_num_active_reqs")
             if hasattr(sched, n)]  # fmt: skip
    if "max_num_running_reqs" not in names:
        raise BenchError("--refill: the scheduler has no max_num_running_reqs")
    saved = {n: getattr(sched, n) for n in names}
    for n in names:
        setattr(sched, n, min(bs, saved[n]))
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(sched, n, v)


def _measured_prompts(a: argparse.Namespace, bs: int, seed_round: int):
    """The prompts of one measured run: BS, or with ``--refill`` all rounds'
    ``rounds`` x BS at once."""
    lo, hi = a.prompt_len
    n = bs * a.rounds if a.refill else bs
    return make_prompts(n, lo, hi, prompt_seed(a.seed, bs, seed_round))


def _cap(llm, a: argparse.Namespace, bs: int):
    return concurrency_cap(llm, bs) if a.refill else contextlib.nullcontext()


def measure_plain(llm, meter: StepMeter, a: argparse.Namespace, bs: int) -> dict:
    """none / ngram_nomatch: a warm-up run on other prompts, then ``rounds``
    measured runs of ``tokens`` decode tokens."""
    lo, hi = a.prompt_len
    kind = sampling_kind(a)
    warm = make_prompts(bs, lo, hi, prompt_seed(a.seed, bs, 0))
    _, warm_recs, _ = timed_generate(
        llm, meter, warm, make_sampling(kind, a.warmup_tokens)
    )
    recs: list[StepRecord] = []
    tokens: list[list[int]] = []
    wall = 0.0
    for r in range(1 if a.refill else a.rounds):
        prompts = _measured_prompts(a, bs, 1 + r)
        with _cap(llm, a, bs):
            toks, rr, w = timed_generate(
                llm, meter, prompts, make_sampling(kind, a.tokens)
            )
        recs += rr
        tokens += toks
        wall += w
    row = _base_row(bs, a, recs, wall, tokens)
    row["warmup_drafts_scheduled"] = sum(r.drafts for r in warm_recs)
    if a.mode == "ngram_nomatch":
        row["nomatch_ok"] = (
            row["drafts_scheduled"] == 0 and row["warmup_drafts_scheduled"] == 0
        )
    return row


def draft_policy(a: argparse.Namespace):
    """A fresh per-request draft-length policy for one run, or None.

    ``acceptance``: the fork's ``AcceptanceDraftLength`` (its n-gram runner
    hook cuts the n-gram drafts the same way; here it cuts the scripted
    ones). Bases without it have no such policy to measure."""
    if a.draft_policy == "fixed":
        return None
    try:
        from vllm.v1.spec_decode.dynamic.acceptance import AcceptanceDraftLength
    except ImportError as e:
        raise BenchError(
            "--draft-policy acceptance needs a vLLM with "
            "vllm.v1.spec_decode.dynamic.acceptance (the fork)"
        ) from e
    return AcceptanceDraftLength(a.draft_token_cost)


def measure_scripted(llm, meter: StepMeter, a: argparse.Namespace, bs: int) -> dict:
    """scripted70. References come from this engine: pass 0 with no drafts
    (the proposer has no plan) gives ``tokens + k + 2`` greedy tokens; each
    following pass drafts against the previous pass's output. A pass's
    output can differ from its reference where bf16 near-ties of the dummy
    weights flip between the zero-draft and the verify computation; feeding
    the output back moves every such point later (the tokens before it are
    computed the same way), so after a few passes output == reference and
    the drafts are exactly as correct as scheduled. These passes are the
    warm-up; then ``rounds`` measured runs with the last reference."""
    from benchmarks import scripted

    if not scripted.INSTANCES:
        raise RuntimeError("the scripted proposer was not instantiated in-process")
    k, n = a.scripted_k, a.tokens
    vocab = model_vocab()
    # with --refill every pass runs all rounds' requests under the cap, so
    # that the references come from the batches the measured run meets
    prompts = _measured_prompts(a, bs, 1)
    greedy = make_sampling("greedy", n)
    scripted.activate(None)
    with _cap(llm, a, bs):
        refs, ref_recs, _ = timed_generate(
            llm, meter, prompts, make_sampling("greedy", n + k + 2)
        )
    traces = None
    if a.trace:
        from harness.traces import load

        _, traces = load(a.trace)

    def make_plan(measured_round: int = 0):
        # each measured round replays the next bs traces, so that a small
        # batch meets more than its first rows' traces
        return scripted.make_plan(
            prompts,
            refs,
            a.accept_rate,
            k,
            a.seed,
            vocab,
            traces=traces,
            policy=draft_policy(a),
            trace_offset=measured_round * bs,
        )

    history = []
    for _ in range(a.ref_iters):
        plan = scripted.activate(make_plan())
        with _cap(llm, a, bs):
            outs, _, _ = timed_generate(llm, meter, prompts, greedy)
        mismatched = sum(o != r[:n] for o, r in zip(outs, refs, strict=True))
        history.append({"mismatched_rows": mismatched, **plan.summary()})
        refs = [o + r[n:] for o, r in zip(outs, refs, strict=True)]
        if mismatched == 0:
            break
    recs: list[StepRecord] = []
    tokens: list[list[int]] = []
    wall = 0.0
    plans = []
    try:
        # with --refill one run holds every round's requests (row r replays
        # trace r, as round r // BS's row r % BS does without it)
        for r in range(1 if a.refill else a.rounds):
            plan = scripted.activate(make_plan(r))
            with _cap(llm, a, bs):
                toks, rr, w = timed_generate(llm, meter, prompts, greedy)
            recs += rr
            tokens += toks
            wall += w
            plans.append(
                {
                    **plan.summary(),
                    "mismatched_rows": sum(
                        t != r[:n] for t, r in zip(toks, refs, strict=True)
                    ),
                }
            )
    finally:
        scripted.activate(None)
    row = _base_row(bs, a, recs, wall, tokens)
    row["reference_pass_drafts"] = sum(r.drafts for r in ref_recs)
    row["reference_iterations"] = history
    row["reference_converged"] = bool(history) and history[-1]["mismatched_rows"] == 0
    row["proposer"] = plans
    return row


# ---------------------------------------------------------------------------
# main


def write_json(path: str | Path, obj: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(p)


def install_info() -> dict:
    info: dict = {}
    with contextlib.suppress(Exception):
        import vllm

        info["vllm_version"] = getattr(vllm, "__version__", None)
        info["vllm_file"] = vllm.__file__
    try:
        from vllm.v1.spec_decode import utils as sd_utils

        info["fork_patches"] = hasattr(sd_utils, "mark_zero_draft_decodes")
    except Exception as e:  # noqa: BLE001 - informative
        info["fork_patches"] = None
        info["fork_patches_error"] = repr(e)[:300]
    return info


def device_info() -> dict:
    """Torch and device names (after the engine started: no early CUDA init)."""
    info: dict = {}
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
        info["device"] = torch.cuda.get_device_name(0)
    return info


def setup_turboquant(cudagraph: str) -> dict:
    """In-process TurboQuant setup before the engine starts: the SDPA prefill
    where FlashAttention 2 is missing (see harness.equivalence), and with
    ``downgrade`` the CUDA graph support of upstream issue 40880's
    workaround."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadataBuilder

    from harness.equivalence import turboquant_prefill

    if cudagraph == "downgrade":
        TurboQuantMetadataBuilder._cudagraph_support = (
            AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        )
    return {
        "prefill": turboquant_prefill(),
        "cudagraph_support": TurboQuantMetadataBuilder._cudagraph_support.name,
    }


def config_hash(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]


def _shutdown(llm) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def run(a: argparse.Namespace) -> int:
    t_start = time.time()
    deadline = t_start + a.deadline if a.deadline else None
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if a.runner == "mrv2" else "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = str(write_model_dir(a.model_dir))
    kw = engine_kwargs(a, model_dir)
    config = {
        "engine": kw,
        "sampling": sampling_kind(a),
        "tokens": a.tokens,
        "warmup_tokens": a.warmup_tokens,
        "rounds": a.rounds,
        "refill": a.refill,
        "prompt_len": list(a.prompt_len),
        "batch_sizes": a.batch_sizes,
        "seed": a.seed,
        "accept_rate": a.accept_rate if a.mode == "scripted70" else None,
        "trace": a.trace if a.mode == "scripted70" else None,
        "draft_policy": a.draft_policy if a.mode == "scripted70" else None,
        "uniform_draft_padding": a.uniform_draft_padding,
        "ref_iters": a.ref_iters if a.mode == "scripted70" else None,
        "runner": a.runner,
        "cache_mode": a.cache_mode,
        "tq_cudagraph": a.tq_cudagraph,
        "env": {
            k: os.environ.get(k)
            for k in (
                "VLLM_ENABLE_V1_MULTIPROCESSING",
                "VLLM_USE_V2_MODEL_RUNNER",
                "VLLM_USE_FLASHINFER_SAMPLER",
            )
        },
    }
    doc: dict = {
        "schema": SCHEMA,
        "variant": a.variant,
        "repeat": a.repeat,
        "mode": a.label,
        "spec_mode": a.mode,
        "status": "starting",
        "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "config": config,
        "config_hash": config_hash(config),
        "results": [],
        "skipped_batch_sizes": [],
    }
    write_json(a.out, doc)
    llm = None
    code = 0
    try:
        doc.update(install_info())
        if a.kv_cache_dtype.startswith("turboquant_"):
            doc["turboquant"] = setup_turboquant(a.tq_cudagraph)
        from vllm import LLM

        t0 = time.time()
        llm = LLM(**kw)
        doc["engine_start_s"] = round(time.time() - t0, 2)
        doc.update(device_info())
        meter = StepMeter(llm)
        doc["status"] = "running"
        write_json(a.out, doc)
        print(f"[bench] {a.variant} {a.label}: engine up in {doc['engine_start_s']}s",
              flush=True)  # fmt: skip
        last = None
        for bs in a.batch_sizes:
            est = 2.0 * last + 5 if last else 30.0
            if deadline is not None and time.time() + est > deadline:
                doc["skipped_batch_sizes"].append(bs)
                print(f"[bench] skip BS {bs}: deadline", flush=True)
                continue
            t_bs = time.time()
            if a.mode == "scripted70":
                row = measure_scripted(llm, meter, a, bs)
            else:
                row = measure_plain(llm, meter, a, bs)
            last = time.time() - t_bs
            row["bs_wall_s"] = round(last, 2)
            doc["results"].append(row)
            write_json(a.out, doc)
            print(
                "[bench] {} {} BS {}: median {:.3f} ms/step, mean {:.3f}, "
                "{} decode steps, {:.0f} tok/s, drafts {}, acceptance {}".format(
                    a.variant,
                    a.label,
                    bs,
                    row["median_ms"] or float("nan"),
                    row["mean_ms"] or float("nan"),
                    row["decode_steps"],
                    row["tokens_per_s"] or 0.0,
                    row["drafts_scheduled"],
                    None if row["acceptance"] is None else round(row["acceptance"], 3),
                ),
                flush=True,
            )
        doc["status"] = "partial" if doc["skipped_batch_sizes"] else "ok"
    except BaseException as e:  # noqa: BLE001 - recorded, then re-signalled
        doc["status"] = "error"
        doc["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[
            -2000:
        ]
        doc["traceback"] = traceback.format_exc()[-6000:]
        print(doc["traceback"], file=sys.stderr, flush=True)
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    finally:
        doc["wall_s"] = round(time.time() - t_start, 2)
        write_json(a.out, doc)
        if llm is not None:
            _shutdown(llm)
    return code


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown (engine threads, compile workers): the JSON
    # is written and the GPU memory goes with the process
    os._exit(rc)
