"""The configuration fuzzer (harness/fuzz.py) on the CPU: the draw covers
every dimension and maps onto cells whose engine arguments vLLM accepts, the
pool hook sizes the pool by vLLM's own admission check, the shrinker reaches
the minimal failing configuration of a known predicate, JSON lines survive
a kill, and the dry run needs no vLLM."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import fuzz, fuzz_pool
from harness.fuzz import FuzzConfig

REPO = Path(__file__).resolve().parent.parent
seeds = st.integers(min_value=0, max_value=2**32 - 1)


def _configs(seed: int, n: int = 8) -> list[FuzzConfig]:
    return [c for g in fuzz.draw(seed, n) for c in g]


# -- the draw ---------------------------------------------------------------


def test_draw_covers_every_dimension():
    """Over a few hundred draws every value of every enumerated dimension
    appears (and both sides of every switch)."""
    cfgs = _configs(0, 600)
    seen = {
        f.name: {getattr(c, f.name) for c in cfgs}
        for f in dataclasses.fields(FuzzConfig)
    }
    assert seen["model"] == set(fuzz.MODELS)
    assert seen["runner"] == set(fuzz.RUNNERS)
    assert seen["drafter"] == set(fuzz.DRAFTERS)
    assert seen["graphs"] == set(fuzz.GRAPHS)
    assert seen["cache_mode"] == {"none", "align"}
    assert seen["chunked"] == seen["async_sched"] == {True, False}
    assert seen["prompt_band"] == set(range(len(fuzz.PROMPT_BANDS)))
    assert set(fuzz.SLACKS) | {None} == seen["pool_slack"]
    assert set(fuzz.SEQS_LADDER) == seen["max_num_seqs"]
    assert {1, 3, 8, 64} <= seen["k"]
    assert {1, 48} <= seen["n_prompts"]
    assert {1, 2, 3} <= seen["lookup_min"] and max(seen["lookup_max"]) == 10
    assert set(fuzz.BUDGETS) | {None} == seen["budget"]
    assert seen["request"] == set(fuzz.REQUESTS)
    assert seen["turns"] == {2, 3, 4}
    # more turns only in align mode (a later wave hits the prefix cache)
    assert all(c.turns == 2 for c in cfgs if c.cache_mode == "none")


def test_shrinking_drops_request_features_and_turns():
    c = FuzzConfig("qwen3_5", "mtp", 2, cache_mode="align", chunked=True,
                   budget=64, request="regex", turns=4)  # fmt: skip
    moves = fuzz.neighbours(c)
    assert dataclasses.replace(c, request="plain") in moves
    assert dataclasses.replace(c, turns=2) in moves
    assert all(fuzz.complexity(m) < fuzz.complexity(c) for m in moves)
    cell = fuzz.to_cell(c)
    assert (cell.request, cell.turns) == ("regex", 4)


def test_draw_weights_small_budgets():
    budgets = [c.budget for c in _configs(1, 600) if c.chunked]
    small = sum(b <= 96 for b in budgets)
    # 7 of the 13 budgets are <= 96; the geometric weights put far more
    # than that share of the draws there
    assert small / len(budgets) > 0.8


def test_draw_is_reproducible():
    assert _configs(7, 40) == _configs(7, 40)
    assert _configs(7, 40) != _configs(8, 40)


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_drawn_configs_are_consistent(seed):
    for g in fuzz.draw(seed, 8):
        assert len({c.ref_shape() for c in g}) == 1  # one reference a group
        for c in g:
            assert c.drafter in fuzz.drafters_for(c.model, c.runner)
            assert 1 <= c.lookup_min <= c.lookup_max <= 10
            assert (c.budget is not None) == c.chunked
            if c.chunked:
                assert c.max_num_seqs <= c.budget
            if c.cache_mode == "align":  # refused without chunked prefill
                assert c.chunked
            if c.model == fuzz.FASTAPPLY:
                assert c.max_tokens == 128


@settings(max_examples=25, deadline=None)
@given(seeds)
def test_model_len_holds_the_longest_request(seed):
    from harness.equivalence import second_wave

    for c in _configs(seed, 4):
        wave = fuzz.prompts_of(c)
        waves = list(wave)
        # each later wave continues the one before by the longest
        # continuation the engine may produce
        for _ in range(c.turns - 1 if c.cache_mode == "align" else 0):
            wave = second_wave(wave, [[0] * c.max_tokens for _ in wave], 0)
            waves += wave
        longest = max(map(len, waves)) + c.max_tokens + c.k
        slack = (c.turns - 1) * (c.max_tokens // 4) if c.cache_mode == "align" else 0
        assert longest < fuzz.model_len(c) <= longest + 16 + slack


@pytest.fixture(scope="module")
def vllm_configs():
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig, SchedulerConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs, SpeculativeConfig, CompilationConfig, SchedulerConfig


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(seeds)
def test_engine_kwargs_are_accepted_by_vllm(vllm_configs, seed):
    """Every drawn configuration's engine arguments are EngineArgs fields
    (EngineArgs builds from them), its speculative and compilation configs
    are valid keys and values, and vLLM's SchedulerConfig accepts its budget,
    max_num_seqs and max_model_len."""
    engine_args, spec_cfg, comp_cfg, sched_cfg = vllm_configs
    names = {f.name for f in dataclasses.fields(engine_args)}
    spec_names = {f.name for f in dataclasses.fields(spec_cfg)}
    for c in _configs(seed, 4):
        kw = fuzz.engine_kwargs_of(c, "/nonexistent/model")
        assert set(kw) <= names, set(kw) - names
        engine_args(**kw)
        assert set(kw["speculative_config"]) <= spec_names
        assert kw["speculative_config"]["num_speculative_tokens"] == c.k
        if "compilation_config" in kw:
            comp_cfg(**kw["compilation_config"])
        assert kw["enforce_eager"] == (c.graphs == "eager")
        assert kw["max_num_seqs"] == c.max_num_seqs
        assert kw["enable_prefix_caching"] == (c.cache_mode == "align")
        # unchunked: no budget, vLLM picks one of at least max_model_len
        budget = {k: kw[k] for k in ("max_num_batched_tokens",) if k in kw}
        sched_cfg(
            **budget,
            max_num_seqs=kw["max_num_seqs"],
            max_model_len=kw["max_model_len"],
            enable_chunked_prefill=kw["enable_chunked_prefill"],
            is_encoder_decoder=False,
        )
        if c.pool_slack is None:
            assert "num_gpu_blocks_override" not in kw
        else:
            assert kw["num_gpu_blocks_override"] == fuzz.POOL_BASE + c.pool_slack


def test_cell_carries_the_prompts():
    c = _configs(3, 1)[0]
    cell = fuzz.to_cell(c)
    lo, hi = fuzz.PROMPT_BANDS[c.prompt_band]
    assert cell.prompts == (c.n_prompts, c.prompt_seed, lo, hi)
    assert cell.key()["prompts"] == list(cell.prompts)
    if c.model != fuzz.FASTAPPLY:
        assert all(lo <= len(p) <= hi for p in fuzz.prompts_of(c))


# -- the pool ---------------------------------------------------------------


class _Spec:
    pass


class MambaSpec(_Spec):
    pass


class FullAttentionSpec(_Spec):
    pass


def _fake_vllm(need: int, groups):
    """get_kv_cache_configs whose admission check needs ``need`` blocks."""
    calls = []

    class G:
        def __init__(self, spec):
            self.kv_cache_spec = spec

    class Cfg:
        kv_cache_groups = [G(s()) for s in groups]

    def orig(vllm_config, specs, mem):
        n = vllm_config.cache_config.num_gpu_blocks_override
        calls.append(n)
        if n is not None and n < need:
            raise ValueError(
                "To serve at least one request with the model's max seq len"
            )
        return [Cfg()]

    return orig, calls


def _vllm_config(override, seqs=8):
    cache = type("C", (), {"num_gpu_blocks_override": override, "block_size": 64})()
    sched = type("S", (), {"max_num_seqs": seqs})()
    return type("V", (), {"cache_config": cache, "scheduler_config": sched})()


@pytest.mark.parametrize("need", [1, 2, 7, 8, 9, 100, 1000])
@pytest.mark.parametrize("slack", [0, 3])
def test_pool_is_the_least_that_starts_plus_mamba_blocks(need, slack):
    orig, calls = _fake_vllm(need, [MambaSpec, MambaSpec, MambaSpec, FullAttentionSpec])
    fuzz_pool.POOL_LOG.clear()
    vc = _vllm_config(fuzz.POOL_BASE + slack, seqs=4)
    fuzz_pool.sized(orig)(vc, {}, [0])
    # the least pool vLLM accepts, one Mamba block per group and sequence
    assert vc.cache_config.num_gpu_blocks_override == need + 3 * 4 + slack
    assert calls[-1] == need + 12 + slack
    assert fuzz_pool.POOL_LOG[-1]["least"] == need
    assert len(calls) < 2 * (need.bit_length() + 4)


def test_pool_hook_passes_other_overrides_through():
    orig, calls = _fake_vllm(10, [MambaSpec])
    for o in (None, 24):
        vc = _vllm_config(o)
        fuzz_pool.sized(orig)(vc, {}, [0])
        assert vc.cache_config.num_gpu_blocks_override == o and calls[-1] == o


def test_pool_hook_reraises_other_errors():
    def orig(vllm_config, *a):
        raise ValueError("something else")

    with pytest.raises(ValueError, match="something else"):
        fuzz_pool.sized(orig)(_vllm_config(fuzz.POOL_BASE), {}, [0])


def test_pool_search_against_vllms_admission_check(vllm_configs):
    """least_pool with vLLM's own _check_enough_kv_cache_memory: the pool it
    finds is accepted and one block less is refused."""
    try:
        from vllm.v1.core.kv_cache_planning import _check_enough_kv_cache_memory
    except ImportError:
        from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory
    per_block, need_blocks = 4096, 37

    def fits(n):
        try:
            # the null block is held back (get_kv_cache_configs)
            _check_enough_kv_cache_memory(
                (n - 1) * per_block,
                lambda: need_blocks * per_block,
                512,
                lambda mem: mem // per_block,
            )
            return True
        except ValueError as e:
            assert any(m in str(e) for m in fuzz.POOL_REFUSALS)
            return False

    n = fuzz_pool.least_pool(fits)
    assert fits(n) and not fits(n - 1)
    assert n == need_blocks + 1


# -- judging ----------------------------------------------------------------


@pytest.mark.parametrize(
    "row, status",
    [
        ({"status": "ok"}, "ok"),
        ({"status": "diverged"}, "failed"),
        (
            {"status": "error", "error": "torch.AcceleratorError: illegal memory"},
            "failed",
        ),
        (
            {
                "status": "rejected",
                "error": "ValidationError: Model Runner V2 does not "
                "yet support: ngram/ngram_gpu speculative decoding",
            },
            "refused",
        ),
        (
            {
                "status": "rejected",
                "error": "Value error, Async scheduling is not "
                "supported by the V1 model runner with custom_class-based",
            },
            "refused",
        ),
        (
            {
                "status": "rejected",
                "error": "ValueError: To serve at least one request "
                "with the model's max seq len (512)",
            },
            "fuzzer-bug",
        ),
        (
            {
                "status": "rejected",
                "error": "ValueError: max_num_batched_tokens (16) "
                "must be greater than or equal to max_num_seqs",
            },
            "invalid",
        ),
    ],
)
def test_classify(row, status):
    assert fuzz.classify(row) == status


# -- shrinking --------------------------------------------------------------


def _fake_runner(predicate, calls=None):
    def run(items):
        if calls is not None:
            calls.append(len(items))
        return [
            {
                "id": i,
                "config": c.to_json(),
                "status": "failed" if predicate(c) else "ok",
            }
            for i, c in items
        ]

    return run


def _known(c: FuzzConfig) -> bool:
    return c.chunked and c.budget <= 96 and c.k >= 8


MINIMAL = dict(
    graphs="eager",
    async_sched=False,
    pool_slack=None,
    cache_mode="none",
    chunked=True,
    budget=96,
    n_prompts=1,
    k=8,
    max_num_seqs=1,
    runner="v1",
)


@settings(max_examples=30, deadline=None)
@given(seeds, st.sampled_from([8, 12, 16, 32, 64]), st.sampled_from([16, 32, 64, 96]))
def test_shrinker_reaches_the_minimal_failing_config(seed, k, budget):
    """Predicate: fails iff budget <= 96 and k >= 8 (under chunked prefill);
    from any failing draw the shrinker ends at budget 96, k 8 and every
    other dimension at its simplest."""
    rng = random.Random(seed)
    c = fuzz.draw_config(rng)
    c = dataclasses.replace(
        c,
        drafter="ngram",
        chunked=True,
        budget=budget,
        k=k,
        max_num_seqs=min(c.max_num_seqs, budget),
    )
    assert _known(c)
    st_ = fuzz.shrink(c, "diverged", _fake_runner(_known))
    last = FuzzConfig.from_json(st_["current"])
    assert st_["done"] and _known(last)
    for k_, v in MINIMAL.items():
        assert getattr(last, k_) == v, (k_, last)
    if last.model != fuzz.FASTAPPLY:  # its prompts and answers are the task's
        assert last.max_tokens == fuzz.MAX_TOKENS[0] and last.prompt_band == 0
    assert last.lookup_max == last.lookup_min
    # minimal: no neighbour fails
    assert not any(_known(n) for n in fuzz.neighbours(last))


def test_shrink_resumes_from_its_state(tmp_path):
    c = FuzzConfig(
        "qwen3_5",
        "ngram",
        64,
        runner="mrv2",
        lookup_max=9,
        max_num_seqs=16,
        n_prompts=32,
        prompt_band=3,
        max_tokens=128,
        cache_mode="align",
        chunked=True,
        budget=16,
        pool_slack=4,
        graphs="full_and_piecewise",
        async_sched=True,
    )
    whole = fuzz.shrink(c, "diverged", _fake_runner(_known))
    state = tmp_path / "s.json"
    calls: list[int] = []
    # a deadline of 0: one call per invocation, then the state is saved
    for _ in range(200):
        st_ = fuzz.shrink(
            c, "diverged", _fake_runner(_known, calls), state=state, deadline_s=0
        )
        if st_["done"]:
            break
    assert st_["done"] and st_["current"] == whole["current"]
    assert len(calls) > 1


def test_shrink_needs_the_same_failure():
    """A neighbour that fails differently (an error, not a divergence) is
    not a step."""
    c = FuzzConfig(
        "qwen3_5", "ngram", 8, chunked=True, budget=64, graphs="full_and_piecewise"
    )

    def run(items):
        return [
            {"status": "failed", "error": "RuntimeError: x"}
            if cc.graphs == "eager"
            else {"status": "failed"}
            for _, cc in items
        ]

    st_ = fuzz.shrink(c, "diverged", run)
    assert FuzzConfig.from_json(st_["current"]).graphs == "full_and_piecewise"


def test_regression_files_feed_the_slice(tmp_path):
    c = FuzzConfig(
        "nemotron_h", "scripted:random", 4, chunked=True, budget=32, max_num_seqs=4
    )
    p = fuzz.write_regression(
        c,
        {"status": "failed", "first_divergence": {"prompt": 0}},
        {"from": "s1-3"},
        tmp_path,
    )
    assert json.loads(p.read_text())["failure"] == "diverged"
    assert fuzz.regression_configs(tmp_path) == [c]
    cells = fuzz.regression_cells(tmp_path)
    assert cells == [fuzz.to_cell(c)] and cells[0].extra == fuzz.to_cell(c).extra
    assert cells[0].prompts == fuzz.to_cell(c).prompts
    from harness.equivalence import slice_cells

    assert len(slice_cells("fuzz-regressions")) == len(fuzz.regression_configs())


# -- JSON lines, runs, report -------------------------------------------------


def test_json_lines_survive_a_kill(tmp_path):
    """A process killed while appending leaves every complete line
    readable; a started configuration without a result reads as killed."""
    out = tmp_path / "run.jsonl"
    code = (
        "import sys; from pathlib import Path; from harness.fuzz import append\n"
        "out = Path(sys.argv[1])\n"
        "i = 0\n"
        "while True:\n"
        "    line = {'event': 'start', 'id': f'x{i}', 'config': {}, 'pad': 'y' * 999}\n"
        "    append(out, line)\n"
        "    i += 1\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=REPO)
    while not out.exists() or out.read_text().count("\n") < 20:
        time.sleep(0.05)
        assert p.poll() is None
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    with open(out, "a") as f:
        f.write('{"event": "result", "id": "x0", "sta')  # a torn last line
    lines = fuzz.read_lines(out)
    assert len(lines) >= 20 and [ln["id"] for ln in lines] == [
        f"x{i}" for i in range(len(lines))
    ]
    res = fuzz.outcomes(lines)
    assert {r["status"] for r in res.values()} == {"killed"}


def test_run_writes_start_then_result_lines(tmp_path):
    out = tmp_path / "fork.jsonl"

    def runner(items, out_, seed, timeout):
        for cid, c in items[:-1]:  # the last one is lost, as in a crash
            fuzz.append(
                out_,
                {
                    "event": "result",
                    "id": cid,
                    "config": c.to_json(),
                    "status": "failed" if _known(c) else "ok",
                },
            )

    s = fuzz.fuzz_run(out, 5, deadline_s=10**6, group=3, runner=runner, limit=9)
    lines = fuzz.read_lines(out)
    starts = [ln for ln in lines if ln["event"] == "start"]
    assert len(starts) == 9 and s["tried"] == 9
    assert [c.to_json() for c in _configs_grouped(5, 9, 3)] == [
        ln["config"] for ln in starts
    ]
    assert s["counts"].get("killed") == 3


def test_a_deadline_too_short_for_one_group_runs_nothing_and_says_so(tmp_path, capsys):
    out = tmp_path / "fork-s1.jsonl"
    s = fuzz.fuzz_run(out, 1, deadline_s=110, runner=lambda *a: None)
    assert s["tried"] == 0 and not out.exists()
    assert "leaves no room for one group" in capsys.readouterr().err


def _configs_grouped(seed, n, group):
    return [c for g in fuzz.draw(seed, n, group) for c in g]


def test_report(tmp_path):
    d = tmp_path / "fuzz"
    d.mkdir()
    a = FuzzConfig("qwen3_5", "ngram", 8, chunked=True, budget=64)
    b = dataclasses.replace(a, budget=512, k=3)
    for i, (c, status) in enumerate([(a, "failed"), (b, "ok"), (a, "refused")]):
        fuzz.append(
            d / "fork.jsonl",
            {
                "event": "start",
                "id": f"s0-{i}",
                "config": c.to_json(),
                "vllm": "0.33.0",
            },
        )
        fuzz.append(
            d / "fork.jsonl",
            {
                "event": "result",
                "id": f"s0-{i}",
                "config": c.to_json(),
                "status": status,
                "first_divergence": {"prompt": 2, "position": 17}
                if status == "failed"
                else None,
            },
        )
    text = fuzz.report(d)
    assert "3 configurations: 1 failed, 1 ok, 1 refused" in text
    assert "'position': 17" in text and "| s0-0 | failed |" in text
    assert "Every failure has:" in text and "'budget': 64" in text


def test_dry_run_needs_no_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['torch'] = None\n"
        "from harness.fuzz import main\n"
        "main(['run', '--dry-run', '--seed', '3', '--count', '10'])\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HSFORK_VLLM_VERSION": "0.33.0"},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    items = [json.loads(x) for x in p.stdout.splitlines()]
    assert len(items) == 10
    assert [i["config"] for i in items] == [c.to_json() for c in _configs(3, 10)]
    assert all(i["engine_kwargs"]["speculative_config"] for i in items)


def test_pool_hook_on_vllms_own_get_kv_cache_configs():
    """The hook around vLLM's get_kv_cache_configs (fast-apply fixture's
    model config, three GDN-like state groups and one attention group): the
    least pool it finds is what vLLM accepts and one block less is refused;
    the final pool adds one block per state group and sequence and the
    slack. In a subprocess on vLLM's CPU platform (HSFORK_CPU_TESTBED)."""
    pytest.importorskip("vllm")
    from conftest import in_cpu_testbed

    log = in_cpu_testbed(__file__, "_pool_check")
    assert log["mamba_groups"] == 3 and log["max_num_seqs"] == 4


def _pool_check() -> dict:
    import inspect

    import torch
    import vllm.v1.engine.core as core
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.config import SchedulerConfig as sched
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    mc = ModelConfig(
        model=str(REPO / "fixtures" / "fastapply"),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=512,
    )
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=64),
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=sched(max_num_seqs=4, max_num_batched_tokens=512,
                               max_model_len=512, is_encoder_decoder=False),
    )  # fmt: skip
    if hasattr(vc.cache_config, "kv_cache_layout"):
        vc.cache_config.kv_cache_layout = "NHD"  # the engine core resolves it
    att = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64,
                            dtype=torch.bfloat16)  # fmt: skip
    page = att.page_size_bytes
    state = MambaSpec(block_size=64, shapes=((page // 4,),), dtypes=(torch.bfloat16,),
                      page_size_padded=page)  # fmt: skip
    specs = {f"layers.{i}.attn": state for i in range(3)} | {"layers.3.attn": att}
    orig = getattr(core.get_kv_cache_configs, "__wrapped__", core.get_kv_cache_configs)
    args = [vc, [specs], [10**9]]
    if "global_kv_cache_groups" in inspect.signature(orig).parameters:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

        args.append(get_global_kv_cache_groups(vc, [specs]))

    def starts(n):
        vc.cache_config.num_gpu_blocks_override = n
        try:
            orig(*args)
            return True
        except ValueError as e:
            assert any(m in str(e) for m in fuzz_pool.POOL_REFUSALS), e
            return False

    fuzz_pool.POOL_LOG.clear()
    vc.cache_config.num_gpu_blocks_override = fuzz_pool.POOL_BASE + 2
    configs = fuzz_pool.sized(orig)(*args)
    log = fuzz_pool.POOL_LOG[-1]
    assert log["mamba_groups"] == 3 and log["max_num_seqs"] == 4
    assert configs[0].num_blocks == log["blocks"] == log["least"] + 3 * 4 + 2
    # the attention group alone needs 512 / 64 blocks, and the null block
    assert log["least"] > 512 // 64 + 1
    assert starts(log["least"]) and not starts(log["least"] - 1)
    return log


def _fake_child(tmp_path, body: str) -> str:
    """An executable standing in for the Python of run_group_child."""
    script = tmp_path / "child.py"
    script.write_text(body)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize("mode", ["crash", "hang", "half"])
def test_group_child_that_does_not_report(tmp_path, monkeypatch, mode):
    """A child that crashes, hangs or reports only some configurations:
    the others get a lost line (crashed / timeout) with its output."""
    body = {
        "crash": "import sys; print('illegal memory access'); sys.exit(1)\n",
        "hang": "import time; time.sleep(60)\n",
        "half": (
            "import json, sys\n"
            "from pathlib import Path\n"
            "argv = sys.argv\n"
            "g = json.loads(Path(argv[argv.index('run-group') + 1]).read_text())\n"
            "out = sys.argv[sys.argv.index('--out') + 1]\n"
            "i, c = g['items'][0]\n"
            "line = {'event': 'result', 'id': i, 'config': c, 'status': 'ok'}\n"
            "open(out, 'a').write(json.dumps(line) + '\\n')\n"
            "sys.exit(139)\n"
        ),
    }[mode]
    monkeypatch.setattr(sys, "executable", _fake_child(tmp_path, body))
    out = tmp_path / "run.jsonl"
    # an earlier result of the same id in the file does not count
    fuzz.append(out, {"event": "result", "id": "a1", "status": "ok", "config": {}})
    items = [("a0", _configs(2, 1)[0]), ("a1", _configs(3, 1)[0])]
    for i, c in items:  # as fuzz_run writes them
        fuzz.append(out, {"event": "start", "id": i, "config": c.to_json()})
    res = fuzz.run_group_child(items, out, 0, timeout_s=3 if mode == "hang" else 60)
    want = {"crash": ["crashed", "crashed"], "hang": ["timeout", "timeout"],
            "half": ["ok", "crashed"]}[mode]  # fmt: skip
    assert [r["status"] for r in res] == want
    if mode == "crash":
        assert "illegal memory access" in res[0]["error"]
    got = fuzz.outcomes(fuzz.read_lines(out))
    assert [got[i]["status"] for i in ("a0", "a1")] == want


def test_shrink_stops_when_the_failure_does_not_reproduce():
    c = FuzzConfig("qwen3_5", "ngram", 8, chunked=True, budget=64)
    calls: list[int] = []
    st_ = fuzz.shrink(c, "diverged", _fake_runner(lambda c: False, calls))
    assert st_["done"] and st_["reproduced"] is False and calls == [1]


def test_shrink_of_a_crash_ends_on_a_config_that_crashes():
    """A crashed child loses every configuration of its group (run_cells
    reports at the end), so a batch's lost results do not say which
    neighbour crashed: the shrinker must not step to one that did not."""

    def crashes(c):
        return c.k >= 8

    calls: list[int] = []

    def run(items):
        calls.append(len(items))
        lost = any(crashes(c) for _, c in items)
        return [{"status": "crashed" if lost else "ok"} for _ in items]

    c = FuzzConfig("qwen3_5", "ngram", 32, chunked=True, budget=24,
                   n_prompts=16, graphs="full_and_piecewise")  # fmt: skip
    st_ = fuzz.shrink(c, "crashed", run, per_call=4)
    last = FuzzConfig.from_json(st_["current"])
    assert st_["done"] and crashes(last) and last.k == 8
    assert set(calls) == {1}


ENGINE_CONFIG_CHECK = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from harness import fuzz
from harness.equivalence import FASTAPPLY_DIR, set_runner
out = []
for g in fuzz.draw(int(sys.argv[1]), int(sys.argv[2])):
    for c in g:
        if c.model != fuzz.FASTAPPLY or c.drafter in ("eagle3", "draft_model:dense"):
            continue  # the committed model; no drafter folders written here
        kw = fuzz.engine_kwargs_of(c, str(FASTAPPLY_DIR))
        set_runner(c.runner)
        try:
            EngineArgs(**kw).create_engine_config()
            out.append([c.name(), "ok"])
        except Exception as e:
            out.append([c.name(), fuzz.classify({"status": "rejected",
                                                 "error": str(e)}), str(e)[:400]])
print("CHECK", json.dumps(out))
"""


def test_drawn_engine_configs_start_or_are_refused_by_design(tmp_path):
    """vLLM's own create_engine_config (the CPU platform, in a subprocess)
    on the drawn configurations of the committed fast-apply fixture: each
    builds, or is refused with a message REFUSED_BY_DESIGN knows. The CPU
    platform's own gap (MRV2 needs Triton) is not the draw's."""
    pytest.importorskip("vllm")
    script = tmp_path / "check.py"
    script.write_text(ENGINE_CONFIG_CHECK)
    env = {**os.environ, "HSFORK_CPU_TESTBED": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, str(script), "11", "120"], cwd=REPO, env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    got = json.loads(p.stdout.split("CHECK ", 1)[1])
    cpu_gap = "Model Runner V2 requires Triton"
    bad = [g for g in got if g[1] not in ("ok", "refused") and cpu_gap not in g[2]]
    assert not bad, bad
    assert sum(g[1] == "ok" for g in got) >= len(got) // 3


def test_report_sets_fork_and_upstream_side_by_side(tmp_path):
    a = FuzzConfig("nemotron_h", "mtp", 3, chunked=True, budget=48)
    outcomes = {"s0-0": ("failed", "ok"), "s0-1": ("ok", "failed"),
                "s0-2": ("failed", "failed"), "s0-3": ("ok", "ok"),
                "s0-4": ("refused", "refused")}  # fmt: skip
    for cid, pair in outcomes.items():
        for variant, status in zip(("upstream", "fork"), pair, strict=True):
            f = tmp_path / f"{variant}-s0.jsonl"
            fuzz.append(f, {"event": "start", "id": cid, "config": a.to_json()})
            fuzz.append(f, {"event": "result", "id": cid, "config": a.to_json(),
                            "status": status})  # fmt: skip
    text = fuzz.report(tmp_path)
    assert "| s0-0 | failed | ok | fixed by the fork |" in text
    assert "| s0-1 | ok | failed | **fork only: a regression** |" in text
    assert "| s0-2 | failed | failed | open on both |" in text
    assert "s0-3 |" not in text and "s0-4 |" not in text
    assert fuzz.variant_of(Path("fork-with-0005-s12.jsonl")) == "fork-with-0005"


FAKE_GPU_CHILD = """
import json, sys
from pathlib import Path
argv = sys.argv
g = json.loads(Path(argv[argv.index("run-group") + 1]).read_text())
out = argv[argv.index("--out") + 1]
with open(out, "a") as f:
    for i, c in g["items"]:
        bad = c["chunked"] and c["budget"] <= 96 and c["k"] >= 8
        line = {"event": "result", "id": i, "config": c,
                "status": "failed" if bad else "ok",
                "first_divergence": {"prompt": 0, "position": 3} if bad else None}
        f.write(json.dumps(line) + "\\n")
"""


def test_shrink_command_writes_the_regression(tmp_path, monkeypatch, capsys):
    """``python -m harness.fuzz shrink RUN.jsonl --id ID`` end to end, each
    step in a child process (a stand-in for the GPU child whose failure
    predicate is known): the minimal configuration lands in the regressions
    folder, and the matrix slice's loader reads it back."""
    monkeypatch.setattr(sys, "executable", _fake_child(tmp_path, FAKE_GPU_CHILD))
    c = FuzzConfig("qwen3_5", "ngram", 32, runner="mrv2", max_num_seqs=8,
                   n_prompts=16, prompt_band=3, max_tokens=96, cache_mode="align",
                   chunked=True, budget=24, pool_slack=2, graphs="full_and_piecewise",
                   async_sched=True)  # fmt: skip
    run = tmp_path / "fork-s0.jsonl"
    fuzz.append(run, {"event": "start", "id": "s0-7", "config": c.to_json()})
    fuzz.append(run, {"event": "result", "id": "s0-7", "config": c.to_json(),
                      "status": "failed"})  # fmt: skip
    regs = tmp_path / "regs"
    fuzz.main(["shrink", str(run), "--id", "s0-7", "--deadline", "100000",
               "--regressions", str(regs)])  # fmt: skip
    files = list(regs.glob("*.json"))
    assert len(files) == 1
    d = json.loads(files[0].read_text())
    last = FuzzConfig.from_json(d["config"])
    assert (last.budget, last.k, last.n_prompts, last.graphs) == (96, 8, 1, "eager")
    assert d["failure"] == "diverged" and d["first_divergence"]["position"] == 3
    assert d["found"]["from"] == "s0-7" and d["found"]["steps"] >= 5
    from harness.equivalence import regression_cells

    assert regression_cells(regs) == [fuzz.to_cell(last)]
    assert '"regression"' in capsys.readouterr().out


FAKE_CRASHING_CHILD = """
import json, sys
from pathlib import Path
argv = sys.argv
g = json.loads(Path(argv[argv.index("run-group") + 1]).read_text())
out = argv[argv.index("--out") + 1]
for i, c in g["items"]:
    if c["k"] >= 8:
        print("illegal memory access")
        sys.exit(1)
    with open(out, "a") as f:
        f.write(json.dumps({"event": "result", "id": i, "config": c,
                            "status": "ok"}) + "\\n")
"""


def test_shrink_command_shrinks_a_crash(tmp_path, monkeypatch):
    """A crash found by a run (start line, then a lost line) shrinks end to
    end: the shrink file holds lost lines without start lines, and the
    minimal configuration is one that crashes."""
    monkeypatch.setattr(sys, "executable", _fake_child(tmp_path, FAKE_CRASHING_CHILD))
    c = FuzzConfig("qwen3_5", "ngram", 32, max_num_seqs=8, n_prompts=6,
                   chunked=True, budget=48, graphs="full_and_piecewise")  # fmt: skip
    run = tmp_path / "fork-s0.jsonl"
    fuzz.append(run, {"event": "start", "id": "s0-3", "config": c.to_json()})
    fuzz.append(run, {"event": "lost", "id": "s0-3", "config": c.to_json(),
                      "status": "crashed", "error": "exit 1"})  # fmt: skip
    regs = tmp_path / "regs"
    fuzz.main(["shrink", str(run), "--id", "s0-3", "--deadline", "100000",
               "--regressions", str(regs)])  # fmt: skip
    (f,) = regs.glob("*.json")
    d = json.loads(f.read_text())
    assert d["failure"] == "crashed" and "illegal memory access" in d["error"]
    assert FuzzConfig.from_json(d["config"]).k == 8


def test_a_failed_configuration_keeps_the_engine_traceback():
    row = {"status": "error", "error": "AssertionError", "tokens": 0,
           "traceback": 'File "x.py", line 1\nAssertionError'}  # fmt: skip
    line = fuzz.result_line("s1-0", FuzzConfig("qwen3_5", "ngram", 8), row, None)
    assert line["row"]["traceback"].endswith("AssertionError")


def test_a_plp_configuration_keeps_what_its_prompt_oracle_measured():
    """A configuration flagged by the prompt-logprob oracle alone (no token
    divergence, no generated-token drift) says where and by how much."""
    first = {"prompt": 1, "position": 40, "token": 7, "drift": 0.4}
    row = {"status": "diverged", "tokens": 64, "divergences": 0,
           "drift_violations": 0, "prompt_drift_max": 0.4,
           "prompt_drift_threshold": 0.1, "prompt_drift_violations": 3,
           "prompt_first_drift": first}  # fmt: skip
    line = fuzz.result_line("s1-0", FuzzConfig("qwen3_5", "ngram", 8), row, None)
    assert line["status"] == "failed"
    assert line["row"]["prompt_drift_violations"] == 3
    assert line["row"]["prompt_first_drift"] == first
    assert line["row"]["prompt_drift_threshold"] == 0.1


def test_regroup_writes_one_group_per_failure_with_its_seed(tmp_path):
    run = tmp_path / "fork-s3.jsonl"
    a = FuzzConfig("qwen3_5", "ngram", 8, chunked=True, budget=64)
    b = FuzzConfig("nemotron_h", "mtp", 2)
    for cid, c, status in (("s3-0", a, "ok"), ("s3-1", b, "failed")):
        fuzz.append(run, {"event": "start", "id": cid, "config": c.to_json(),
                          "seed": 3})  # fmt: skip
        fuzz.append(run, {"event": "result", "id": cid, "config": c.to_json(),
                          "status": status})  # fmt: skip
    (path,) = fuzz.regroup([run], [], tmp_path / "g")
    g = json.loads(path.read_text())
    assert path.stem == "s3-1" and g["seed"] == 3
    assert [FuzzConfig.from_json(c) for _, c in g["items"]] == [b]
    assert len(fuzz.regroup([run], ["s3-0", "s3-1"], tmp_path / "h")) == 2
    with pytest.raises(SystemExit, match="s3-9"):
        fuzz.regroup([run], ["s3-9"], tmp_path / "i")


def test_acceptance_drafter_is_v1_only_and_asks_for_the_policy():
    for model in fuzz.MODELS:
        assert "ngram:acceptance" not in fuzz.drafters_for(model, "mrv2")
        assert "ngram:acceptance" in fuzz.drafters_for(model, "v1")
    cfg = fuzz.FuzzConfig(model="qwen3_5", drafter="ngram:acceptance", k=64)
    assert fuzz.spec_override(cfg) == {
        "method": "ngram",
        "num_speculative_tokens": 64,
        "prompt_lookup_min": cfg.lookup_min,
        "prompt_lookup_max": cfg.lookup_max,
        "draft_length_policy": "acceptance",
    }
    # an unpatched base does not know the key: refused, not a failure
    refusal = (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for "
        "SpeculativeConfig\ndraft_length_policy\n  Unexpected keyword argument "
        "[type=unexpected_keyword_argument, input_value='acceptance']"
    )
    assert fuzz.classify({"status": "rejected", "error": refusal}) == "refused"


def test_regroup_twin_runs_the_configuration_without_speculation(tmp_path):
    """A failure's non-speculative twin (same engine configuration, no
    drafter) runs in its group against the same reference; the report says
    whether speculation or the configuration itself diverges."""
    run = tmp_path / "fork-s20.jsonl"
    a = FuzzConfig("qwen3_next", "ngram_gpu", 4, chunked=True, budget=32,
                   cache_mode="align", graphs="full_and_piecewise")  # fmt: skip
    b = FuzzConfig("qwen3_5", "ngram_gpu", 2, chunked=True, budget=24)
    for cid, c in (("s20-3", a), ("s20-4", b)):
        fuzz.append(run, {"event": "start", "id": cid, "config": c.to_json(),
                          "seed": 20})  # fmt: skip
        fuzz.append(run, {"event": "result", "id": cid, "config": c.to_json(),
                          "status": "failed"})  # fmt: skip
    paths = fuzz.regroup([run], [], tmp_path / "g", twins=True)
    g = json.loads(paths[0].read_text())
    (cid, cfg), (tid, tcfg) = g["items"]
    assert tid == cid + fuzz.TWIN
    t = FuzzConfig.from_json(tcfg)
    assert t.drafter == "none"
    assert dataclasses.replace(t, drafter=a.drafter) == FuzzConfig.from_json(cfg)
    cell, twin_cell = fuzz.to_cell(FuzzConfig.from_json(cfg)), fuzz.to_cell(t)
    assert "speculative_config" not in twin_cell.extra
    assert {k: v for k, v in cell.extra.items() if k != "speculative_config"} == (
        twin_cell.extra
    )
    # the rerun's results: one twin matches the reference, one does not
    rerun = tmp_path / "out" / "fork-s20.jsonl"
    rerun.parent.mkdir()
    for cid, c, status in (
        ("s20-3", a, "failed"),
        ("s20-3" + fuzz.TWIN, fuzz.twin(a), "ok"),
        ("s20-4", b, "failed"),
        ("s20-4" + fuzz.TWIN, fuzz.twin(b), "failed"),
    ):
        fuzz.append(rerun, {"event": "result", "id": cid, "config": c.to_json(),
                            "status": status})  # fmt: skip
    res = fuzz.outcomes(fuzz.read_lines(rerun))
    assert fuzz.twin_verdict(res, "s20-3") == "speculation (twin ok)"
    assert fuzz.twin_verdict(res, "s20-4") == "configuration (twin fails too)"
    text = fuzz.report(rerun.parent)
    assert "| speculation (twin ok) |" in text
    assert "| configuration (twin fails too) |" in text
    # twins are controls: the lessons count the two drawn failures only (a
    # failed twin, drafter "none", would break what they share)
    assert "'drafter': 'ngram_gpu'" in fuzz.lessons(res.values())[0]
