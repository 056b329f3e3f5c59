"""Scripted drafter for vLLM's Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``).

MRV2 rejects the ``custom_class`` method that installs
:class:`harness.drafter.ScriptedProposer` on the V1 runner, so here the
script (same file, same schedules: :mod:`harness.drafter`) is played through
a speculator MRV2 accepts: the engine runs with
``{"method": "mtp", "num_speculative_tokens": k}`` (a checkpoint with MTP
weights), and :func:`install` patches, in this process:

``AutoRegressiveSpeculator.propose`` (v0.26.0: ``vllm/v1/worker/gpu/
spec_decode/autoregressive/speculator.py``; v0.33.0:
``TargetDependentARSpeculator.propose`` in ``.../target_dependent_ar/
speculator.py``, :func:`harness.compat.mrv2_ar_speculator`; MTP, EAGLE and
EAGLE-3 inherit it)
    runs the real drafter (unless ``install(run_drafter=False)``), then
    overwrites the rows of scripted requests in the ``[num_reqs, k]`` int64
    draft tensor it returns, in place (the runner stores that tensor in
    ``req_states.draft_tokens``, which the next step's inputs read).
``GPUModelRunner.add_requests`` (``vllm/v1/worker/gpu/model_runner.py``)
    records each new request's prompt: the script recognizes requests by
    prompt, and the speculator sees only request ids.
``GPUModelRunner.take_draft_token_ids``
    under synchronous scheduling, cuts each scripted request's draft list to
    the scheduled number of drafts, so the scheduler schedules that many
    (0..k) for the next step (true zero-draft rows).

Rows and positions: ``propose`` runs in ``sample_tokens`` after the
rejection sampler and ``postprocess_sampled``; its ``input_batch.seq_lens``
(computed tokens before the step plus the step's query), ``num_rejected``
and ``num_sampled`` are GPU tensors of that step. The sequence holds
``seq_lens - num_rejected + 1`` tokens, the newest sampled one included, so
draft ``j`` is token ``seq_lens - num_rejected + 1 + j`` of the sequence:
``reference[generated + 1 + j]`` as on V1. These are read with one host sync
per step (test-only; with async scheduling the host does not know them).
Rows with ``num_sampled == 0`` (partial prefill chunks) get no step; rows of
requests the script does not know (MRV2's warmup requests) keep the real
drafter's tokens.

How many drafts a row carries:

* synchronous scheduling: the scheduler schedules the draft lists
  ``take_draft_token_ids`` returns (``EngineCore.post_step``), and MRV2 reads
  per-request draft counts from them (``prepare_inputs``:
  ``num_draft_tokens_per_req``), so every schedule means what it means on V1:
  ``n`` drafts (0..k), the first ``correct`` of them right.
* async scheduling: the scheduler gives every decode row ``k`` placeholder
  drafts (``AsyncScheduler._update_after_schedule``), so a row always carries
  ``k`` drafts, and a schedule's ``(n, correct)`` maps to ``k`` drafts, the
  first ``correct`` right, the rest wrong: ``all_zero`` becomes "every draft
  rejected" (the verify step still computes ``k + 1`` tokens),
  ``accept_then_zero`` alternates ``k`` accepted and 0 accepted,
  ``all_accept`` and ``random`` keep their accepted counts, and ``boundary``
  makes the *accepted* tokens end on (or one past) a block boundary while the
  rejected tail of the verify step runs ``k - correct`` tokens past it.

The log: one line per ``propose`` call with scripted rows, in
:class:`harness.drafter.ScriptedProposer`'s format (a JSON list of
``[row, step, generated, drafts carried]``), appended to ``HSFORK_SCRIPT_LOG``;
the same rows with the number of correct drafts (``[row, step, generated,
carried, correct]``) go to :func:`detail_log_path` of it.

Limits: in-process engines only (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
patches live in this process); greedy draft sampling (the default
``draft_sample_method``: with ``probabilistic`` the rejection sampler would
use the real drafter's probabilities); the real drafter's cost and failures
carry over unless ``run_drafter=False``; CUDA graphs need nothing special
(the real drafter runs, captured or not, and the scripted rows are copied
over its output afterwards, eagerly; dummy runs and capture are untouched).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .drafter import (
    LOG_ENV,
    SCRIPT_ENV,
    Schedule,
    Script,
    StepContext,
    drafts_for,
    wrong_token,
)

__all__ = [
    "MRV2Script",
    "RowPlan",
    "detail_log_path",
    "install",
    "installed",
    "plan_row",
    "spec_config",
    "speculator_class",
    "uninstall",
]

# the per-engine state, an attribute of the speculator
STATE_ATTR = "_hsfork_mrv2_script"
# a draft past the end of the reference (never verified in practice: the
# request has reached its max_tokens)
FILLER = 0

_RUNNER = "vllm.v1.worker.gpu.model_runner"

_ACTIVE = False
# run the real drafter under the scripted rows (False: skip it)
_RUN_DRAFTER = True
_ORIG: dict[str, object] = {}  # "propose" | "add_requests" | "take_draft_token_ids"


def spec_config(k: int) -> dict:
    """The engine's speculative config for a scripted MRV2 cell."""
    return {"method": "mtp", "num_speculative_tokens": k}


def detail_log_path(log_path: str | os.PathLike) -> Path:
    """Where the per-row correct-draft counts go, next to the V1-format log."""
    p = Path(log_path)
    return p.with_name(p.stem + ".mrv2.jsonl")


# ---------------------------------------------------------------------------
# pure logic


@dataclass(frozen=True)
class RowPlan:
    row: int  # index of the request in the script
    step: int
    generated: int  # output tokens before the one sampled last
    carried: int  # drafts the row carries into the verify step
    correct: int  # leading drafts equal to the reference
    tokens: tuple[int, ...]  # all k drafts MRV2 stores for the row


def plan_row(
    schedule: Schedule,
    ctx: StepContext,
    reference: Sequence[int],
    vocab_size: int,
    carry_all: bool,
) -> tuple[list[int], int, int]:
    """``(k draft tokens, drafts carried, correct leading drafts)`` of a row.

    The first drafts are :func:`harness.drafter.drafts_for`'s (what the V1
    drafter proposes); MRV2 stores ``k`` per row, so the rest are wrong
    tokens (the reference's next token plus one) or, past the reference's
    end, :data:`FILLER`. Without ``carry_all`` (synchronous scheduling) the
    row carries as many drafts as on V1; with it (async scheduling), all k.
    """
    v1 = drafts_for(schedule, ctx, reference, vocab_size)
    start = ctx.generated + 1
    correct = 0
    while correct < len(v1) and v1[correct] == reference[start + correct]:
        correct += 1
    tokens = list(v1)
    for j in range(len(v1), ctx.k):
        pos = start + j
        tokens.append(
            wrong_token(reference[pos], vocab_size)
            if 0 <= pos < len(reference)
            else FILLER
        )
    return tokens, (ctx.k if carry_all else len(v1)), correct


class MRV2Script:
    """The scripted drafter's state for one engine: prompts by request id,
    step counts by script row, the drafts each row carries from the last
    step, the log."""

    def __init__(
        self,
        script: Script,
        k: int,
        carry_all: bool,
        log_path: str | None = None,
    ) -> None:
        self.script = script
        self.k = k
        self.carry_all = carry_all
        self.log_path = log_path
        self.prompts: dict[str, tuple[int, ...]] = {}
        self._rows: dict[str, int | None] = {}
        self.steps: dict[int, int] = {}
        # req id -> drafts carried, from the last propose call
        self.carried: dict[str, int] = {}
        if log_path:
            detail_log_path(log_path).unlink(missing_ok=True)

    def add_request(self, req_id: str, prompt: Sequence[int] | None) -> None:
        self.prompts[req_id] = tuple(prompt or ())
        self._rows.pop(req_id, None)

    def row_of(self, req_id: str) -> int | None:
        if req_id not in self._rows:
            prompt = self.prompts.get(req_id)
            self._rows[req_id] = self.script.find(prompt) if prompt else None
        return self._rows[req_id]

    def plan(
        self,
        req_ids: Sequence[str],
        lengths: Sequence[int],
        num_sampled: Sequence[int],
    ) -> list[RowPlan | None]:
        """Drafts of each batch row; ``lengths[i]``: tokens in the row's
        sequence, the one sampled last included. ``None``: not scripted (a
        partial prefill, an unknown request)."""
        self.carried = {}
        plans: list[RowPlan | None] = []
        for req_id, length, sampled in zip(req_ids, lengths, num_sampled, strict=True):
            row = self.row_of(req_id) if sampled > 0 else None
            if row is None:
                plans.append(None)
                continue
            prompt, reference = self.script.requests[row]
            step = self.steps.get(row, 0)
            self.steps[row] = step + 1
            generated = int(length) - len(prompt) - 1
            ctx = StepContext(
                row,
                step,
                generated,
                int(length),
                self.k,
                self.script.block_size,
                self.script.seed,
            )
            tokens, carried, correct = plan_row(
                self.script.schedule,
                ctx,
                reference,
                self.script.vocab_size,
                self.carry_all,
            )
            self.carried[req_id] = carried
            plans.append(RowPlan(row, step, generated, carried, correct, tuple(tokens)))
        self._log([p for p in plans if p is not None])
        return plans

    def _log(self, plans: list[RowPlan]) -> None:
        if not self.log_path or not plans:
            return
        with open(self.log_path, "a") as fh:
            fh.write(
                json.dumps([(p.row, p.step, p.generated, p.carried) for p in plans])
                + "\n"
            )
        with open(detail_log_path(self.log_path), "a") as fh:
            fh.write(
                json.dumps(
                    [(p.row, p.step, p.generated, p.carried, p.correct) for p in plans]
                )
                + "\n"
            )

    def cut(self, req_ids: Sequence[str], drafts: list[list[int]]) -> list[list[int]]:
        """The scheduler's draft lists, each scripted request's cut to the
        drafts it carries (synchronous scheduling)."""
        if self.carry_all:
            return drafts
        return [
            d[: self.carried[r]] if r in self.carried else d
            for r, d in zip(req_ids, drafts, strict=True)
        ]


def new_state(vllm_config) -> MRV2Script:
    """The state of a scripted engine, from ``HSFORK_SCRIPT``."""
    path = os.environ.get(SCRIPT_ENV)
    if not path:
        raise RuntimeError(f"{SCRIPT_ENV} must name the drafter's script")
    spec = vllm_config.speculative_config
    method = getattr(spec, "draft_sample_method", "greedy")
    if method != "greedy":
        raise ValueError(
            f"the scripted MRV2 drafter needs draft_sample_method='greedy', "
            f"not {method!r}: the rejection sampler would use the real "
            "drafter's probabilities"
        )
    script = Script.load(path)
    if not script.block_size_given:
        script.block_size = int(vllm_config.cache_config.block_size)
    return MRV2Script(
        script,
        int(spec.num_speculative_tokens),
        carry_all=bool(vllm_config.scheduler_config.async_scheduling),
        log_path=os.environ.get(LOG_ENV),
    )


def state_of(speculator) -> MRV2Script | None:
    """The speculator's scripted state, made on first use while installed
    (so an engine made after :func:`uninstall` stays unscripted)."""
    if speculator is None:
        return None
    try:
        return vars(speculator)[STATE_ATTR]
    except KeyError:
        state = new_state(speculator.vllm_config) if _ACTIVE else None
        setattr(speculator, STATE_ATTR, state)
        return state


# ---------------------------------------------------------------------------
# the patches


def _wrap_propose(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def propose(self, *args, **kwargs):
        a = sig.bind(self, *args, **kwargs).arguments
        # dummy runs (profiling, DP sync) and unscripted engines: as is
        state = None if a.get("dummy_run", False) else state_of(self)
        if state is None:
            return orig(self, *args, **kwargs)
        import torch

        batch = a["input_batch"]
        n = batch.num_reqs
        if _RUN_DRAFTER:
            out = orig(self, *args, **kwargs)
        else:
            # the drafter's output buffer, as propose returns it; rows of
            # unknown requests keep stale tokens
            out = self.draft_tokens[:n, : self.num_speculative_steps]
        # one host sync: the step's accepted counts live on the GPU
        seq_lens = batch.seq_lens[:n].tolist()
        rejected = a["num_rejected"][:n].tolist()
        sampled = a["num_sampled"][:n].tolist()
        lengths = [s - r + 1 for s, r in zip(seq_lens, rejected, strict=True)]
        plans = state.plan(batch.req_ids[:n], lengths, sampled)
        if any(p is not None for p in plans):
            with torch.inference_mode():
                host = out.to("cpu", copy=True)
                width = host.shape[1]
                for i, p in enumerate(plans):
                    if p is not None:
                        host[i] = torch.tensor(p.tokens[:width], dtype=host.dtype)
                out.copy_(host)
        return out

    propose._hsfork_orig = orig  # type: ignore[attr-defined]
    return propose


def _wrap_add_requests(orig):
    @functools.wraps(orig)
    def add_requests(self, scheduler_output):
        state = state_of(getattr(self, "speculator", None))
        if state is not None:
            for new in scheduler_output.scheduled_new_reqs:
                state.add_request(new.req_id, new.prompt_token_ids)
        return orig(self, scheduler_output)

    add_requests._hsfork_orig = orig  # type: ignore[attr-defined]
    return add_requests


def _wrap_take_draft_token_ids(orig):
    @functools.wraps(orig)
    def take_draft_token_ids(self):
        out = orig(self)
        state = state_of(getattr(self, "speculator", None))
        if out is None or state is None:
            return out
        out.draft_token_ids = state.cut(out.req_ids, out.draft_token_ids)
        return out

    take_draft_token_ids._hsfork_orig = orig  # type: ignore[attr-defined]
    return take_draft_token_ids


def speculator_class():
    """MRV2's speculator class whose ``propose`` the patch wraps (it moved
    between vLLM lines: :func:`harness.compat.mrv2_ar_speculator`)."""
    import importlib

    from .compat import mrv2_ar_speculator

    module, name = mrv2_ar_speculator()
    return getattr(importlib.import_module(module), name)


def _targets():
    import importlib

    runner = importlib.import_module(_RUNNER)
    return [
        (speculator_class(), "propose", _wrap_propose),
        (runner.GPUModelRunner, "add_requests", _wrap_add_requests),
        (runner.GPUModelRunner, "take_draft_token_ids", _wrap_take_draft_token_ids),
    ]


def install(run_drafter: bool = True) -> None:
    """Patch MRV2 (once) and script the engines made from now on; call it
    before creating the LLM, with ``HSFORK_SCRIPT`` set.

    ``run_drafter=False`` skips the real drafter's forward passes on real
    steps (the scripted cell then does not depend on the drafter model
    working; rows of requests the script does not know get stale drafts).
    """
    global _ACTIVE, _RUN_DRAFTER
    _RUN_DRAFTER = run_drafter
    for cls, name, wrap in _targets():
        if name not in _ORIG:
            _ORIG[name] = cls.__dict__[name]
            setattr(cls, name, wrap(_ORIG[name]))
    _ACTIVE = True


def uninstall() -> None:
    """Restore MRV2's methods; engines made afterwards are not scripted."""
    global _ACTIVE, _RUN_DRAFTER
    _ACTIVE = False
    _RUN_DRAFTER = True
    if not _ORIG:
        return
    for cls, name, _ in _targets():
        if name in _ORIG:
            setattr(cls, name, _ORIG.pop(name))


@contextlib.contextmanager
def installed() -> Iterator[None]:
    install()
    try:
        yield
    finally:
        uninstall()
