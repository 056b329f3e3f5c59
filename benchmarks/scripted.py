"""A scripted drafter at a target acceptance rate, for the decode benchmark.

Installed through vLLM's ``custom_class`` proposer::

    {"method": "custom_class", "model": "benchmarks.scripted.RateProposer",
     "num_speculative_tokens": k}

It reuses the equivalence harness's drafter (``harness.drafter``: the
:class:`~harness.drafter.Script` of prompts and reference continuations, the
per-request step context and ``drafts_for``), but takes its script from this
module instead of a file: vLLM runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU), so the benchmark hands the
proposer its references with :func:`activate` after each reference pass.

Schedule: every step proposes ``k`` drafts; draft ``j`` is correct with
probability ``p`` independently, and the drafts after the first wrong one are
wrong too (an accepted *prefix*), with ``p`` chosen so that the expected
acceptance rate (accepted / proposed) is ``rate``. The draws are a hash of
(seed, request, step), so a run is reproducible and independent of batch
order. Without an active plan the proposer proposes nothing (the reference
pass).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from harness.drafter import Script, ScriptedProposer, StepContext, drafts_for

HEAD = 8  # requests are recognized by their first HEAD prompt tokens
MAX_K = 32  # two bytes of one blake2b digest (<= 64 bytes) per draft


def expected_rate(p: float, k: int) -> float:
    """Expected accepted/proposed when each of k drafts is correct with
    probability p and acceptance stops at the first wrong one."""
    return sum(p**j for j in range(1, k + 1)) / k


def prefix_probability(rate: float, k: int) -> float:
    """The per-draft probability p with ``expected_rate(p, k) == rate``."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"acceptance rate {rate} not in [0, 1]")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in 1..{MAX_K}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_rate(mid, k) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def accepted_prefix(seed: int, row: int, step: int, k: int, p: float) -> int:
    """Number of leading correct drafts (0..k) of one (request, step)."""
    h = hashlib.blake2b(
        f"{seed}:{row}:{step}:prefix".encode(), digest_size=2 * k
    ).digest()
    c = 0
    for j in range(k):
        if int.from_bytes(h[2 * j : 2 * j + 2], "little") / 65536.0 >= p:
            break
        c += 1
    return c


@dataclass
class Plan:
    """What the proposer drafts in one run; its counters are that run's."""

    script: Script
    rate: float
    p: float
    by_head: dict[tuple[int, ...], int]
    steps: dict[int, int] = field(default_factory=dict)
    proposed: int = 0  # drafts returned
    intended: int = 0  # of which meant to be correct
    calls: int = 0  # propose() calls with at least one scripted row
    diverged: set[int] = field(default_factory=set)  # rows off the reference
    # recorded (drafts, accepted) per step of each request (harness.traces):
    # request row r replays trace (r + trace_offset) mod len(traces), its
    # steps in a cycle
    traces: list[list[list[int]]] | None = None
    trace_offset: int = 0
    # a per-request draft-length policy (the fork's AcceptanceDraftLength:
    # observe(req_ids, drafts, sampled, scheduled), num_drafts(req_id, n))
    # that cuts each step's drafts, fed with this plan's own rows
    policy: object | None = None
    last: dict[int, int] = field(default_factory=dict)  # row -> drafts sent

    def schedule(self, ctx: StepContext) -> tuple[int, int]:
        if self.traces:
            trace = self.traces[(ctx.row + self.trace_offset) % len(self.traces)]
            drafts, accepted = trace[ctx.step % len(trace)]
            n = min(drafts, ctx.k)
            return n, min(accepted, n)
        return ctx.k, accepted_prefix(ctx.seed, ctx.row, ctx.step, ctx.k, self.p)

    def summary(self) -> dict:
        return {
            "target_rate": self.rate,
            "p_per_draft": round(self.p, 6),
            "proposed": self.proposed,
            "intended_correct": self.intended,
            "intended_rate": (self.intended / self.proposed) if self.proposed else None,
            "propose_calls": self.calls,
            "diverged_rows": len(self.diverged),
        }


_PLAN: Plan | None = None
INSTANCES: list[RateProposer] = []


def make_plan(
    prompts: Sequence[Sequence[int]],
    references: Sequence[Sequence[int]],
    rate: float,
    k: int,
    seed: int,
    vocab_size: int,
    traces: list[list[list[int]]] | None = None,
    policy: object | None = None,
    trace_offset: int = 0,
) -> Plan:
    """The run's plan: drafts at ``rate``, or replaying ``traces`` (any
    ``k``: the hash draws of ``rate`` are not used) from ``trace_offset`` on,
    each step's drafts cut by ``policy`` where given."""
    script = Script(
        {
            "schedule": "random",  # replaced by Plan.schedule
            "seed": seed,
            "vocab_size": vocab_size,
            "requests": [
                {"prompt": list(p), "reference": list(r)}
                for p, r in zip(prompts, references, strict=True)
            ],
        }
    )
    by_head: dict[tuple[int, ...], int] = {}
    for i, (prompt, _) in enumerate(script.requests):
        head = tuple(prompt[:HEAD])
        if len(head) < HEAD or head in by_head:
            raise ValueError(f"prompts need distinct heads of {HEAD} tokens")
        by_head[head] = i
    p = 0.0 if traces else prefix_probability(rate, k)
    return Plan(
        script,
        rate,
        p,
        by_head,
        traces=traces,
        policy=policy,
        trace_offset=trace_offset,
    )


def activate(plan: Plan | None) -> Plan | None:
    """Install ``plan`` (None: propose nothing) for the next propose calls."""
    global _PLAN
    _PLAN = plan
    return plan


def active() -> Plan | None:
    return _PLAN


def _fixed(n: int, correct: int):
    return lambda _ctx: (n, correct)


def _row(plan: Plan, i: int, sampled, num_tokens_no_spec, token_ids_cpu):
    """(script row, tokens generated before the newest one) of batch row
    ``i``, or None where nothing is scripted for it."""
    if not sampled:  # partial prefill: nothing sampled, no drafts
        return None
    n = int(num_tokens_no_spec[i])
    row = plan.by_head.get(tuple(token_ids_cpu[i, :HEAD].tolist()))
    if row is None:
        return None
    generated = n - len(plan.script.requests[row][0]) - 1
    return None if generated < 0 else (row, generated)


def observe_policy(plan: Plan, rows: list[tuple[int, int] | None], sampled) -> None:
    """Feed ``plan.policy`` the step just verified: per scripted row, the
    drafts this plan sent it and the tokens it sampled."""
    live = [(r[0], len(s)) for r, s in zip(rows, sampled, strict=True) if r]
    plan.policy.observe(  # type: ignore[attr-defined]
        [str(row) for row, _ in live],
        {str(row): plan.last.get(row, 0) for row, _ in live},
        [n for _, n in live],
        sum(1 + plan.last.get(row, 0) for row, _ in live),
    )


def propose_rows(
    plan: Plan | None,
    k: int,
    sampled_token_ids: list[list[int]],
    num_tokens_no_spec,
    token_ids_cpu,
) -> list[list[int]]:
    """The drafts of one step; updates only the plan's counters."""
    if plan is None:
        return [[] for _ in sampled_token_ids]
    rows = [
        _row(plan, i, sampled, num_tokens_no_spec, token_ids_cpu)
        for i, sampled in enumerate(sampled_token_ids)
    ]
    if plan.policy is not None:
        observe_policy(plan, rows, sampled_token_ids)
    out: list[list[int]] = []
    for i, r in enumerate(rows):
        if r is None:
            out.append([])
            continue
        row, generated = r
        n = int(num_tokens_no_spec[i])
        reference = plan.script.requests[row][1]
        if generated < len(reference) and int(token_ids_cpu[i, n - 1]) != int(
            reference[generated]
        ):
            plan.diverged.add(row)
        step = plan.steps.get(row, 0)
        plan.steps[row] = step + 1
        ctx = StepContext(
            row, step, generated, n, k, plan.script.block_size, plan.script.seed
        )
        n_drafts, correct = plan.schedule(ctx)
        if plan.policy is not None:
            n_drafts = plan.policy.num_drafts(str(row), n_drafts)  # type: ignore[attr-defined]
        drafts = drafts_for(
            _fixed(n_drafts, correct), ctx, reference, plan.script.vocab_size
        )
        plan.last[row] = len(drafts)
        plan.proposed += len(drafts)
        plan.intended += min(correct, len(drafts))
        out.append(drafts)
    if any(rows):
        plan.calls += 1
    return out


class RateProposer(ScriptedProposer):
    """vLLM V1 ``custom_class`` proposer driven by this module's plan."""

    def __init__(self, vllm_config) -> None:  # no script file: see activate()
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.script = None
        self.steps = {}
        self.log_path = None
        INSTANCES.append(self)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec,
        token_ids_cpu,
        slot_mappings=None,
    ) -> list[list[int]]:
        return propose_rows(
            _PLAN, self.k, sampled_token_ids, num_tokens_no_spec, token_ids_cpu
        )
