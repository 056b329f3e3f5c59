"""Scripted drafter: a test-only proposer that knows the reference.

It is installed through vLLM's ``custom_class`` speculative method
(``{"method": "custom_class", "model": "harness.drafter.ScriptedProposer",
"num_speculative_tokens": k}``) and reads its script from the JSON file named
by ``HSFORK_SCRIPT``::

    {"schedule": "accept_then_zero", "seed": 0, "block_size": 16,
     "vocab_size": 256,
     "requests": [{"prompt": [...], "reference": [...]}, ...]}

At each step, for each request, the schedule says how many drafts to propose
(0..k) and how many of them, counted from the first, equal the reference
continuation; the rest are deliberately wrong. Requests are recognized by
their prompt (the row's tokens start with it), and the step count is kept per
request, so the script does not depend on batch order.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SCRIPT_ENV = "HSFORK_SCRIPT"
LOG_ENV = "HSFORK_SCRIPT_LOG"


@dataclass(frozen=True)
class StepContext:
    row: int  # index of the request in the script
    step: int  # how many times this request was asked for drafts before
    generated: int  # output tokens before the one sampled last
    length: int  # tokens in the sequence now, prompt and newest token included
    k: int
    block_size: int
    seed: int


# A schedule returns (number of drafts, number of correct leading drafts).
Schedule = Callable[[StepContext], tuple[int, int]]


def _uniform(ctx: StepContext, salt: str, upper: int) -> int:
    """Deterministic integer in [0, upper] from the context."""
    h = hashlib.blake2b(
        f"{ctx.seed}:{ctx.row}:{ctx.step}:{salt}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(h, "little") % (upper + 1)


def random_schedule(ctx: StepContext) -> tuple[int, int]:
    n = _uniform(ctx, "n", ctx.k)
    return n, _uniform(ctx, "c", n)


def all_zero(ctx: StepContext) -> tuple[int, int]:
    return 0, 0


def all_accept(ctx: StepContext) -> tuple[int, int]:
    return ctx.k, ctx.k


def all_reject(ctx: StepContext) -> tuple[int, int]:
    """k drafts, none correct: every verify step rejects all of them, so a
    layer whose state takes in rejected tokens is corrupted at every step."""
    return ctx.k, 0


def accept_then_zero(ctx: StepContext) -> tuple[int, int]:
    """Full accept, then a step without drafts: the trigger of the reported
    corruption (a non-speculative step after one that accepted N > 1)."""
    return (ctx.k, ctx.k) if ctx.step % 2 == 0 else (0, 0)


def boundary(ctx: StepContext) -> tuple[int, int]:
    """All-correct drafts sized so that the tokens computed by the verify step
    (the sequence so far plus n drafts) end exactly on a block boundary (even
    steps) or one past it (odd steps). With ``k < block_size`` boundaries
    farther than k are approached over several steps."""
    to_boundary = (-ctx.length) % ctx.block_size
    n = to_boundary if ctx.step % 2 == 0 else to_boundary + 1
    n = min(max(n, 0), ctx.k)
    return n, n


_BASE: dict[str, Schedule] = {
    "random": random_schedule,
    "all_zero": all_zero,
    "all_accept": all_accept,
    "all_reject": all_reject,
    "accept_then_zero": accept_then_zero,
    "boundary": boundary,
}


def heterogeneous(ctx: StepContext) -> tuple[int, int]:
    """Different schedules for different rows of one batch."""
    order = ("random", "all_zero", "all_accept", "accept_then_zero")
    return _BASE[order[ctx.row % len(order)]](ctx)


SCHEDULES: dict[str, Schedule] = {**_BASE, "heterogeneous": heterogeneous}


def wrong_token(correct: int, vocab_size: int) -> int:
    return (correct + 1) % vocab_size


def drafts_for(
    schedule: Schedule, ctx: StepContext, reference: Sequence[int], vocab_size: int
) -> list[int]:
    n, correct = schedule(ctx)
    n = max(0, min(n, ctx.k))
    correct = max(0, min(correct, n))
    # the next token (the bonus/sampled one) is reference[generated]; drafts
    # continue from there
    start = ctx.generated + 1
    out: list[int] = []
    for j in range(n):
        pos = start + j
        if pos >= len(reference):
            break
        ref = reference[pos]
        out.append(ref if j < correct else wrong_token(ref, vocab_size))
    return out


class Script:
    def __init__(self, data: dict):
        self.schedule_name = data["schedule"]
        self.schedule = SCHEDULES[self.schedule_name]
        self.seed = int(data.get("seed", 0))
        # None: the engine's block size (read by ScriptedProposer)
        bs = data.get("block_size")
        self.block_size = int(bs) if bs else 16
        self.block_size_given = bool(bs)
        self.vocab_size = int(data["vocab_size"])
        self.requests = [
            (tuple(r["prompt"]), list(r["reference"])) for r in data["requests"]
        ]
        self._by_head: dict[tuple[int, ...], list[int]] = {}
        for i, (prompt, _) in enumerate(self.requests):
            self._by_head.setdefault(prompt[:8], []).append(i)

    @classmethod
    def load(cls, path: str) -> Script:
        with open(path) as fh:
            return cls(json.load(fh))

    def find(self, tokens: Sequence[int]) -> int | None:
        """The script row whose prompt starts ``tokens`` (longest wins)."""
        best, best_len = None, -1
        for i in self._by_head.get(tuple(tokens[:8]), []):
            prompt = self.requests[i][0]
            if len(prompt) > best_len and tuple(tokens[: len(prompt)]) == prompt:
                best, best_len = i, len(prompt)
        return best


class ScriptedProposer:
    """vLLM V1 ``custom_class`` proposer driven by a :class:`Script`."""

    def __init__(self, vllm_config) -> None:
        path = os.environ.get(SCRIPT_ENV)
        if not path:
            raise RuntimeError(f"{SCRIPT_ENV} must name the drafter's script")
        self.script = Script.load(path)
        if not self.script.block_size_given:
            # boundary-crossing schedules aim at the engine's real blocks
            # (in align mode the mamba state is checkpointed per block)
            self.script.block_size = int(vllm_config.cache_config.block_size)
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.steps: dict[int, int] = {}
        self.log_path = os.environ.get(LOG_ENV)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec,
        token_ids_cpu,
        slot_mappings=None,
    ) -> list[list[int]]:
        out: list[list[int]] = []
        log = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # partial prefill: nothing sampled, no drafts
                out.append([])
                continue
            n = int(num_tokens_no_spec[i])
            tokens = token_ids_cpu[i, :n].tolist()
            row = self.script.find(tokens)
            if row is None:
                out.append([])
                continue
            prompt, reference = self.script.requests[row]
            step = self.steps.get(row, 0)
            self.steps[row] = step + 1
            # tokens generated before the one just sampled
            generated = n - len(prompt) - 1
            ctx = StepContext(
                row,
                step,
                generated,
                n,
                self.k,
                self.script.block_size,
                self.script.seed,
            )
            drafts = drafts_for(
                self.script.schedule, ctx, reference, self.script.vocab_size
            )
            out.append(drafts)
            log.append((row, step, generated, len(drafts)))
        if self.log_path and log:
            with open(self.log_path, "a") as fh:
                fh.write(json.dumps(log) + "\n")
        return out

    def load_model(self, *args, **kwargs) -> None:
        pass
