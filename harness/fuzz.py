"""Configuration fuzzer: random engine configurations, each run briefly
against its non-speculative reference (margin-aware comparison and the
every-token drift oracle), failures shrunk to minimal regression cells.

    python -m harness.fuzz run --out DIR --deadline 420 --seed 1   # GPU host
    python -m harness.fuzz run --dry-run --seed 1 --count 20       # anywhere
    python -m harness.fuzz shrink DIR/fork.jsonl --id ID --deadline 420
    python -m harness.fuzz report DIR                              # FUZZ.md

**Draw** (``draw_group``, a seeded ``random.Random``: the same seed draws
the same configurations on every variant and line). Dimensions
(``FuzzConfig``): model family, runner (v1 / mrv2 / default), drafter (n-gram
with its lookup min/max, GPU n-gram, MTP, the scripted schedules of
``harness.drafter``, an attention-only draft model and an EAGLE-3 head where
the fixture has one), draft length k, ``max_num_seqs``, chunked prefill and
its per-step token budget (weighted toward small budgets: draft trimming
under a tight budget is where divergences were found), prefix caching
(none / align: a second wave hits the prefix cache), the KV pool (ample, or
a few blocks above the least the engine starts with: preemption), CUDA
graphs or eager, async scheduling, batch composition (number of prompts,
their lengths and seed), output length, request features (plain, stop
token ids, structured output, prompt logprobs:
``harness.equivalence.request_kwargs``) and,
in align mode, the number of waves (turns of a conversation). Configurations
are drawn in groups that share one reference (model, prompts, output length,
request features, waves), so that one reference and one teacher-forced
verification serve a group. ``regroup --twin`` runs a failure again beside
its non-speculative twin, to tell speculation from the configuration.

**One runner path.** A configuration maps onto ``harness.equivalence.Cell``
(``to_cell``; engine arguments beyond the cell's own in ``extra``) and a
group runs through ``run_cells`` in a child process (``run-group``): a
crash that poisons the CUDA context (an illegal memory access) or a hang
costs one group, not the run. Before a group starts, the parent appends a
``start`` line per configuration to the JSON-lines file; the child appends a
``result`` line per configuration; a configuration with a start line and no
result was lost with its child (``timeout`` or ``crashed``, with the
child's last output). A killed run loses nothing already written.

**KV pool.** The least pool an engine starts with depends on the block
sizes vLLM picks at start (the attention block is sized to the Mamba/GDN
state page, which depends on k for GDN's conv state), on the KV cache
groups and on the cache mode; it is not guessed here. A configuration with a
small pool carries ``num_gpu_blocks_override = POOL_BASE + slack``; the
hook ``install_pool_hook`` (installed by ``harness.equivalence._engine``
before such an engine starts) wraps vLLM's
``get_kv_cache_configs`` (called in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and replaces that value by the least
number of blocks vLLM's own admission check accepts (one request of
``max_model_len``, searched with vLLM's own function), plus one block per
Mamba group and sequence, plus ``slack``. ``max_model_len`` is sized to the
longest request the configuration makes, so that the pool holds one such
request and the batch preempts. An engine that still refuses to start for
its pool is a fuzzer bug (status ``fuzzer-bug``), not a finding.

**Statuses.** ``ok``; ``failed`` (diverged: a divergence or a drift
violation; or an engine error at run time); ``refused`` (vLLM or the fork
refuses the combination by design: ``REFUSED_BY_DESIGN``, e.g. async
scheduling with a custom drafter on V1, n-gram on MRV2 on v0.26.0);
``invalid`` (any other configuration-time refusal: a combination the draw
should not make, kept apart so it can be fixed); ``fuzzer-bug`` (the pool
did not start); ``timeout`` / ``crashed`` (the child did not report).

**Shrinking** is a second phase (``shrink``), since each step is a GPU run:
greedy, hypothesis-style: from the failing configuration, try simpler
neighbours (``neighbours``: fewer and shorter prompts, eager, sync, no
prefix caching, ample pool, smaller k and max_num_seqs, a larger budget,
fewer output tokens, ...), simplest first, a few per child process; move to
the first that fails the same way, until none does. The state is saved
after every step (``--state``), so a shrink spans several GPU calls. The
minimal configuration goes to ``harness/regressions/<name>.json``; the
matrix slice ``fuzz-regressions`` runs them all (``regression_cells``).

Why hand-written: hypothesis draws and shrinks (the CPU tests use it to
check the draw, ``tests/test_fuzz.py``), but its engine evaluates the test
function in-process, back to back, until it is done, and keeps no partially
shrunk example across processes; here one evaluation is a GPU engine run of
tens of seconds in a child process, a shrink spans several 10-minute GPU
calls, and neighbours that share a reference should run together. The
draw is a seeded ``random`` so that a deadline, not an example count, ends a
run, and every variant sees the same configurations.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .fuzz_pool import POOL_BASE, POOL_LOG, POOL_REFUSALS, install_pool_hook

REGRESSIONS = Path(__file__).resolve().parent / "regressions"
FASTAPPLY = "fastapply"

# model families; weights of the draw
MODELS = {
    "qwen3_5": 3,
    "nemotron_h": 3,
    FASTAPPLY: 3,
    "qwen3_next": 1,
    "granitemoehybrid": 1,
}
RUNNERS = ("v1", "mrv2", "default")
SCHEDULES = (
    "accept_then_zero",
    "heterogeneous",
    "random",
    "boundary",
    "all_accept",
    "all_zero",
)
# drafter -> weight; availability per model in drafters_for
DRAFTERS = {
    "ngram": 4,
    "ngram_gpu": 2,
    # per-request n-gram draft lengths (the fork's draft_length_policy; V1)
    "ngram:acceptance": 2,
    "mtp": 3,
    **{f"scripted:{s}": 1 for s in SCHEDULES},
    "draft_model:dense": 1,
    "eagle3": 1,
}
# ladders: the values a dimension takes, simplest first where shrinking
# moves toward the simplest
K_LADDER = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)
SEQS_LADDER = (1, 2, 3, 4, 6, 8, 16, 32, 64)
# per-step token budgets under chunked prefill; the draw weights small ones
BUDGETS = (16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512)
MAX_TOKENS = (16, 32, 64, 96, 128)
# prompt lengths (shortest, longest), shortest band first
PROMPT_BANDS = ((4, 16), (8, 48), (24, 200), (100, 400))
SLACKS = (0, 1, 2, 4, 8, 16, 32)
GRAPHS = ("eager", "full_and_piecewise", "piecewise", "full_decode_only")
# request features of a group (harness.equivalence.request_kwargs) -> weight
REQUESTS = {"plain": 6, "stop": 2, "regex": 1, "plp": 1}

# error texts of refusals by design (vLLM's or the fork's), by line
REFUSED_BY_DESIGN = (
    # fork: draft_model with a hybrid draft
    "does not support draft models with recurrent state",
    # v0.33.0: V1 + async scheduling + a host-side drafter (custom_class,
    # n-gram)
    "Async scheduling is not supported by the V1 model runner with",
    # Mamba prefix caching (align) needs chunked prefill ("... for Mamba
    # prefix caching" on v0.33.0, "... for mamba cache mode 'align'" on
    # v0.26.0)
    "Chunked prefill is required for",
    # async scheduling with a host-side drafter
    "async scheduling is only supported with",
    # a token budget too small for the draft slots of the speculative config
    # (v0.26.0: "... does not allow any tokens to be scheduled" / "... not
    # have enough slots to support ..."; v0.33.0: "... enough slots to
    # schedule a token and support ...")
    "does not allow any tokens to be scheduled",
    "enough slots to",
    # MRV2 feature gaps (n-gram and draft_model on v0.26.0)
    "Model Runner V2 does not yet support",
    "Speculative decoding is not supported for",
    # unpatched bases: the fork's opt-in draft_length_policy does not exist
    "draft_length_policy\n  Unexpected keyword argument",
)
FAILED, OK = "failed", "ok"
LOST = ("timeout", "crashed")


@dataclass(frozen=True)
class FuzzConfig:
    model: str
    drafter: str
    k: int
    runner: str = "v1"
    lookup_min: int = 2  # n-gram drafters only
    lookup_max: int = 5
    max_num_seqs: int = 8
    n_prompts: int = 8
    prompt_seed: int = 0
    prompt_band: int = 2  # index into PROMPT_BANDS
    max_tokens: int = 64
    cache_mode: str = "none"  # none | align (a second wave hits the cache)
    chunked: bool = False
    budget: int | None = None  # max_num_batched_tokens when chunked
    pool_slack: int | None = None  # None: ample pool
    graphs: str = "eager"
    async_sched: bool = False
    # request features (harness.equivalence.request_kwargs): plain | stop |
    # regex | plp; turns: waves in align mode, each continuing the one before
    request: str = "plain"
    turns: int = 2

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> FuzzConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def ref_shape(self) -> tuple:
        """What the non-speculative reference depends on."""
        return (
            self.model,
            self.n_prompts,
            self.prompt_seed,
            self.prompt_band,
            self.max_tokens,
            self.cache_mode == "align",
            self.request,
            self.turns,
        )

    def name(self) -> str:
        h = hashlib.sha1(json.dumps(self.to_json(), sort_keys=True).encode())
        drafter = self.drafter.replace(":", "-")
        return f"{self.model}-{drafter}-k{self.k}-{h.hexdigest()[:8]}"


# ---------------------------------------------------------------------------
# draw


def has_mtp(model: str) -> bool:
    from .models import FIXTURES

    return model == FASTAPPLY or bool(FIXTURES[model]["mtp"])


def drafters_for(model: str, runner: str) -> list[str]:
    """The drafters a model has: MTP (and, on MRV2, the scripted schedules,
    played through the MTP speculator) where the fixture carries MTP
    weights; EAGLE-3 heads for the Qwen3.5 fixtures; the attention-only
    draft model for Qwen3.5, NemotronH and the fast-apply fixture."""
    out = []
    for d in DRAFTERS:
        needs_mtp = d == "mtp" or (d.startswith("scripted:") and runner == "mrv2")
        if needs_mtp and not has_mtp(model):
            continue
        if d == "eagle3" and model not in ("qwen3_5", FASTAPPLY):
            continue
        if d == "ngram:acceptance" and runner == "mrv2":
            continue  # V1 only (the default runner on both lines with it)
        if d == "draft_model:dense" and model not in (
            "qwen3_5",
            "nemotron_h",
            FASTAPPLY,
        ):
            continue
        out.append(d)
    return out


def _pick(rng: random.Random, weights: dict):
    keys = list(weights)
    return rng.choices(keys, [weights[k] for k in keys])[0]


def _geometric(rng: random.Random, values, p: float = 0.35):
    """values[i] with probability ~ (1-p)**i: small indices favoured."""
    w = [(1 - p) ** i for i in range(len(values))]
    return rng.choices(list(values), w)[0]


def draw_shape(rng: random.Random) -> dict:
    """A reference shape: what a group of configurations shares."""
    model = _pick(rng, MODELS)
    cache_mode = rng.choice(("none", "align"))
    return {
        "model": model,
        "n_prompts": rng.choice((1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)),
        "prompt_seed": rng.randrange(1 << 16),
        "prompt_band": rng.randrange(len(PROMPT_BANDS)),
        # the fast-apply fixture's answers end at EOS (117 tokens at most)
        "max_tokens": 128 if model == FASTAPPLY else rng.choice(MAX_TOKENS),
        "cache_mode": cache_mode,
        # production request features: stop token ids that end answers inside
        # accepted runs, structured output whose grammar rejects drafts,
        # prompt logprobs returned beside speculation
        "request": _pick(rng, REQUESTS),
        # conversations of more turns on blocks written while speculating
        "turns": rng.choice((2, 2, 3, 4)) if cache_mode == "align" else 2,
    }


def draw_config(rng: random.Random, shape: dict | None = None) -> FuzzConfig:
    shape = shape or draw_shape(rng)
    runner = rng.choice(RUNNERS)
    drafter = _pick(rng, {d: DRAFTERS[d] for d in drafters_for(shape["model"], runner)})
    if drafter == "mtp":
        k = rng.choice((1, 2, 3, 4))
    elif drafter.startswith("ngram"):
        k = _geometric(rng, K_LADDER[2:], 0.15)
    elif drafter.startswith("scripted:"):
        k = rng.choice((1, 2, 3, 4, 5, 8))
    else:
        k = rng.choice((1, 2, 3, 5))
    lo = rng.choice((1, 2, 3))
    # drafters that run on the host: async scheduling is refused with them
    # on V1 (REFUSED_BY_DESIGN), so drawn rarely
    host_side = drafter in ("ngram", "ngram:acceptance") or drafter.startswith(
        "scripted:"
    )
    # Mamba prefix caching (align) needs chunked prefill (both lines refuse
    # it without)
    chunked = shape["cache_mode"] == "align" or rng.random() < 0.7
    budget = _geometric(rng, BUDGETS, 0.25) if chunked else None
    seqs = rng.choice(SEQS_LADDER)
    if budget is not None:
        # vLLM refuses a budget below max_num_seqs (SchedulerConfig)
        seqs = max(s for s in SEQS_LADDER if s <= min(seqs, budget))
    return FuzzConfig(
        runner=runner,
        drafter=drafter,
        k=k,
        lookup_min=lo,
        lookup_max=rng.randint(lo, max(lo, min(10, k))),
        max_num_seqs=seqs,
        chunked=chunked,
        budget=budget,
        pool_slack=_geometric(rng, SLACKS) if rng.random() < 0.4 else None,
        graphs=rng.choices(GRAPHS, (6, 3, 1, 1))[0],
        async_sched=rng.random() < (0.15 if host_side else 0.6),
        **shape,
    )


def draw_group(rng: random.Random, size: int) -> list[FuzzConfig]:
    shape = draw_shape(rng)
    return [draw_config(rng, shape) for _ in range(size)]


def draw(seed: int, count: int, group: int = 4) -> list[list[FuzzConfig]]:
    """The first ``count`` configurations of ``seed``, in groups."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < count:
        g = draw_group(rng, min(group, count - n))
        out.append(g)
        n += len(g)
    return out


# ---------------------------------------------------------------------------
# configuration -> Cell


def prompts_of(cfg: FuzzConfig) -> list[list[int]]:
    from .equivalence import cell_prompts

    return cell_prompts(
        cfg.model, cfg.n_prompts, cfg.prompt_seed, PROMPT_BANDS[cfg.prompt_band]
    )


def model_len(cfg: FuzzConfig) -> int:
    """max_model_len: the longest request the configuration makes (a
    later wave's prompt is the wave before's prompt, three quarters of its
    continuation and 4 fresh tokens: harness.equivalence.second_wave), its
    output, the k lookahead slots, rounded up to 16."""
    longest = max(len(p) for p in prompts_of(cfg))
    if cfg.cache_mode == "align":
        longest += (cfg.turns - 1) * (cfg.max_tokens * 3 // 4 + 4)
    need = longest + cfg.max_tokens + cfg.k + 1
    return -(-need // 16) * 16


def spec_override(cfg: FuzzConfig) -> dict | None:
    if cfg.drafter in ("ngram", "ngram_gpu", "ngram:acceptance"):
        config = {
            "method": cfg.drafter.split(":")[0],
            "num_speculative_tokens": cfg.k,
            "prompt_lookup_min": cfg.lookup_min,
            "prompt_lookup_max": cfg.lookup_max,
        }
        if cfg.drafter == "ngram:acceptance":
            config["draft_length_policy"] = "acceptance"
        return config
    return None


def to_cell(cfg: FuzzConfig):
    from .equivalence import Cell

    extra: dict = {
        "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": model_len(cfg),
        "enable_chunked_prefill": cfg.chunked,
    }
    if cfg.chunked:
        extra["max_num_batched_tokens"] = cfg.budget
    if cfg.pool_slack is not None:
        extra["num_gpu_blocks_override"] = POOL_BASE + cfg.pool_slack
    spec = spec_override(cfg)
    if spec:
        extra["speculative_config"] = spec
    lo_hi = PROMPT_BANDS[cfg.prompt_band]
    return Cell(
        cfg.model,
        cfg.drafter,
        cfg.k,
        cfg.n_prompts,
        cfg.runner,
        cfg.cache_mode,
        cfg.graphs,
        async_sched=cfg.async_sched,
        chunked=cfg.chunked,
        max_tokens=cfg.max_tokens,
        extra=extra,
        prompts=(cfg.n_prompts, cfg.prompt_seed, *lo_hi),
        request=cfg.request,
        turns=cfg.turns,
    )


def engine_kwargs_of(cfg: FuzzConfig, model_dir: str = "<model>") -> dict:
    from .equivalence import engine_kwargs, spec_config

    cell = to_cell(cfg)
    return engine_kwargs(cell, model_dir, spec_config(cell))


# ---------------------------------------------------------------------------
# judging a row of run_cells


def classify(row: dict) -> str:
    status = row.get("status")
    err = row.get("error") or ""
    if status in ("rejected", "error") and any(m in err for m in POOL_REFUSALS):
        return "fuzzer-bug"
    if status == "rejected":
        if any(m in err for m in REFUSED_BY_DESIGN):
            return "refused"
        return "invalid"
    if status == "ok":
        return OK
    if status in ("diverged", "error"):
        return FAILED
    return str(status)


def failure_kind(result: dict) -> str | None:
    """What a failure is, for "fails the same way": diverged, the error's
    exception type, or a child that crashed or hung."""
    if result.get("status") in LOST:
        return result["status"]
    if result.get("status") != FAILED:
        return None
    if result.get("error"):
        return "error:" + result["error"].split(":", 1)[0].strip()
    return "diverged"


def worst_drift(row: dict) -> dict | None:
    m, t = row.get("drift_max"), row.get("drift_threshold")
    if isinstance(m, (int, float)) and isinstance(t, (int, float)) and t > 0:
        return {
            "max": m,
            "threshold": t,
            "ratio": round(m / t, 3),
            "violations": row.get("drift_violations"),
        }
    return None


ROW_KEEP = (
    "status",
    "tokens",
    "divergences",
    "ties",
    "first_divergence",
    "max_margin",
    "tie_margin",
    "accept",
    "drafts_per_step",
    "error",
    "traceback",  # the engine error's last frames: what a failure is triaged by
    "drift_violations",
    "first_drift",
    "drift_worst_at",
    "drift_topk_max",
    "drift_topk_threshold",
    # the prompt-logprob oracle of "plp" requests: what flagged such a
    # configuration, and by how much
    "prompt_drift_max",
    "prompt_drift_threshold",
    "prompt_drift_topk_max",
    "prompt_drift_topk_threshold",
    "prompt_drift_violations",
    "prompt_drift_floor",
    "prompt_differs",
    "prompt_first_drift",
    "prompt_drift_worst_at",
)


def result_line(cid: str, cfg: FuzzConfig, row: dict, pool: dict | None) -> dict:
    return {
        "event": "result",
        "id": cid,
        "config": cfg.to_json(),
        "status": classify(row),
        "divergences": row.get("divergences"),
        "first_divergence": row.get("first_divergence"),
        "error": (row.get("error") or "")[:600] or None,
        "worst_drift": worst_drift(row),
        "wall_s": row.get("wall_s"),
        "pool": pool,
        "row": {k: row.get(k) for k in ROW_KEEP if row.get(k) is not None},
    }


# ---------------------------------------------------------------------------
# JSON lines


def append(path: Path, obj: dict) -> None:
    """One line, flushed and synced: a kill loses at most a partial last
    line, which read_lines skips."""
    with open(path, "a") as f:
        f.write(json.dumps(obj, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_lines(path: Path) -> list[dict]:
    return _parse(Path(path).read_text())


def _parse(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return out


def outcomes(lines: Iterable[dict]) -> dict[str, dict]:
    """id -> the configuration's outcome: its result line, or a lost one
    (start line, no result: ``crashed``/``timeout`` where the parent wrote
    a ``lost`` line, else ``killed``)."""
    out: dict[str, dict] = {}
    for ln in lines:
        ev, cid = ln.get("event"), ln.get("id")
        if ev == "start":  # a new attempt (an id run again starts afresh)
            out[cid] = {**ln, "event": "result", "status": "killed"}
        elif ev == "result":
            out[cid] = ln
        elif ev == "lost" and out.get(cid, {}).get("status") in (None, "killed"):
            # a shrink run's file has no start lines: the lost line stands in
            base = out.get(cid, {**ln, "event": "result"})
            out[cid] = {**base, "status": ln["status"], "error": ln.get("error")}
    return out


# ---------------------------------------------------------------------------
# running


def run_group_here(
    items: list[tuple[str, FuzzConfig]],
    out: Path,
    seed: int,
    deadline_s: float | None = None,
) -> list[dict]:
    """Run one group through run_cells in this process (vLLM, a GPU) and
    append a result line per configuration."""
    from .equivalence import run_cells

    install_pool_hook()
    cells = [to_cell(c) for _, c in items]
    POOL_LOG.clear()
    with tempfile.TemporaryDirectory(prefix="hsfork-fuzz-") as tmp:
        rows = run_cells(cells, Path(tmp), 1, seed, deadline_s)
    # the hook logs one entry per engine that asked for a sized pool: the
    # pooled configurations that reached their engine, in order
    pooled = [i for i, (_, c) in enumerate(items) if c.pool_slack is not None]
    pools = dict(zip(pooled, POOL_LOG, strict=False))
    if len(POOL_LOG) != len(pooled):
        pools = {}
    results = []
    for i, (cid, cfg) in enumerate(items):
        if i < len(rows):
            r = result_line(cid, cfg, rows[i], pools.get(i))
        else:  # the deadline came first (run_cells starts no new cell)
            r = {
                "event": "result",
                "id": cid,
                "config": cfg.to_json(),
                "status": "skipped",
            }
        append(out, r)
        results.append(r)
    return results


TWIN = "-twin"


def twin(cfg: FuzzConfig) -> FuzzConfig:
    """The configuration without speculation: the same engine (runner, token
    budget, chunking, pool, graphs, scheduling, prompts), no drafter."""
    return dataclasses.replace(cfg, drafter="none")


def twin_verdict(res: dict[str, dict], cid: str) -> str:
    """What a failure's non-speculative twin (``regroup --twin``) says: the
    divergence comes from speculation (the twin matches the reference), or
    from the configuration itself (the twin diverges too: batch shapes,
    chunking or a bug without speculation)."""
    t = res.get(cid + TWIN)
    if t is None:
        return "-"
    if t["status"] == OK:
        return "speculation (twin ok)"
    if t["status"] == FAILED:
        return "configuration (twin fails too)"
    return f"twin {t['status']}"


def regroup(
    runs: list[Path], ids: list[str], out: Path, twins: bool = False
) -> list[Path]:
    """One group file (``run-group``'s input) per configuration of ``runs``
    named in ``ids``, or per failure where ``ids`` is empty, with the seed it
    was drawn with: to run failures again alone (another stack, both
    variants, their tracebacks kept) without drawing their groups again.
    ``twins``: each group also runs the configuration's non-speculative twin
    (id ``<id>-twin``), against the same reference."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for run in runs:
        lines = read_lines(run)
        seeds = {ln["id"]: ln.get("seed", 0) for ln in lines if ln["event"] == "start"}
        for cid, r in outcomes(lines).items():
            wanted = cid in ids if ids else r["status"] == FAILED
            if not wanted:
                continue
            path = out / f"{cid}.json"
            items = [[cid, r["config"]]]
            if twins:
                cfg = FuzzConfig.from_json(r["config"])
                items.append([cid + TWIN, twin(cfg).to_json()])
            path.write_text(json.dumps({"seed": seeds.get(cid, 0), "items": items}))
            written.append(path)
    missing = set(ids) - {p.stem for p in written}
    if missing:
        raise SystemExit(f"not in {[str(r) for r in runs]}: {sorted(missing)}")
    return written


def run_group_child(
    items: list[tuple[str, FuzzConfig]], out: Path, seed: int, timeout_s: float
) -> list[dict]:
    """Run a group in a child process; configurations it did not report are
    written as lost (``timeout`` or ``crashed``, the child's last output)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"seed": seed, "items": [[i, c.to_json()] for i, c in items]}, f)
        group_file = f.name
    # results of this child only: the lines appended after this offset
    offset = Path(out).stat().st_size if Path(out).exists() else 0
    cmd = [
        sys.executable,
        "-m",
        "harness.fuzz",
        "run-group",
        group_file,
        "--out",
        str(out),
        "--deadline",
        str(max(1.0, timeout_s - 60)),
    ]
    t0 = time.time()
    status, tail = "crashed", ""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        tail = f"exit {p.returncode}: " + (p.stdout + p.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        status = "timeout"
        tail = ((e.stdout or b"") + (e.stderr or b"")).decode(errors="replace")[-1500:]
    finally:
        os.unlink(group_file)
    got = {}
    if Path(out).exists():
        with open(out) as f:
            f.seek(offset)
            got = outcomes(_parse(f.read()))
    results = []
    for cid, cfg in items:
        r = got.get(cid)
        if r is None:
            r = {
                "event": "lost",
                "id": cid,
                "config": cfg.to_json(),
                "status": status,
                "error": tail,
                "wall_s": round(time.time() - t0, 1),
            }
            append(out, r)
        results.append(r)
    return results


def fuzz_run(
    out: Path,
    seed: int,
    deadline_s: float,
    group: int = 4,
    per_config_s: float = 120,
    variant: str = "",
    runner: Callable | None = None,
    limit: int | None = None,
    min_group_s: float = 150,
) -> dict:
    """Draw groups from ``seed`` and run them until ``deadline_s`` (or
    ``limit`` configurations); every configuration gets a start line before
    its group runs."""
    from . import compat

    runner = runner or run_group_child
    if deadline_s < min_group_s:
        print(
            f"fuzz: a deadline of {deadline_s:g} s leaves no room for one group "
            f"(a group starts only with {min_group_s:g} s left): nothing run",
            file=sys.stderr,
        )
    start = time.time()
    rng = random.Random(seed)
    n = 0
    version = compat.version_str()
    while True:
        left = deadline_s - (time.time() - start)
        if left < min_group_s or (limit is not None and n >= limit):
            break
        g = draw_group(rng, group)
        items = [(f"s{seed}-{n + i}", c) for i, c in enumerate(g)]
        n += len(g)
        for cid, c in items:
            append(
                out,
                {
                    "event": "start",
                    "id": cid,
                    "config": c.to_json(),
                    "seed": seed,
                    "variant": variant,
                    "vllm": version,
                    "t": round(time.time() - start, 1),
                },
            )
        runner(items, out, seed, min(left, per_config_s * len(g) + 90))
    return summary(read_lines(out) if Path(out).exists() else [])


def summary(lines: list[dict]) -> dict:
    res = outcomes(lines)
    counts = Counter(r["status"] for r in res.values())
    fails = [
        {
            "id": cid,
            "status": r["status"],
            "kind": failure_kind(r),
            "first_divergence": r.get("first_divergence"),
            "error": (r.get("error") or "")[-300:] or None,
            "config": r["config"],
        }
        for cid, r in res.items()
        if r["status"] in (FAILED, *LOST, "fuzzer-bug")
    ]
    return {"tried": len(res), "counts": dict(counts), "failures": fails}


# ---------------------------------------------------------------------------
# shrinking


def _ladder_moves(value, ladder, toward_end: bool = False) -> list:
    """Values simpler than ``value`` on a ladder (simplest first): the
    simplest, the midpoint, the adjacent one. ``toward_end``: larger is
    simpler."""
    lad = list(ladder)[::-1] if toward_end else list(ladder)
    if value not in lad:
        return [lad[0]]
    i = lad.index(value)
    picks = [lad[0], lad[i // 2], lad[i - 1]] if i > 0 else []
    return list(dict.fromkeys(picks))


def neighbours(cfg: FuzzConfig) -> list[FuzzConfig]:
    """Simpler configurations, simplest changes first (one dimension
    each)."""
    rep = dataclasses.replace
    out: list[FuzzConfig] = []
    if cfg.graphs != "eager":
        out.append(rep(cfg, graphs="eager"))
    if cfg.async_sched:
        out.append(rep(cfg, async_sched=False))
    if cfg.pool_slack is not None:
        out.append(rep(cfg, pool_slack=None))
    if cfg.request != "plain":
        out.append(rep(cfg, request="plain"))
    if cfg.turns != 2:
        out.append(rep(cfg, turns=2))
    if cfg.cache_mode != "none":
        out.append(rep(cfg, cache_mode="none", turns=2))
    if cfg.chunked and cfg.cache_mode == "none":  # align needs chunked prefill
        out.append(rep(cfg, chunked=False, budget=None))
    for n in _ladder_moves(cfg.n_prompts, range(1, cfg.n_prompts + 1)):
        out.append(rep(cfg, n_prompts=n))
    for b in _ladder_moves(cfg.prompt_band, range(len(PROMPT_BANDS))):
        if cfg.model != FASTAPPLY:  # its prompts are the task's own
            out.append(rep(cfg, prompt_band=b))
    for t in _ladder_moves(cfg.max_tokens, MAX_TOKENS):
        if cfg.model != FASTAPPLY:
            out.append(rep(cfg, max_tokens=t))
    for k in _ladder_moves(cfg.k, K_LADDER):
        out.append(
            rep(cfg, k=k, lookup_max=max(cfg.lookup_min, min(cfg.lookup_max, k)))
        )
    for s in _ladder_moves(cfg.max_num_seqs, SEQS_LADDER):
        out.append(rep(cfg, max_num_seqs=s))
    if cfg.chunked and cfg.budget is not None:
        for b in _ladder_moves(cfg.budget, BUDGETS, toward_end=True):
            out.append(rep(cfg, budget=b))
    if cfg.pool_slack is not None:
        for s in _ladder_moves(cfg.pool_slack, SLACKS, toward_end=True):
            out.append(rep(cfg, pool_slack=s))
    if cfg.drafter.startswith("ngram") and cfg.lookup_max > cfg.lookup_min:
        out.append(rep(cfg, lookup_max=cfg.lookup_min))
    if cfg.runner != "v1" and "v1" in _runners_for(cfg):
        out.append(rep(cfg, runner="v1"))
    return list(dict.fromkeys(c for c in out if c != cfg))


def _runners_for(cfg: FuzzConfig) -> list[str]:
    return [r for r in RUNNERS if cfg.drafter in drafters_for(cfg.model, r)]


def complexity(cfg: FuzzConfig) -> tuple:
    """A total order in which each neighbour is smaller than its origin."""

    def pos(v, lad, rev=False):
        lad = list(lad)[::-1] if rev else list(lad)
        return lad.index(v) if v in lad else len(lad)

    return (
        (cfg.graphs != "eager")
        + cfg.async_sched
        + (cfg.pool_slack is not None)
        + (cfg.cache_mode != "none")
        + cfg.chunked
        + (cfg.runner != "v1")
        + (cfg.request != "plain")
        + (cfg.turns != 2),
        cfg.n_prompts
        + cfg.prompt_band
        + pos(cfg.max_tokens, MAX_TOKENS)
        + pos(cfg.k, K_LADDER)
        + pos(cfg.max_num_seqs, SEQS_LADDER)
        + (pos(cfg.budget, BUDGETS, True) if cfg.chunked else 0)
        + (pos(cfg.pool_slack, SLACKS, True) if cfg.pool_slack is not None else 0)
        + cfg.lookup_max
        - cfg.lookup_min,
    )


Runner = Callable[[list[tuple[str, FuzzConfig]]], list[dict]]


def shrink(
    cfg: FuzzConfig,
    kind: str,
    run: Runner,
    per_call: int = 4,
    state: Path | None = None,
    deadline_s: float | None = None,
    log: Callable[[str], None] = lambda s: None,
    min_call_s: float = 0,
) -> dict:
    """Greedy shrinking: first run the failing configuration again (a
    failure that does not reproduce is not shrunk: ``reproduced`` False);
    then run the neighbours of the current configuration, ``per_call`` at a
    time (one call of ``run``), simplest first; move to the first that fails
    the same way (``kind``); stop when none does. The state (current,
    tried) goes to ``state`` after every call, and is resumed from there."""
    start = time.time()
    if kind in LOST:
        # a crash or hang loses every configuration of its child's group: a
        # lost result in a batch does not say which neighbour crashed, so a
        # lost kind is shrunk one neighbour per call
        per_call = 1
    st = {
        "kind": kind,
        "current": cfg.to_json(),
        "steps": [],
        "tried": {},
        "done": False,
        "reproduced": None,
    }
    if state and state.exists():
        st = json.loads(state.read_text())
    n_call, calls_here = len(st["tried"]), 0
    if st.get("reproduced") is None:
        (r,) = run([(f"shrink-{int(time.time())}-again", cfg)])
        n_call, calls_here = n_call + 1, 1
        st["reproduced"] = failure_kind(r) == kind
        st["done"] = not st["reproduced"]
        log(f"reproduced: {st['reproduced']} ({r.get('status')})")
        _save(state, st)
    while not st["done"]:
        cur = FuzzConfig.from_json(st["current"])
        cands = [c for c in neighbours(cur) if c.name() not in st["tried"]]
        if not cands:
            st["done"] = True
            break
        moved = False
        for i in range(0, len(cands), per_call):
            # at least one call per invocation, then until the deadline
            late = (
                deadline_s is not None and time.time() - start > deadline_s - min_call_s
            )
            if late and calls_here:
                _save(state, st)
                return st
            batch = cands[i : i + per_call]
            tag = f"shrink-{int(time.time())}-{n_call}"
            results = run([(f"{tag}-{j}", c) for j, c in enumerate(batch)])
            n_call, calls_here = n_call + 1, calls_here + 1
            for c, r in zip(batch, results, strict=True):
                st["tried"][c.name()] = r.get("status")
            same = [
                c
                for c, r in zip(batch, results, strict=True)
                if failure_kind(r) == kind
            ]
            if same:
                best = min(same, key=complexity)
                st["steps"].append(
                    {"from": cur.name(), "to": best.name(), "config": best.to_json()}
                )
                st["current"] = best.to_json()
                log(f"shrunk to {best}")
                moved = True
                break
            _save(state, st)
        if not moved:
            st["done"] = True
        _save(state, st)
    _save(state, st)
    return st


def _save(path: Path | None, st: dict) -> None:
    if path:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(st, indent=1))
        tmp.replace(path)


def write_regression(
    cfg: FuzzConfig, result: dict, found: dict, directory: Path = REGRESSIONS
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{cfg.name()}.json"
    path.write_text(
        json.dumps(
            {
                "name": cfg.name(),
                "config": cfg.to_json(),
                # what the matrix slice fuzz-regressions runs
                "cell": dataclasses.asdict(to_cell(cfg)),
                "failure": failure_kind(result) or result.get("status"),
                "first_divergence": result.get("first_divergence"),
                "error": result.get("error"),
                "found": found,
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    return path


def regression_configs(directory: Path = REGRESSIONS) -> list[FuzzConfig]:
    return [
        FuzzConfig.from_json(json.loads(p.read_text())["config"])
        for p in sorted(Path(directory).glob("*.json"))
    ]


def regression_cells(directory: Path = REGRESSIONS):
    """The matrix slice ``fuzz-regressions`` (each file's ``cell``)."""
    from .equivalence import regression_cells as cells

    return cells(directory)


# ---------------------------------------------------------------------------
# report


def dimension_rates(res: Iterable[dict]) -> dict[str, dict]:
    """dimension -> value -> [tried, failed] over the ok/failed outcomes."""
    rates: dict[str, dict] = {}
    for r in res:
        if r["status"] not in (OK, FAILED):
            continue
        for dim, v in r["config"].items():
            if dim in ("prompt_seed",):
                continue
            if dim == "budget" and v is not None:
                v = "<=96" if v <= 96 else ">96"
            e = rates.setdefault(dim, {}).setdefault(str(v), [0, 0])
            e[0] += 1
            e[1] += r["status"] == FAILED
    return rates


def report(directory: Path) -> str:
    lines = [f"# Configuration fuzzer: {directory}", ""]
    for f in sorted(Path(directory).glob("*.jsonl")):
        raw = read_lines(f)
        res = outcomes(raw)
        version = next((ln.get("vllm") for ln in raw if ln.get("vllm")), "?")
        counts = Counter(r["status"] for r in res.values())
        lines += [
            f"## {f.stem} (vLLM {version})",
            "",
            f"{len(res)} configurations: "
            + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
            "",
        ]
        fails = [
            (cid, r)
            for cid, r in res.items()
            if r["status"] in (FAILED, *LOST, "fuzzer-bug", "invalid")
        ]
        if fails:
            lines += [
                "| id | status | model | runner | drafter | k | seqs | budget | cache "
                "| pool | graphs | async | prompts | first divergence / error "
                "| cause (non-spec twin) |",
                "|" + "---|" * 15,
            ]
            for cid, r in fails:
                c = r["config"]
                what = r.get("first_divergence") or (r.get("error") or "")[:160]
                what = str(what).replace("|", "/").replace("\n", " ")
                pool = "ample" if c["pool_slack"] is None else f"+{c['pool_slack']}"
                lines.append(
                    f"| {cid} | {r['status']} | {c['model']} | {c['runner']} | "
                    f"{c['drafter']} | {c['k']} | {c['max_num_seqs']} | "
                    f"{c['budget'] if c['chunked'] else '-'} | {c['cache_mode']} | "
                    f"{pool} | "
                    f"{c['graphs']} | {c['async_sched']} | {c['n_prompts']}x"
                    f"{PROMPT_BANDS[c['prompt_band']]} | {what} | "
                    f"{twin_verdict(res, cid)} |"
                )
            lines.append("")
        lines += lessons(res.values())
        drifts = [r for r in res.values() if r.get("worst_drift")]
        if drifts:
            w = max(drifts, key=lambda r: r["worst_drift"]["ratio"])
            lines += [
                f"Worst drift: {w['worst_drift']['max']} nats, "
                f"{w['worst_drift']['ratio']} of its threshold ({w['id']}).",
                "",
            ]
    lines += side_by_side(directory)
    regs = sorted(REGRESSIONS.glob("*.json")) if REGRESSIONS.exists() else []
    if regs:
        lines += ["## Kept regressions (harness/regressions)", ""]
        for p in regs:
            d = json.loads(p.read_text())
            lines.append(
                f"- `{p.name}`: {d.get('failure')}: {d.get('first_divergence')}"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def variant_of(path: Path) -> str:
    """``fork-s3.jsonl`` -> ``fork``: the variant of a run file."""
    stem = Path(path).stem
    head, _, tail = stem.rpartition("-s")
    return head if head and tail.isdigit() else stem


VERDICTS = {
    ("failed", "ok"): "fixed by the fork",
    ("ok", "failed"): "**fork only: a regression**",
    ("failed", "failed"): "open on both",
}


def side_by_side(directory: Path) -> list[str]:
    """The same configurations (same seed, same id) on the fork and on
    upstream: where their outcomes differ or both fail."""
    by_variant: dict[str, dict[str, dict]] = {}
    for f in sorted(Path(directory).glob("*.jsonl")):
        if f.stem.endswith("-shrink"):
            continue
        by_variant.setdefault(variant_of(f), {}).update(outcomes(read_lines(f)))
    fork, up = by_variant.get("fork"), by_variant.get("upstream")
    if not fork or not up:
        return []
    rows, tally = [], Counter()
    for cid in sorted(set(fork) & set(up)):
        a, b = up[cid]["status"], fork[cid]["status"]
        verdict = VERDICTS.get((a, b))
        tally[verdict or ("same" if a == b else "differs")] += 1
        if verdict or (a != b and OK in (a, b)):
            c = fork[cid]["config"]
            what = fork[cid].get("first_divergence") or up[cid].get("first_divergence")
            rows.append(
                f"| {cid} | {a} | {b} | {verdict or 'differs'} | {c['model']} "
                f"{c['runner']} {c['drafter']} k={c['k']} | {what} |"
            )
    out = [
        "## Fork vs upstream, configuration by configuration",
        "",
        ", ".join(f"{n} {v}" for v, n in sorted(tally.items())) + ".",
        "",
    ]
    if rows:
        out += [
            "| id | upstream | fork | verdict | configuration | first divergence |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    return out


def lessons(results: Iterable[dict]) -> list[str]:
    """What the failures teach: the values every failure shares, and per
    dimension the values whose failure rate stands out."""
    # non-speculative twins (regroup --twin) are controls, not draws
    res = [r for r in results if not str(r.get("id", "")).endswith(TWIN)]
    failed = [r["config"] for r in res if r["status"] == FAILED]
    if not failed:
        return ["No failures.", ""]
    shared = {
        k: v
        for k, v in failed[0].items()
        if k != "prompt_seed" and all(c.get(k) == v for c in failed)
    }
    out = [f"Every failure has: {shared or 'nothing in common'}.", ""]
    rates = dimension_rates(res)
    total = sum(r["status"] in (OK, FAILED) for r in res)
    base = len(failed) / total if total else 0
    hot = []
    for dim, vals in sorted(rates.items()):
        for v, (n, f) in sorted(vals.items()):
            if n >= 3 and f / n >= 2 * base and f >= 2:
                hot.append(f"{dim}={v}: {f}/{n} failed")
    if hot:
        out += [
            f"Failure rate at least twice the overall {base:.0%}: "
            + "; ".join(hot)
            + ".",
            "",
        ]
    return out


# ---------------------------------------------------------------------------
# command line


def _child_runner(
    out: Path, seed: int, per_config_s: float, deadline_s: float
) -> Runner:
    """Each call in a child, its time limit within the deadline (but at
    least one configuration's worth)."""
    start = time.time()

    def run(items):
        left = deadline_s - (time.time() - start)
        cap = per_config_s * len(items) + 90
        return run_group_child(items, out, seed, max(per_config_s + 90, min(cap, left)))

    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="draw and run configurations until a deadline")
    p.add_argument("--out", default="reports/fuzz")
    p.add_argument("--variant", default="fork")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=420)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--per-config", type=float, default=120)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print configurations and engine arguments, no vLLM",
    )
    p.add_argument("--count", type=int, default=16, help="dry run: how many")
    p = sub.add_parser("run-group", help="(internal) one group, in this process")
    p.add_argument("group")
    p.add_argument("--out", required=True)
    p.add_argument("--deadline", type=float, default=None)
    p = sub.add_parser("shrink", help="shrink a failing configuration")
    p.add_argument("failure", help="a JSON-lines run file, or one result JSON")
    p.add_argument("--id", default=None, help="which configuration of the file")
    p.add_argument("--state", default=None)
    p.add_argument("--deadline", type=float, default=420)
    p.add_argument("--per-call", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON lines of the shrink runs")
    p.add_argument("--regressions", default=str(REGRESSIONS))
    p = sub.add_parser(
        "regroup",
        help="write a group file per configuration to run again (run-group): "
        "the failures of run files, or the ids given",
    )
    p.add_argument("runs", nargs="+", help="JSON-lines run files")
    p.add_argument("--ids", default="", help="ID[,ID...] (default: every failure)")
    p.add_argument("--out", required=True, help="folder for the group files")
    p.add_argument(
        "--twin",
        action="store_true",
        help="run each configuration's non-speculative twin in its group too",
    )
    p = sub.add_parser("report", help="markdown summary of a fuzz directory")
    p.add_argument("dir")
    a = ap.parse_args(argv)

    if a.cmd == "run" and a.dry_run:
        for g in draw(a.seed, a.count, a.group):
            for c in g:
                print(
                    json.dumps(
                        {
                            "config": c.to_json(),
                            "cell": to_cell(c).key(),
                            "engine_kwargs": engine_kwargs_of(c),
                        },
                        default=str,
                    )
                )
        return
    if a.cmd == "run":
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        s = fuzz_run(
            out / f"{a.variant}-s{a.seed}.jsonl",
            a.seed,
            a.deadline,
            a.group,
            a.per_config,
            a.variant,
        )
        print(json.dumps(s, default=str))
        return
    if a.cmd == "regroup":
        ids = [i for i in a.ids.split(",") if i]
        for path in regroup([Path(r) for r in a.runs], ids, Path(a.out), a.twin):
            print(path)
        return
    if a.cmd == "run-group":
        g = json.loads(Path(a.group).read_text())
        items = [(i, FuzzConfig.from_json(c)) for i, c in g["items"]]
        run_group_here(items, Path(a.out), g["seed"], a.deadline)
        return
    if a.cmd == "shrink":
        src = Path(a.failure)
        if src.suffix == ".jsonl":
            res = outcomes(read_lines(src))
            if a.id is None:
                ids = [i for i, r in res.items() if r["status"] == FAILED]
                if not ids:
                    raise SystemExit(f"no failure in {src}")
                a.id = ids[0]
            failure = res[a.id]
        else:
            failure = json.loads(src.read_text())
        kind = failure_kind(failure)
        if kind is None:
            raise SystemExit(f"{a.id or src} is not a failure: {failure.get('status')}")
        cfg = FuzzConfig.from_json(failure["config"])
        state = Path(a.state or f"{src.with_suffix('')}-{cfg.name()}.shrink.json")
        out = Path(a.out or f"{src.with_suffix('')}-shrink.jsonl")
        st = shrink(
            cfg,
            kind,
            _child_runner(out, a.seed, 120, a.deadline),
            a.per_call,
            state,
            a.deadline,
            log=print,
            min_call_s=150,
        )
        if st["done"] and not st["reproduced"]:
            print(json.dumps({"not_reproduced": cfg.to_json(), "state": str(state)}))
        elif st["done"]:
            last = FuzzConfig.from_json(st["current"])
            res = outcomes(read_lines(out)) if out.exists() else {}
            same = [
                r
                for r in res.values()
                if r.get("config") == last.to_json() and failure_kind(r) == kind
            ]
            r = same[-1] if same else failure
            from . import compat

            path = write_regression(
                last,
                r,
                {
                    "from": failure.get("id"),
                    "original": cfg.to_json(),
                    "vllm": compat.version_str(),
                    "steps": len(st["steps"]),
                },
                Path(a.regressions),
            )
            print(json.dumps({"minimal": last.to_json(), "regression": str(path)}))
        else:
            print(json.dumps({"unfinished": st["current"], "state": str(state)}))
        return
    if a.cmd == "report":
        text = report(Path(a.dir))
        (Path(a.dir) / "FUZZ.md").write_text(text)
        print(text, end="")


if __name__ == "__main__":
    main()
