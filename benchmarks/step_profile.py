"""Where the time of a decode step goes, for one vLLM install.

    python -m benchmarks.step_profile --variant fork --out out/prof-fork \\
        -- --mode ngram_nomatch --batch-sizes 1,64

Arguments after ``--`` are ``benchmarks.decode_latency``'s (its ``--out`` is
not used). One in-process engine, as in ``decode_latency``; per batch size a
warm-up run, then one run of ``--tokens`` decode tokens during which

- the model runner's and the scheduler's step methods are timed on the host
  (``time.perf_counter`` around each call: the host time of the call, which
  includes waits on the device only where the method synchronizes), and the
  return values of the fork's ``_recurrent_states_in_first_slot`` are counted
  (which path the recurrent-state backends took);

then one shorter run under ``torch.profiler`` (CPU and CUDA activity) whose
operator and kernel tables go to ``<out>/profile-bs<N>.txt``.

Device time and the weight-read floor. From the profiled run's device events
(kernels, memcpy and memset; CUPTI reports the kernels inside CUDA graphs as
well) ``row["device"]`` gives, per full-batch decode step: the time the device
was busy (the union of the kernel intervals), the plain sum of the kernel
times, the idle time between kernels, the kernel time per category of kernel
name (:data:`KERNEL_CATEGORIES`), the top kernels and the longest GEMM that
runs about once per step (the likely LM head). Steps are told apart by a
``record_function`` mark around each engine step (the in-process client's
``get_output``, which ``decode_latency.StepMeter`` times and classifies);
prefill and mixed steps are left out. ``doc["weights"]`` holds the bytes of
the loaded model's parameters a decode step reads, ``doc["bandwidth"]`` the
device's copy bandwidth (``benchmarks.weight_floor``), and each row
``floor_ms``, ``step_over_floor`` and ``lm_head_floor_ms``.
``python -m benchmarks.step_profile --floor step_profile.json`` splits the
gap between the step and the floor into host and launch gaps and kernel time
above the floor. This is written here because ``torch.profiler`` only gives
the events and per-operator totals: the union of the intervals per step, the
split by category and the comparison with the floor are reported by neither
torch nor vLLM.

Writes ``<out>/step_profile.json``. Compare two variants with
``python -m benchmarks.step_profile --compare A.json B.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import traceback
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from benchmarks import decode_latency as dl
from benchmarks.weight_floor import weight_read_floor_ms

RUNNER_METHODS = (
    "execute_model",
    "_update_states",
    "_prepare_inputs",
    "_build_attention_metadata",
    "_preprocess",
    "_model_forward",
    "sample_tokens",
    "_sample",
    "_update_states_after_model_execute",
    "_bookkeeping_sync",
    "propose_draft_token_ids",
    "take_draft_token_ids",
    "_recurrent_states_in_first_slot",
    "_park_accepted_counts",
)
SCHEDULER_METHODS = ("schedule", "update_from_output", "update_draft_token_ids")


class MethodTimer:
    """perf_counter totals per wrapped method; counts of returned values for
    the methods named in ``count_results``."""

    def __init__(self) -> None:
        self.on = False
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.results: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()
        self.results.clear()

    def wrap(self, obj, name: str, prefix: str, count_results: bool = False) -> bool:
        fn = getattr(obj, name, None)
        if fn is None or not callable(fn):
            return False
        key = f"{prefix}.{name}"

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.total[key] += time.perf_counter() - t0
                self.calls[key] += 1
            if count_results:
                self.results[key][repr(out)] += 1
            return out

        setattr(obj, name, timed)
        return True

    def summary(self, steps: int) -> dict:
        return {
            k: {
                "calls": self.calls[k],
                "total_ms": self.total[k] * 1e3,
                "us_per_step": self.total[k] * 1e6 / steps if steps else None,
                "results": dict(self.results.get(k, {})),
            }
            for k in sorted(self.total)
        }


def model_runner(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core, core.model_executor.driver_worker.worker.model_runner


# ---------------------------------------------------------------------------
# device time per decode step (pure)

# Kernel categories, tried in order on the lower-cased kernel name; the first
# match wins. A heuristic over kernel names (cuBLAS, CUTLASS, Triton and vLLM
# kernels as the profiler names them), not a property the profiler reports;
# "other" takes the rest and is reported, so nothing is hidden. "attention"
# comes before "gemm" because FlashAttention 3's kernels are named
# ``cutlass::device_kernel<flash::...Sm90...>`` and FlashAttention 2's split
# kernels ``flash_fwd_splitkv_*``. "norm" takes ``rsqrt`` for the RMSNorm
# that torch.compile generates (``triton_red_fused_..._rsqrt_N``); the other
# kernels torch.compile generates (``triton_poi_``/``triton_red_``/
# ``triton_per_``, named after the fused aten ops) are "inductor", not
# "memcpy" for the ``_to_copy`` in their names.
KERNEL_CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("gdn", r"gated_delta|delta_rule|chunk_|recurrent|fla_|gdn|l2norm"),
        ("conv1d", r"conv1d|causal_conv"),
        ("attention", r"attn|attention|flash|fmha|paged|kv_cache|reshape_and_cache"),
        ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|sm90_|wgmma|splitk"),
        ("sampling", r"softmax|argmax|topk|top_k|sample|logit|gumbel|exponential"),
        ("norm", r"rms|layer_norm|layernorm|norm|rsqrt"),
        ("inductor", r"^triton_(poi|red|per)_"),
        ("memcpy", r"memcpy|memset|copy"),
    )
)
CATEGORY_NAMES = tuple(n for n, _ in KERNEL_CATEGORIES) + ("other",)
TOP_KERNELS = 15
NAME_CHARS = 120


def kernel_category(name: str) -> str:
    low = name.lower()
    for cat, pattern in KERNEL_CATEGORIES:
        if pattern.search(low):
            return cat
    return "other"


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def device_breakdown(
    kernels: list[tuple[str, float, float]], steps: int, step_ms: float | None = None
) -> dict:
    """Device time per step from ``(name, start_us, end_us)`` kernel events
    of ``steps`` engine steps.

    ``busy_ms_per_step``: the union of the kernel intervals (overlapping
    kernels counted once) over ``steps``; ``kernel_ms_per_step``: the plain
    sum of the kernel times over ``steps``; ``span_ms``: first start to last
    end; ``idle_ms_per_step``: (span - union) / steps, the time the device
    ran no kernel between the first and the last. ``categories``: the kernel
    sum per :func:`kernel_category`, with its share of the kernel sum.
    ``top``: the kernels with the largest total time. ``largest_gemm``: of
    the "gemm" kernel names that run about once per step (count within
    [steps / 2, steps * 2]), the one with the longest mean time. With
    ``step_ms``: ``host_gap_ms`` = step_ms - busy_ms_per_step."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    if not kernels:
        raise ValueError("no device kernel events (was CUDA activity recorded?)")
    total_us = sum(end - start for _, start, end in kernels)
    busy_us = union_us((start, end) for _, start, end in kernels)
    span_us = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, start, end in kernels:
        by_name[name].append(end - start)
    cats = {c: {"ms_per_step": 0.0, "share": 0.0, "count": 0} for c in CATEGORY_NAMES}
    for name, durs in by_name.items():
        c = cats[kernel_category(name)]
        c["ms_per_step"] += sum(durs) / 1e3 / steps
        c["count"] += len(durs)
    for c in cats.values():
        c["share"] = c["ms_per_step"] * 1e3 * steps / total_us if total_us else 0.0
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    top = [
        {
            "name": name[:NAME_CHARS],
            "category": kernel_category(name),
            "count": len(durs),
            "total_ms": sum(durs) / 1e3,
            "mean_us": sum(durs) / len(durs),
        }
        for name, durs in ranked[:TOP_KERNELS]
    ]
    once = [
        (sum(durs) / len(durs), name, durs)
        for name, durs in by_name.items()
        if kernel_category(name) == "gemm" and steps * 0.5 <= len(durs) <= steps * 2
    ]
    largest = None
    if once:
        mean_us, name, durs = max(once)
        largest = {
            "name": name[:NAME_CHARS],
            "count": len(durs),
            "mean_us": mean_us,
            "max_us": max(durs),
        }
    busy_ms = busy_us / 1e3 / steps
    out = {
        "kernels": len(kernels),
        "steps": steps,
        "busy_ms_per_step": busy_ms,
        "kernel_ms_per_step": total_us / 1e3 / steps,
        "span_ms": span_us / 1e3,
        "idle_ms_per_step": (span_us - busy_us) / 1e3 / steps,
        "categories": cats,
        "top": top,
        "largest_gemm": largest,
    }
    if step_ms is not None:
        out["step_ms"] = step_ms
        out["host_gap_ms"] = step_ms - busy_ms
    return out


# ---------------------------------------------------------------------------
# profiler events -> kernel tuples and step windows (thin adapters)

# Kineto activity types of device work; the other device events
# (gpu_user_annotation: record_function ranges on the device timeline,
# cuda_sync: waits) are left out and counted in "skipped_device_events".
KERNEL_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_MARK = "step_profile::step"


def kernel_events(events) -> tuple[list[tuple[str, float, float]], dict[str, int]]:
    """``(name, start_us, end_us)`` of the device kernels, copies and sets in
    ``torch.profiler``'s ``prof.events()`` (FunctionEvent: ``device_type``,
    ``activity_type``, ``is_user_annotation``, ``name``, ``time_range``), and
    the count per activity type of the device events left out."""
    from torch.autograd import DeviceType

    kernels: list[tuple[str, float, float]] = []
    skipped: dict[str, int] = defaultdict(int)
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        act = getattr(e, "activity_type", None)
        if getattr(e, "is_user_annotation", False) or (
            act and act not in KERNEL_ACTIVITIES
        ):
            skipped[str(act)] += 1
            continue
        kernels.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return kernels, dict(skipped)


def step_windows(events) -> list[tuple[float, float]]:
    """Host ``(start_us, end_us)`` of the :data:`STEP_MARK` ranges, in order."""
    from torch.autograd import DeviceType

    return sorted(
        (float(e.time_range.start), float(e.time_range.end))
        for e in events
        if e.name == STEP_MARK and e.device_type == DeviceType.CPU
    )


def kernels_in_steps(
    kernels: list[tuple[str, float, float]],
    windows: list[tuple[float, float]],
    keep: list[bool],
) -> list[tuple[str, float, float]]:
    """The kernels of the kept steps. A kernel belongs to the last step
    window that starts at or before its start (a step's kernels start after
    their launch and, with the step ending in a device-to-host copy of the
    sampled tokens, end before the step does); kernels before the first
    window or after the end of the last one belong to none."""
    starts = [w[0] for w in windows]
    out = []
    for k in kernels:
        i = bisect_right(starts, k[1]) - 1
        if i < 0 or (i == len(windows) - 1 and k[1] > windows[-1][1]):
            continue
        if keep[i]:
            out.append(k)
    return out


def profile_tables(llm, meter, prompts, sp, path: Path, bs: int, step_ms=None) -> dict:
    """Runs ``prompts`` under ``torch.profiler``, writes the operator and
    kernel tables to ``path`` and returns :func:`device_breakdown` of the
    full-batch decode steps of the run (or ``{"error": ...}``).

    Each engine step (the in-process client's ``get_output``) runs inside a
    ``record_function(STEP_MARK)`` range, and ``meter`` (a
    ``decode_latency.StepMeter``) classifies it; the kernels are assigned to
    steps by those ranges (:func:`kernels_in_steps`). When the ranges do not
    line up with the steps, every kernel of the run counts and ``steps`` is
    the number of engine steps (``steps_basis`` says which)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    client = llm.llm_engine.engine_core
    inner = client.get_output
    calls: list = []  # per get_output: the StepRecord it added, or None

    def marked(*args, **kwargs):
        n = len(meter.records or ())
        with record_function(STEP_MARK):
            out = inner(*args, **kwargs)
        recs = meter.records or []
        calls.append(recs[-1] if len(recs) > n else None)
        return out

    client.get_output = marked
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _, recs, _ = dl.timed_generate(llm, meter, prompts, sp)
    finally:
        client.get_output = inner
    ka = prof.key_averages()
    with open(path, "w") as fh:
        fh.write(f"# torch {torch.__version__}\n\n## by self CPU time\n")
        fh.write(ka.table(sort_by="self_cpu_time_total", row_limit=60))
        fh.write("\n\n## by device time\n")
        fh.write(ka.table(sort_by="self_device_time_total", row_limit=40))
        fh.write("\n")
    dev = device_from_events(prof.events, calls, bs, step_ms, len(recs))
    if "error" not in dev:
        dev["profiled_step_ms"] = dl.summarize(recs, bs)["median_ms"]
    return dev


def device_from_events(events, calls: list, bs: int, step_ms, all_steps: int) -> dict:
    """:func:`device_breakdown` of the profiled run's full-batch decode steps.

    ``events``: the profiler's event list, or a callable returning it;
    ``calls``: per marked ``get_output``, in order, the ``StepRecord`` it
    added or None. When the marked ranges and ``calls`` do not line up (or
    no call was a full-batch decode step), every kernel counts and
    ``steps`` is ``all_steps``. An error (an event API other than the one
    :func:`kernel_events` reads, no kernels) comes back as ``{"error": ...}``."""
    import torch

    try:
        if callable(events):
            events = events()
        kernels, skipped = kernel_events(events)
        windows = step_windows(events)
        keep = [r is not None and r.decode and r.rows == bs for r in calls]
        if len(windows) == len(calls) and any(keep):
            chosen = kernels_in_steps(kernels, windows, keep)
            steps = sum(keep)
            basis = "full-batch decode steps (marked get_output ranges)"
        else:
            chosen, steps = kernels, all_steps
            basis = (
                f"all {all_steps} engine steps: {len(windows)} marked ranges for "
                f"{len(calls)} get_output calls, {sum(keep)} full-batch decode"
            )
        dev = device_breakdown(chosen, steps, step_ms)
    except (AttributeError, TypeError, ValueError) as e:
        return {
            "error": f"{type(e).__name__}: {e}",
            "torch": torch.__version__,
            "reads": "FunctionEvent.device_type, activity_type, is_user_annotation, "
            "name, time_range.start/end",
        }
    dev["steps_basis"] = basis
    dev["device_events"] = len(kernels)
    dev["skipped_device_events"] = skipped
    return dev


# ---------------------------------------------------------------------------
# weights and the floor


def classify_param_bytes(named: Iterable[tuple[str, int]]) -> dict:
    """Bytes a decode step reads, from ``(parameter name, bytes)``.

    Embedding tables (names ending ``embed_tokens.weight``) are gathered a
    row per token, not read whole, and are not counted; ``lm_head`` (names
    containing ``lm_head``) is read whole; with no ``lm_head`` and an
    embedding, the head is tied and the embedding counts as the head. MTP
    layers (``.mtp.`` in the name or a leading ``mtp``) and a vision tower
    (``visual.`` / ``vision_tower``) are reported apart and not counted.
    Everything else is the body."""
    body = head = embed = mtp = vision = 0
    for name, nbytes in named:
        if ".mtp." in name or name.startswith("mtp"):
            mtp += nbytes
        elif name.startswith("visual.") or ".visual." in name or "vision_tower" in name:
            vision += nbytes
        elif name.endswith("embed_tokens.weight"):
            embed += nbytes
        elif "lm_head" in name:
            head += nbytes
        else:
            body += nbytes
    tied = head == 0 and embed > 0
    if tied:
        head = embed
    return {
        "decode_bytes": body + head,
        "body_bytes": body,
        "lm_head_bytes": head,
        "embed_bytes": embed,
        "mtp_bytes": mtp,
        "vision_bytes": vision,
        "tied": tied,
    }


def weight_bytes(runner) -> dict:
    """:func:`classify_param_bytes` of the runner's loaded model
    (``get_model()``, which unwraps the CUDA graph wrapper, else ``.model``).
    ``named_parameters`` lists a tied parameter once, under its first name."""
    get = getattr(runner, "get_model", None)
    model = get() if callable(get) else runner.model
    unwrap = getattr(model, "unwrap", None)
    if callable(unwrap):
        model = unwrap()
    named = [(n, p.numel() * p.element_size()) for n, p in model.named_parameters()]
    out = classify_param_bytes(named)
    out["params"] = len(named)
    out["model_class"] = type(model).__name__
    return out


def copy_bandwidth() -> dict:
    """``{"bandwidth": measure_bandwidth(2 GiB)}`` on a CUDA device (two
    2 GiB buffers, freed and returned to the driver afterwards), else
    ``{"bandwidth_error": ...}``."""
    import torch

    if not torch.cuda.is_available():
        return {"bandwidth_error": "no CUDA device"}
    from benchmarks.weight_floor import measure_bandwidth

    try:
        return {"bandwidth": measure_bandwidth(nbytes=2 << 30)}
    except Exception as e:  # noqa: BLE001 - recorded
        return {"bandwidth_error": f"{type(e).__name__}: {e}"}
    finally:
        torch.cuda.empty_cache()


def floor_fields(median_ms, weights: dict | None, bandwidth: dict | None) -> dict:
    """``floor_ms`` (the decode bytes at the copy bandwidth),
    ``step_over_floor`` and ``lm_head_floor_ms``; empty when a part is
    missing."""
    if not weights or not bandwidth or not median_ms:
        return {}
    gbps = bandwidth["copy_gbps"]
    floor = weight_read_floor_ms(weights["decode_bytes"], gbps)
    return {
        "floor_ms": floor,
        "step_over_floor": median_ms / floor,
        "lm_head_floor_ms": weight_read_floor_ms(weights["lm_head_bytes"], gbps),
    }


def run(variant: str, out: Path, argv: list[str]) -> int:
    a = dl.parse_args([*argv, "--out", str(out / "unused.json")])
    out.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if a.runner == "mrv2" else "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    doc: dict = {
        "schema": "hsfork-step-profile/1",
        "variant": variant,
        "mode": a.label,
        "argv": argv,
        "results": [],
    }
    doc.update(dl.install_info())
    path = out / "step_profile.json"
    llm = None
    code = 0
    try:
        from vllm import LLM

        model_dir = str(dl.write_model_dir(a.model_dir))
        llm = LLM(**dl.engine_kwargs(a, model_dir))
        doc.update(dl.device_info())
        meter = dl.StepMeter(llm)
        core, runner = model_runner(llm)
        timer = MethodTimer()
        counted = "_recurrent_states_in_first_slot"
        doc["wrapped"] = [
            f"runner.{m}"
            for m in RUNNER_METHODS
            if timer.wrap(runner, m, "runner", count_results=m == counted)
        ] + [
            f"scheduler.{m}"
            for m in SCHEDULER_METHODS
            if timer.wrap(core.scheduler, m, "scheduler")
        ]
        try:
            doc["weights"] = weight_bytes(runner)
        except Exception as e:  # noqa: BLE001 - recorded
            doc["weights_error"] = f"{type(e).__name__}: {e}"
        doc.update(copy_bandwidth())
        kind = dl.sampling_kind(a)
        lo, hi = a.prompt_len
        for bs in a.batch_sizes:
            warm = dl.make_prompts(bs, lo, hi, dl.prompt_seed(a.seed, bs, 0))
            dl.generate(llm, warm, dl.make_sampling(kind, a.warmup_tokens))
            prompts = dl.make_prompts(bs, lo, hi, dl.prompt_seed(a.seed, bs, 1))
            timer.reset()
            timer.on = True
            _, recs, wall = dl.timed_generate(
                llm, meter, prompts, dl.make_sampling(kind, a.tokens)
            )
            timer.on = False
            row = {"bs": bs, **dl.summarize(recs, bs), "wall_s": wall}
            row["methods"] = timer.summary(len(recs))
            row.update(
                floor_fields(row["median_ms"], doc.get("weights"), doc.get("bandwidth"))
            )
            prof_path = out / f"profile-bs{bs}.txt"
            row["device"] = profile_tables(
                llm,
                meter,
                dl.make_prompts(bs, lo, hi, dl.prompt_seed(a.seed, bs, 2)),
                dl.make_sampling(kind, 32),
                prof_path,
                bs,
                step_ms=row["median_ms"],
            )
            row["profile"] = prof_path.name
            doc["results"].append(row)
            dl.write_json(path, doc)
            print(f"[profile] {variant} BS {bs}: median {row['median_ms']:.3f} ms",
                  flush=True)  # fmt: skip
        doc["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - recorded
        doc["status"] = "error"
        doc["error"] = repr(e)[-2000:]
        doc["traceback"] = traceback.format_exc()[-6000:]
        print(doc["traceback"], file=sys.stderr, flush=True)
        code = 1
    finally:
        dl.write_json(path, doc)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
    return code


def _num(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _device(r: dict | None) -> dict:
    """The row's device breakdown, or {} (older JSONs, or an error)."""
    dev = (r or {}).get("device") or {}
    return {} if "error" in dev else dev


def _column_labels(docs: list[dict]) -> list[str]:
    """One column name per JSON: its variant, or variant/mode where two
    JSONs share a variant (one install profiled in two modes), or the
    JSON's position as well where those are equal too; a column keyed by
    the variant alone kept only the last of them."""
    labels = [str(d.get("variant")) for d in docs]
    if len(set(labels)) < len(labels):
        labels = [
            f"{d.get('variant')}/{d['mode']}"
            if d.get("mode")
            else str(d.get("variant"))
            for d in docs
        ]
    if len(set(labels)) < len(labels):
        labels = [f"{lab} #{i + 1}" for i, lab in enumerate(labels)]
    return labels


def compare(paths: list[str]) -> str:
    """A table of host µs per step per method, variant by variant, with the
    device time per step and the floor where the JSONs have them."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    labels = _column_labels(docs)
    lines = []
    for bs in sorted({r["bs"] for d in docs for r in d.get("results", [])}):
        rows = {lab: next((r for r in d["results"] if r["bs"] == bs), None)
                for lab, d in zip(labels, docs, strict=True)}  # fmt: skip
        names = sorted({m for r in rows.values() if r for m in r["methods"]})
        lines.append(f"## BS {bs}")
        lines.append("| | " + " | ".join(rows) + " |")
        lines.append("|---" * (len(rows) + 1) + "|")
        lines.append(
            "| median ms/step | "
            + " | ".join(f"{r['median_ms']:.3f}" if r else "-" for r in rows.values())
            + " |"
        )
        devs = [_device(r) for r in rows.values()]
        if any(devs):
            table = [
                ("device busy ms/step", [d.get("busy_ms_per_step") for d in devs]),
                ("device idle ms/step", [d.get("idle_ms_per_step") for d in devs]),
            ]
            for c in CATEGORY_NAMES:
                per = [d.get("categories", {}).get(c, {}) for d in devs]
                if any(x.get("count") for x in per):
                    table.append(
                        (f"{c} kernels ms/step", [x.get("ms_per_step") for x in per])
                    )
            for label, values in table:
                lines.append(f"| {label} | " + " | ".join(map(_num, values)) + " |")
        if any(r and "floor_ms" in r for r in rows.values()):
            for key, label, fmt in (
                ("floor_ms", "floor ms", ".3f"),
                ("step_over_floor", "step/floor", ".3f"),
            ):
                cells = [_num((r or {}).get(key), fmt) for r in rows.values()]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        for m in names:
            cells = []
            for r in rows.values():
                x = r["methods"].get(m) if r else None
                cells.append("-" if not x else f"{x['us_per_step']:.1f}")
            lines.append(f"| {m} µs/step | " + " | ".join(cells) + " |")
        for v, r in rows.items():
            err = ((r or {}).get("device") or {}).get("error")
            if err:
                lines.append(f"\n{v} device breakdown: {err}")
        for r in rows.values():
            for m, x in (r or {}).get("methods", {}).items():
                if x.get("results"):
                    lines.append(f"\n{m} returned: {x['results']}")
        lines.append("")
    return "\n".join(lines)


def _share(x: float, gap: float) -> str:
    return f"{100 * x / gap:.1f}%" if gap > 0 else "-"


def floor_report(doc: dict) -> str:
    """Markdown: per batch size, the step median against the weight-read
    floor, and the gap split into (a) host and launch gaps (step - device
    busy) and (b) kernel time above the floor (device busy - floor) by kernel
    category. Measured quantities only; the floor is set against the "gemm"
    kernels, which read the linear layers' weights (the LM head among
    them)."""
    w, bw = doc.get("weights"), doc.get("bandwidth")
    title = f"{doc.get('variant', '?')} ({doc.get('mode', '?')})"
    lines = [f"# Decode step vs the weight-read floor: {title}", ""]
    if w and bw:
        gb = 1e9
        tied = ", tied to the embedding" if w["tied"] else ""
        lines.append(
            f"Weights read per decode step: {w['decode_bytes'] / gb:.3f} GB "
            f"(body {w['body_bytes'] / gb:.3f} GB + lm_head "
            f"{w['lm_head_bytes'] / gb:.3f} GB{tied}; not counted: embedding "
            f"table {w['embed_bytes'] / gb:.3f} GB, MTP "
            f"{w['mtp_bytes'] / gb:.3f} GB). Copy bandwidth "
            f"{bw['copy_gbps']:.1f} GB/s ({bw.get('device', '?')}, "
            f"{bw.get('method', 'copy')})."
        )
    else:
        why = [doc.get(k) for k in ("weights_error", "bandwidth_error") if doc.get(k)]
        lines.append("No floor: " + ("; ".join(why) or "no weights or bandwidth"))
    lines.append("")
    for r in doc.get("results", []):
        lines.append(f"## BS {r['bs']}")
        lines.append("")
        step, floor = r.get("median_ms"), r.get("floor_ms")
        dev = r.get("device") or {}
        if step is None or floor is None:
            lines.append("No step median or no floor in this row.")
            lines.append("")
            continue
        gap = step - floor
        lines += [
            "| | ms/step | share of the gap |",
            "|---|---:|---:|",
            f"| step (median, unprofiled run) | {step:.3f} | |",
            f"| weight-read floor | {floor:.3f} | |",
            f"| step / floor | {r['step_over_floor']:.3f}x | |",
            f"| gap: step - floor | {gap:.3f} | {_share(gap, gap)} |",
        ]
        if "error" in dev or "busy_ms_per_step" not in dev:
            lines.append("")
            lines.append(f"No device breakdown: {dev.get('error', 'not in this row')}")
            lines.append("")
            continue
        busy = dev["busy_ms_per_step"]
        cats = dev["categories"]
        overlap = dev["kernel_ms_per_step"] - busy
        gemm_above = cats["gemm"]["ms_per_step"] - floor
        items = [
            ("(a) host and launch gaps: step - device busy", step - busy),
            ("(b) kernel time above the floor: device busy - floor", busy - floor),
            ("(b) of which gemm kernels - floor", gemm_above),
        ]
        items += [
            (f"(b) of which {c} kernels", cats[c]["ms_per_step"])
            for c in CATEGORY_NAMES
            if c != "gemm" and cats.get(c, {}).get("count")
        ]
        items.append(("(b) of which overlap: -(kernel sum - busy)", -overlap))
        lines += [f"| {label} | {x:.3f} | {_share(x, gap)} |" for label, x in items]
        lines.append("")
        lg, head = dev.get("largest_gemm"), r.get("lm_head_floor_ms")
        if lg and head:
            lines.append(
                f"LM head: the longest GEMM that runs about once per step, "
                f"`{lg['name']}` ({lg['count']} launches), takes "
                f"{lg['mean_us'] / 1e3:.3f} ms on average; the lm_head weights "
                f"alone read at the copy bandwidth take {head:.3f} ms "
                f"({lg['mean_us'] / 1e3 / head:.2f}x)."
            )
            lines.append("")
        lines.append(
            f"Device times: the profiled run, {dev['steps']} steps "
            f"({dev.get('steps_basis', '?')}), median step "
            f"{_num(dev.get('profiled_step_ms'))} ms under the profiler. The "
            f"device ran no kernel for {dev['idle_ms_per_step']:.3f} ms/step "
            f"between its first and last kernel. Categories are matched on "
            f"kernel names (KERNEL_CATEGORIES); the floor is set against the "
            f"gemm kernels, and the (b) 'of which' rows add up to device busy - "
            f"floor."
        )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.side_by_side import split_passthrough

    argv, extra = split_passthrough(argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_profile")
    ap.add_argument("--variant", default="unknown")
    ap.add_argument("--out", default="out/step-profile")
    ap.add_argument("--compare", nargs="+", metavar="JSON")
    ap.add_argument(
        "--floor", metavar="JSON", help="the step against the weight-read floor"
    )
    a = ap.parse_args(argv)
    if a.compare:
        print(compare(a.compare))
        return 0
    if a.floor:
        print(floor_report(json.loads(Path(a.floor).read_text())))
        return 0
    return run(a.variant, Path(a.out), extra)


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
