"""``python -m serving refusals --line TAG``: every speculative configuration
refused for hybrid models when the config is built, tried the two ways users
hit them, on the fork and on unpatched upstream, on this CPU host.

(a) ``LLM(...)``: ``LLM.__init__`` builds ``EngineArgs(**kwargs)`` and
``LLMEngine.from_engine_args`` calls ``create_engine_config(UsageContext.
LLM_CLASS)`` first; that is where a config is refused, before any device is
needed. One child process per line and variant (fork / upstream) runs every
case of that line in-process (``child`` below).

(b) ``vllm serve MODEL --speculative-config '...' ...`` as a subprocess (the
line's venv ``vllm``), on vLLM's CPU platform (``HSFORK_CPU_TESTBED=1``): its
exit code, seconds, stderr lines, tracebacks. A server whose config is
accepted is stopped as soon as its engine starts initialising.

Upstream = the tag's ``vllm/`` (``git archive``, plus the fork's built
extension files) put first on ``PYTHONPATH``, shadowing the editable fork.
Writes ``refusals.json`` and ``README.md`` into
``reports/serving/<line>/refusals-cpu-<date>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINES = ("v0.26.0", "v0.33.0")
# the date a run writes into its report folder name (today)
DATE = time.strftime("%Y-%m-%d")
WORK = Path("/tmp/hsfork-refusals")
MODEL = "FIXTURES"  # the fixtures folder (harness.models), in a run its path
CLI_TIMEOUT_S = 240.0
# the engine core's first log line: the config was accepted
ENGINE_STARTED = "Initializing a V1 LLM engine"
QWEN = {
    "limit_mm_per_prompt": {"image": 0, "video": 0},
    "language_model_only": True,
    "gdn_prefill_backend": "triton",
}
V2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
V1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


@dataclass
class Case:
    id: str
    lines: tuple[str, ...]
    source: str  # "fork NNNN (line)" or "vLLM"
    model: str  # fixture folder under MODEL
    kwargs: dict  # EngineArgs / LLM(...) keyword arguments (model added)
    alternative: str  # regex: the message names a supported alternative
    what: str  # one sentence: why it is refused
    env: dict = field(default_factory=dict)
    # the refusal is in the executor (Platform.update_block_size_for_backend,
    # after create_engine_config): (a) also runs that step; (b) waits for it
    executor_step: bool = False


def _spec(method: str, k: int = 2, **kw) -> dict:
    return {"method": method, "num_speculative_tokens": k, **kw}


def _pc(line_mode: bool = True, mode: str = "align") -> dict:
    """Prefix caching in mamba cache mode ``mode`` (v0.33.0 has no mode
    setting: prefix caching is align mode there)."""
    return {"enable_prefix_caching": True} | (
        {"mamba_cache_mode": mode} if line_mode else {}
    )


NGRAM = _spec("ngram", prompt_lookup_min=2, prompt_lookup_max=3)

CASES: list[Case] = [
    # -- the fork's refusals ------------------------------------------------
    Case(
        "draft-model-recurrent",
        LINES,
        "fork 0020 (v0.26.0) / 0009 (v0.33.0)",
        "nemotron_h",
        {"speculative_config": _spec("draft_model", model=f"{MODEL}/granitemoehybrid")},
        r"method='mtp'|attention layers only",
        "a draft model with recurrent state (here Granite-4.0-H drafting for "
        "NemotronH): the draft proposers keep no recurrent state of their own",
    ),
    Case(
        "draft-model-maps-to-mtp",
        LINES,
        "fork 0020 (v0.26.0) / 0009 (v0.33.0)",
        "qwen3_5",
        {"speculative_config": _spec("draft_model", model=f"{MODEL}/qwen3_5")},
        r"method='mtp'|attention layers only",
        "method='draft_model' with a Qwen3.5 checkpoint (here the target "
        "itself): its model type maps to an MTP drafter, and vLLM would load "
        "its MTP layers in place of the draft model asked for",
    ),
    Case(
        "align-k-ge-mamba-block",
        ("v0.26.0",),
        "fork 0013",
        "nemotron_h_small_state",
        _pc() | {"block_size": 32, "speculative_config": _spec("mtp", 32)},
        r"fewer speculative tokens|--block-size",
        "align mode with num_speculative_tokens >= mamba block size: a verify "
        "step crossing two block boundaries saves the state of the last only",
        executor_step=True,
    ),
    Case(
        "align-k-ge-mamba-block",
        ("v0.33.0",),
        "fork 0004",
        "nemotron_h_small_state",
        _pc(False) | {"block_size": 32, "speculative_config": _spec("mtp", 32)},
        r"fewer speculative tokens|--block-size",
        "align mode with num_speculative_tokens >= mamba block size: a verify "
        "step crossing two block boundaries saves the state of the last only",
        executor_step=True,
    ),
    Case(
        "mrv2-mamba-all-spec",
        ("v0.26.0",),
        "fork 0009",
        "nemotron_h",
        _pc(mode="all") | {"speculative_config": _spec("mtp")},
        r"mamba_cache_mode='align'|VLLM_USE_V2_MODEL_RUNNER=0",
        "Model Runner V2 + mamba_cache_mode='all' + spec: MRV2 never passes the "
        "previous step's last scheduled block that Mamba2's spec path reads",
        env=V2,
    ),
    Case(
        "mrv2-align-spec-pp",
        ("v0.26.0",),
        "fork 0010",
        "nemotron_h",
        _pc() | {"pipeline_parallel_size": 2, "speculative_config": _spec("mtp")},
        r"pipeline_parallel_size=1",
        "Model Runner V2 + align + spec + PP: non-last ranks run the align "
        "postprocess against block tables later steps overwrote",
        env=V2,
    ),
    Case(
        "ds-conv-align-spec",
        ("v0.26.0",),
        "fork 0011",
        "qwen3_5",
        QWEN | _pc() | {"speculative_config": _spec("mtp")},
        r"SD layout|VLLM_SSM_CONV_STATE_LAYOUT=SD|unset VLLM_SSM_CONV",
        "VLLM_SSM_CONV_STATE_LAYOUT=DS + align + spec: the align state copies "
        "cannot shift a DS conv state by the accepted draft tokens",
        env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"},
    ),
    Case(
        "mamba1-spec",
        LINES,
        "fork 0028 (v0.26.0) / 0021 (v0.33.0)",
        "jamba",
        {"speculative_config": NGRAM},
        r"without a speculative config",
        "any speculative config for a model with Mamba1 layers (here Jamba "
        "with n-gram): MambaMixer's decode step has no speculative path",
    ),
    Case(
        "lfm2-spec",
        ("v0.26.0",),
        "fork 0029",
        "lfm2",
        {"speculative_config": NGRAM},
        r"without a speculative config",
        "any speculative config for LFM2 (and LFM2-MoE, LFM2-VL, Plamo2): "
        "their ShortConv (Plamo2: Mamba) layers have no speculative path in "
        "v0.26.0",
    ),
    # -- vLLM's own refusals that hybrid users meet ------------------------
    Case(
        "async-ngram-v1",
        LINES,
        "vLLM",
        "nemotron_h",
        {"async_scheduling": True, "speculative_config": NGRAM},
        r"no-async-scheduling|async_scheduling=False|ngram_gpu|NGram GPU|"
        r"VLLM_USE_V2_MODEL_RUNNER",
        "--async-scheduling with the host-side n-gram drafter on the V1 model "
        "runner (the runner hybrids get on v0.26.0; forced here)",
        env=V1,
    ),
    Case(
        "align-no-chunked-prefill",
        ("v0.26.0",),
        "vLLM",
        "nemotron_h",
        _pc() | {"enable_chunked_prefill": False, "speculative_config": _spec("mtp")},
        r"[Cc]hunked prefill is required|enable[-_]chunked[-_]prefill",
        "align mode without chunked prefill (an assert)",
    ),
    Case(
        "align-no-chunked-prefill",
        ("v0.33.0",),
        "vLLM",
        "nemotron_h",
        _pc(False)
        | {"enable_chunked_prefill": False, "speculative_config": _spec("mtp")},
        r"[Cc]hunked prefill is required|enable[-_]chunked[-_]prefill",
        "prefix caching (align) without chunked prefill (an assert)",
    ),
    Case(
        "mrv2-ngram",
        ("v0.26.0",),
        "vLLM",
        "nemotron_h",
        {"speculative_config": NGRAM},
        r"VLLM_USE_V2_MODEL_RUNNER=0|V1 model runner",
        "n-gram drafting on Model Runner V2 (forced; hybrids default to V1)",
        env=V2,
    ),
    Case(
        "mrv2-suffix",
        ("v0.33.0",),
        "vLLM",
        "nemotron_h",
        {"speculative_config": _spec("suffix")},
        r"VLLM_USE_V2_MODEL_RUNNER=0|V1 model runner",
        "suffix decoding on Model Runner V2 (forced; the default falls back to "
        "V1 with a warning)",
        env=V2,
    ),
    Case(
        "mtp-pp-qwen3_5",
        LINES,
        "vLLM",
        "qwen3_5",
        QWEN | {"pipeline_parallel_size": 2, "speculative_config": _spec("mtp")},
        r"pipeline_parallel_size=1|without pipeline|-pp 1",
        "Qwen3.5's MTP draft with pipeline parallelism",
    ),
    Case(
        "replayssm-spec-prefix-caching",
        ("v0.33.0",),
        "vLLM",
        "nemotron_h",
        _pc(False)
        | {
            "use_replayssm": True,
            "mamba_backend": "flashinfer",
            "speculative_config": _spec("mtp"),
        },
        r"--disable-prefix-caching",
        "--use-replayssm spec decoding with prefix caching",
    ),
    Case(
        "replayssm-spec-triton-backend",
        ("v0.33.0",),
        "vLLM",
        "nemotron_h",
        {
            "enable_prefix_caching": False,
            "use_replayssm": True,
            "speculative_config": _spec("mtp"),
        },
        r"--mamba-backend flashinfer",
        "--use-replayssm spec decoding on the default (triton) mamba backend",
    ),
]


def cases_for(line: str) -> list[Case]:
    return [c for c in CASES if line in c.lines]


# -- the two ways in ----------------------------------------------------------


def _subst(value, models: str):
    if isinstance(value, str):
        return value.replace(MODEL, models)
    if isinstance(value, dict):
        return {k: _subst(v, models) for k, v in value.items()}
    return value


def engine_kwargs(case: Case, models: str) -> dict:
    """The ``EngineArgs`` / ``LLM(...)`` keyword arguments of ``case``."""
    kw = {"model": f"{models}/{case.model}", "max_model_len": 1024}
    return kw | _subst(case.kwargs, models)


def cli_args(kwargs: dict) -> list[str]:
    """``vllm serve`` arguments for ``EngineArgs`` keyword arguments: the
    model first, ``--flag`` / ``--no-flag`` for booleans, JSON for dicts."""
    kw = dict(kwargs)
    args = [kw.pop("model")]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            args.append(flag)
        elif v is False:
            args.append("--no-" + k.replace("_", "-"))
        elif isinstance(v, dict):
            args += [flag, json.dumps(v, separators=(",", ":"))]
        else:
            args += [flag, str(v)]
    return args


def shell_line(case: Case, models: str = MODEL) -> str:
    """The command a user types (environment first)."""
    env = " ".join(f"{k}={v}" for k, v in case.env.items())
    args = " ".join(_quote(a) for a in cli_args(engine_kwargs(case, models)))
    return f"{env} vllm serve {args}".strip()


def _quote(a: str) -> str:
    return f"'{a}'" if re.search(r"[^\w@%+=:,./-]", a) else a


def core_message(exc_text: str) -> str:
    """The refusal itself: pydantic's wrapper (``1 validation error for
    VllmConfig / Value error, ... [type=value_error, ...] / For further
    information ...``) taken off."""
    m = re.search(
        r"(?:Value error|Assertion failed), (.*?) \[type=(?:value|assertion)_error",
        exc_text,
        re.S,
    )
    return (m.group(1) if m else exc_text).strip()


def inner_exception(exc_name: str, exc_text: str) -> str:
    """``ValidationError (assertion)`` for pydantic's wrapper of an assert."""
    m = re.search(r"\[type=(\w+)_error", exc_text)
    if exc_name == "ValidationError" and m:
        return f"ValidationError ({m.group(1)})"
    return exc_name


class _AttentionBackend16:
    """Stands in for the attention backend the executor finds once the model
    is built (the fork's own test does the same): kernel block sizes 16."""

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [16]

    @staticmethod
    def customize_spec(spec):  # v0.33.0 asks the backend for its page size
        return spec


def child(cases: list[dict]) -> list[dict]:
    """Run in the line's venv: (a) for each case, in this one process."""
    import vllm
    import vllm.config.vllm as vllm_config_mod
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    try:
        from vllm.model_executor.layers.mamba.mamba_utils import (
            get_conv_state_layout,
        )
    except ImportError:  # pragma: no cover - older trees
        get_conv_state_layout = None
    has_triton = getattr(vllm_config_mod, "HAS_TRITON", True)
    out = []
    for c in cases:
        env, kwargs = c["env"], c["kwargs"]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        if get_conv_state_layout is not None:
            get_conv_state_layout.cache_clear()
        stand_ins = []
        if c["kwargs"].get("speculative_config", {}).get("method") == "suffix":
            # suffix decoding needs the arctic-inference package (absent here)
            # before any runner check; a GPU host may have it
            import vllm.config.speculative as spec_mod

            if not spec_mod.has_arctic_inference():
                spec_mod.has_arctic_inference = lambda: True
                stand_ins.append("has_arctic_inference()=True (not installed)")
        if env.get("VLLM_USE_V2_MODEL_RUNNER") == "1" and not has_triton:
            # Model Runner V2 checks for Triton (absent on this CPU host)
            # before its unsupported-feature list; a GPU host has it
            vllm_config_mod.HAS_TRITON = True
            stand_ins.append("HAS_TRITON=True (no Triton on the CPU host)")
        r = {"id": c["id"], "stand_ins": stand_ins, "vllm": vllm.__file__}
        t = time.monotonic()
        try:
            config = EngineArgs(**kwargs).create_engine_config(UsageContext.LLM_CLASS)
            r["status"] = "accepted"
            if c["executor_step"]:
                r["config_status"] = "accepted"
                try:
                    backends = current_platform._find_non_ssm_backends(config)
                except Exception:  # noqa: BLE001 - v0.26.0: no layers to read
                    backends = []
                if backends:
                    current_platform.update_block_size_for_backend(config)
                else:
                    # vLLM finds the attention backends in the built model's
                    # layers: none before the worker has loaded it
                    stand_ins.append(
                        "_align_hybrid_block_size with an attention backend of "
                        "kernel block sizes [16] (no model built on the CPU)"
                    )
                    current_platform._align_hybrid_block_size(
                        config, _AttentionBackend16
                    )
                cc = config.cache_config
                r["block_sizes"] = [cc.block_size, cc.mamba_block_size]
        except Exception as e:  # noqa: BLE001 - every refusal is recorded
            r["status"] = "refused"
            r["exception"] = inner_exception(type(e).__name__, str(e))
            r["exception_lines"] = len(str(e).splitlines())
            r["message"] = core_message(str(e))
            if c["executor_step"] and r.get("config_status") == "accepted":
                r["where"] = "executor (update_block_size_for_backend)"
            else:
                r["where"] = "create_engine_config"
        finally:
            vllm_config_mod.HAS_TRITON = has_triton
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        r["seconds"] = round(time.monotonic() - t, 2)
        out.append(r)
    return out


def _venv_python(line: str) -> Path:
    return REPO / ".venv" / line / "bin" / "python"


def upstream_tree(line: str, work: Path) -> Path:
    """The tag's ``vllm/`` with the fork's built files (``.so``,
    ``_version.py``): a folder to put first on ``PYTHONPATH``."""
    dest = work / f"upstream-{line}"
    if (dest / "vllm" / "__init__.py").exists():
        return dest
    fork = REPO / "fork" / line
    tmp = work / f"upstream-{line}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(fork), "archive", line, "vllm"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    for f in (fork / "vllm").iterdir():
        if f.suffix == ".so" or f.name == "_version.py":
            shutil.copy2(f, tmp / "vllm" / f.name)
    tmp.rename(dest)
    return dest


def _env(variant_path: Path | None, extra: dict) -> dict:
    env = dict(os.environ)
    paths = ([str(variant_path)] if variant_path else []) + [str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(
        HSFORK_CPU_TESTBED="1",  # vLLM's CPU platform (hsfork's plugin)
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(REPO / ".cache" / "hf" / "hub"),
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
    )
    env.update(extra)
    return env


def run_api(line: str, variant: str, cases: list[Case], models: str, work: Path):
    """(a) for ``cases`` in one child process of the line's venv."""
    payload = [
        {
            "id": c.id,
            "env": c.env,
            "kwargs": engine_kwargs(c, models),
            "executor_step": c.executor_step,
        }
        for c in cases
    ]
    f = work / f"api-{line}-{variant}.json"
    f.write_text(json.dumps(payload))
    up = upstream_tree(line, work) if variant == "upstream" else None
    p = subprocess.run(
        [str(_venv_python(line)), "-m", "serving.refusals", "child", str(f)],
        cwd=REPO,
        env=_env(up, {"VLLM_LOGGING_LEVEL": "ERROR"}),
        capture_output=True,
        text=True,
    )
    for ln in p.stdout.splitlines():
        if ln.startswith("RESULTS "):
            return json.loads(ln[len("RESULTS ") :])
    raise RuntimeError(f"child {line} {variant} failed:\n{p.stderr[-3000:]}")


def run_cli(
    line: str, variant: str, case: Case, models: str, work: Path, port: int
) -> dict:
    """(b): ``vllm serve`` as a user types it, until it exits, or until its
    engine starts (accepted at config time), or ``CLI_TIMEOUT_S``."""
    up = upstream_tree(line, work) if variant == "upstream" else None
    exe = REPO / ".venv" / line / "bin" / "vllm"
    args = cli_args(engine_kwargs(case, models)) + ["--port", str(port)]
    log = work / f"cli-{line}-{variant}-{case.id}"
    t = time.monotonic()
    with open(f"{log}.out", "w") as fo, open(f"{log}.err", "w") as fe:
        proc = subprocess.Popen(
            [str(exe), "serve", *args],
            cwd=work,
            env=_env(up, case.env),
            stdout=fo,
            stderr=fe,
            start_new_session=True,
        )
        ended = "exited"
        while proc.poll() is None:
            time.sleep(0.5)
            both = Path(f"{log}.err").read_text() + Path(f"{log}.out").read_text()
            if ENGINE_STARTED in both and not case.executor_step:
                ended = "engine started (config accepted); stopped"
                break
            if time.monotonic() - t > CLI_TIMEOUT_S:
                ended = f"still running after {CLI_TIMEOUT_S:.0f} s; stopped"
                break
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = Path(f"{log}.err").read_text()
    out = Path(f"{log}.out").read_text()
    seconds = round(time.monotonic() - t, 1)
    return summarize_cli(proc.returncode, ended, seconds, err, out)


def summarize_cli(rc: int, ended: str, seconds: float, err: str, out: str) -> dict:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    tb = err.count("Traceback (most recent call last)")
    errors = [ln for ln in lines if re.search(r"Error\b|Error:|error:", ln)]
    return {
        "rc": rc,
        "ended": ended,
        "root_cause": root_cause(err + "\n" + out),
        "seconds": seconds,
        "stderr_lines": len(err.splitlines()),
        "stdout_lines": len(out.splitlines()),
        "tracebacks": tb,
        "last_error": (errors[-1] if errors else (lines[-1] if lines else ""))[:400],
        "text": err + out,
    }


def root_cause(text: str) -> str:
    """The first exception line of a server's output (log prefixes and
    warnings left out)."""
    hits = [
        re.sub(r"^\(\w+ pid=\d+\) ", "", ln)
        for ln in text.splitlines()
        if re.search(r"\b\w+(Error|Exception): ", ln) and " WARNING " not in ln
    ]
    # vLLM's ERROR log lines (a worker's own exception) before tracebacks
    hits.sort(key=lambda ln: not ln.startswith("ERROR "))
    if not hits:
        return ""
    return re.sub(r"^ERROR \S+ \S+ \[\S+\] +", "", hits[0]).strip()[:400]


def shows(cli: dict, message: str | None) -> bool:
    """Whether the refusal message (its first 60 characters) is in the
    server's output."""
    return bool(message) and message[:60] in cli["text"]


# -- the fixtures -------------------------------------------------------------


def small_state_nemotron(src: Path, out: Path) -> None:
    """NemotronH whose mamba state (with 32 draft slots in the conv state)
    fits in the attention page of one token, so block size 32 stays the
    align block size (the fork's own test config): config and tokenizer
    only, no weights."""
    from harness.models import nemotron_h_config

    cfg = nemotron_h_config() | {
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "mamba_num_heads": 2,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy2(src / f, out / f)


def write_fixtures(models: Path, python: Path) -> None:
    """The fixtures the cases name (harness.models, in seconds), once."""
    kinds = sorted({c.model for c in CASES} - {"nemotron_h_small_state"})
    kinds.append("granitemoehybrid")
    missing = [k for k in kinds if not (models / k / "config.json").exists()]
    code = (
        "import sys\nfrom harness.models import write_model\n"
        "for k in sys.argv[2:]:\n    write_model(k, sys.argv[1] + '/' + k)\n"
    )
    if missing:
        subprocess.run(
            [str(python), "-c", code, str(models), *missing],
            cwd=REPO,
            env=_env(None, {}),
            check=True,
        )
    small_state_nemotron(models / "nemotron_h", models / "nemotron_h_small_state")


# -- the table ----------------------------------------------------------------


def judge(case: Case, api: dict) -> dict:
    """One line naming the supported alternative?"""
    msg = api.get("message") or ""
    return {
        "one_line": api.get("status") == "refused" and "\n" not in msg,
        "names_alternative": bool(re.search(case.alternative, msg)),
    }


def rows_for(line: str, results: dict) -> list[dict]:
    """``results[(variant, id)]`` = {"api": ..., "cli": ...} -> rows."""
    rows = []
    for c in cases_for(line):
        fork = results.get(("fork", c.id), {})
        up = results.get(("upstream", c.id), {})
        api = fork.get("api", {})
        row = {
            "id": c.id,
            "line": line,
            "source": c.source,
            "what": c.what,
            "env": c.env,
            "kwargs": c.kwargs | {"model": f"{MODEL}/{c.model}"},
            "command": shell_line(c),
            "fork_api": api,
            "upstream_api": up.get("api", {}),
            "fork_cli": _drop_text(fork.get("cli")),
            "upstream_cli": _drop_text(up.get("cli")),
        } | judge(c, api)
        for v in ("fork", "upstream"):
            cli = results.get((v, c.id), {}).get("cli")
            a = results.get((v, c.id), {}).get("api", {})
            if cli is not None and row[f"{v}_cli"] is not None:
                row[f"{v}_cli"]["root_cause"] = root_cause(cli["text"])
                row[f"{v}_cli"]["shows_refusal"] = shows(cli, a.get("message"))
        row["findings"] = findings(row)
        rows.append(row)
    return rows


def _drop_text(cli: dict | None) -> dict | None:
    return None if cli is None else {k: v for k, v in cli.items() if k != "text"}


def findings(row: dict) -> list[str]:
    out = []
    api, cli = row["fork_api"], row["fork_cli"]
    ours = row["source"].startswith("fork")
    if api.get("status") == "refused":
        if not row["names_alternative"]:
            who = "our patch's" if ours else "vLLM's"
            out.append(f"{who} message names no supported alternative")
        if "assertion" in api.get("exception", "").lower():
            out.append("refused by an assert (AssertionError), not a ValueError")
        if api.get("exception_lines", 1) > 1:
            out.append(
                f"the exception text is {api['exception_lines']} lines "
                "(pydantic's ValidationError wrapper)"
            )
        if api.get("where", "").startswith("executor"):
            out.append(
                "not refused at config time: create_engine_config accepts it, "
                "the executor refuses it after the worker is up (a GPU host "
                "loads the weights first)"
            )
    elif api.get("status") == "accepted":
        out.append("accepted on this CPU host: no config-time refusal")
    if cli is not None:
        if cli.get("tracebacks"):
            out.append(
                f"vllm serve prints {cli['tracebacks']} traceback(s), "
                f"{cli['stderr_lines']} stderr lines"
            )
        if api.get("status") == "refused" and not cli.get("shows_refusal"):
            out.append(
                "vllm serve on this CPU host dies of something else first: "
                + cli.get("root_cause", "")[:200]
            )
    up = row["upstream_api"]
    if (
        ours
        and up.get("status") == "refused"
        and up.get("message") == api.get("message")
    ):
        out.append("upstream refuses it the same way (not the fork's check)")
    return out


def _api_cell(a: dict) -> str:
    if not a:
        return "–"
    if a.get("status") == "refused":
        where = " (executor)" if a.get("where", "").startswith("executor") else ""
        return f"refused{where}: {a.get('exception')}"
    return a.get("status", "?")


def _cli_cell(c: dict | None) -> str:
    if not c:
        return "not run"
    shown = "refusal shown" if c.get("shows_refusal") else "other error"
    if c["ended"] != "exited":
        return f"{c['ended']} ({c['seconds']} s)"
    return (
        f"rc {c['rc']}, {c['seconds']} s, {c['stderr_lines']} stderr lines, "
        f"{c['tracebacks']} tb; {shown}"
    )


def _yn(b: bool) -> str:
    return "yes" if b else "**no**"


def markdown(line: str, rows: list[dict], meta: dict) -> str:
    out = [
        f"# Speculative configurations refused for hybrid models ({line}, CPU)",
        "",
        f"Written by `{meta['command']}` on {meta['date']} "
        f"(`serving/refusals.py`; {meta['host']}).",
        "",
        "Each case is tried (a) as `LLM(...)` does it: "
        "`EngineArgs(**kwargs).create_engine_config(UsageContext.LLM_CLASS)`, "
        "the first thing `LLM.__init__` runs after building `EngineArgs` "
        "(`LLMEngine.from_engine_args`); and (b) as `vllm serve MODEL ...` "
        "in a subprocess, on the fork and on unpatched upstream (the tag's "
        "`vllm/` first on `PYTHONPATH`). vLLM's CPU platform "
        "(`HSFORK_CPU_TESTBED=1`); the models are `harness.models` fixtures "
        "(`FIXTURES/KIND`). A `vllm serve` whose config is accepted is "
        "stopped when its engine starts initialising.",
        "",
        "| # | case | source | fork (a) | upstream (a) | message one line | names the "
        "alternative | `vllm serve` fork | `vllm serve` upstream |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        refused = r["fork_api"].get("status") == "refused"
        out.append(
            f"| {i} | `{r['id']}` | {r['source']} | {_api_cell(r['fork_api'])} "
            f"| {_api_cell(r['upstream_api'])} "
            f"| {_yn(r['one_line']) if refused else '–'} "
            f"| {_yn(r['names_alternative']) if refused else '–'} "
            f"| {_cli_cell(r['fork_cli'])} | {_cli_cell(r['upstream_cli'])} |"
        )
    n = sum(r["fork_api"].get("status") == "refused" for r in rows)
    good = sum(r["one_line"] and r["names_alternative"] for r in rows)
    out += [
        "",
        f"{len(rows)} configurations, {n} refused on the fork, {good} with one "
        "line naming the supported alternative.",
        "",
        "## Each case",
        "",
    ]
    for i, r in enumerate(rows, 1):
        out += [f"### {i}. `{r['id']}` ({r['source']})", "", r["what"] + ".", ""]
        out += ["```", r["command"], "```", ""]
        for v in ("fork", "upstream"):
            a = r[f"{v}_api"]
            if a.get("status") == "refused":
                out.append(f"- {v} (a), {a['where']}, {a['exception']}:")
                out.append(f"  > {a['message']}")
            elif a:
                out.append(f"- {v} (a): {a.get('status')}")
            if a.get("stand_ins"):
                out.append(f"  (stand-in: {', '.join(a['stand_ins'])})")
            c = r[f"{v}_cli"]
            if c:
                out.append(f"- {v} `vllm serve`: {_cli_cell(c)}; first error:")
                out.append(f"  `{c['root_cause'][:300]}`")
                if c["last_error"] and c["last_error"] not in c["root_cause"]:
                    out.append(f"  last: `{c['last_error'][:300]}`")
        if r["findings"]:
            out.append("- findings: " + "; ".join(r["findings"]))
        out.append("")
    out += meta.get("appendix", [])
    return "\n".join(out) + "\n"


NOTES = """## On this CPU host, and what a GPU host shows

- The config checks run are the device-independent ones (`EngineArgs`,
  `VllmConfig`, `SpeculativeConfig`, the models' `verify_and_update_config`)
  on vLLM's CPU platform; they are the same code on a GPU host. The CPU
  platform turns prefix caching off for MLA models (Kimi-Linear), so that
  case runs without prefix caching.
- No Triton here: Model Runner V2 refuses every config first with "Model
  Runner V2 requires Triton." (v0.26.0). For the cases that force MRV2, (a)
  sets `vllm.config.vllm.HAS_TRITON = True` (noted as a stand-in);
  `vllm serve` runs unchanged and so shows the Triton refusal on this host;
  a GPU host shows the (a) message there, in the same traceback.
- No arctic-inference here: suffix decoding is refused with an ImportError
  naming `pip install arctic-inference` first; (a) stands in for the
  package to reach the runner check.
- `align-k-ge-mamba-block` (the fork's check) is not a config-time refusal:
  it sits in `Platform._align_hybrid_block_size`, which the executor calls
  (`update_block_size_for_backend`) in the worker, after the model is
  loaded. `create_engine_config` accepts the config; (a) then runs the
  alignment with a stand-in attention backend (kernel block sizes [16], as
  the fork's own test does). Its fixture (a NemotronH whose mamba state fits
  in one token's attention page, so block size 32 stays the mamba block
  size) has a config and tokenizer only. `vllm serve` on this host dies in
  the CPU worker first (no `vllm._C`); on a GPU host, with weights, the
  worker raises the refusal and the server exits with "Engine core
  initialization failed" and the tracebacks of the worker, the engine core
  and the API server.
- `vllm serve` and every config-time refusal: `create_engine_config` runs in
  the API server process, nothing catches the exception, and the user gets
  Python's traceback (about 40 lines of stderr) ending in pydantic's
  three-line `ValidationError` with the message in its middle line; the
  same on a GPU host (the path is device-independent).
"""


GPU_ONLY = """## Needs a GPU host: malformed requests to a running server

Refusals per request need a running server (a CPU host cannot start one of
these models); against `vllm serve FIXTURES/nemotron_h --speculative-config
'{"method":"mtp","num_speculative_tokens":2}' --max-model-len 1024`, each
should come back as HTTP 400 with one line, the server staying up:

```bash
H='Content-Type: application/json'; U=http://localhost:8000/v1/completions
M=FIXTURES/nemotron_h
# negative max_tokens
curl -s $U -H "$H" -d '{"model":"'$M'","prompt":"a b c","max_tokens":-1}'
# a prompt over max_model_len (1024 tokens of "a ")
curl -s $U -H "$H" -d '{"model":"'$M'","prompt":"'"$(printf 'a %.0s' $(seq 1100))"'",'\\
'"max_tokens":4}'
# prompt + max_tokens over max_model_len
curl -s $U -H "$H" -d '{"model":"'$M'","prompt":"a b c","max_tokens":4096}'
# speculative fields per request (not request parameters: rejected or ignored?)
curl -s $U -H "$H" -d '{"model":"'$M'","prompt":"a b c","max_tokens":4,'\\
'"num_speculative_tokens":64}'
curl -s $U -H "$H" -d '{"model":"'$M'","prompt":"a b c","max_tokens":4,'\\
'"speculative_config":{"method":"ngram"}}'
# logprobs / n / best_of with spec decoding
curl -s $U -H "$H" -d '{"model":"'$M'","prompt":"a b c","max_tokens":4,"n":-2}'
curl -s $U -H "$H" -d '{"model":"'$M'","prompt":"a b c","max_tokens":4,"logprobs":-1}'
curl -s http://localhost:8000/health   # still 200 after all of them
```

Record per request: HTTP status, the error body (one line?), and whether the
server's log shows a traceback.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m serving refusals",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("--line", choices=LINES + ("both",), default="both")
    ap.add_argument("--no-cli", action="store_true", help="(a) only")
    ap.add_argument(
        "--upstream-cli",
        choices=("fork-cases", "all", "none"),
        default="fork-cases",
        help="run vllm serve on upstream too: for the fork's refusals only "
        "(default; vLLM's own checks are the same code upstream), all, none",
    )
    ap.add_argument("--only", action="append", help="case id (repeatable)")
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument(
        "--out",
        type=Path,
        help=f"LINE is replaced; default reports/serving/LINE/refusals-cpu-{DATE}",
    )
    ap.add_argument(
        "--render",
        action="store_true",
        help="write the report from the last run's results (WORK/results-LINE.json)",
    )
    args = ap.parse_args(argv)
    work = args.work
    lines = LINES if args.line == "both" else (args.line,)
    if args.render:
        for line in lines:
            render(line, work, args.out, f"python -m serving refusals --line {line}")
        return 0
    work.mkdir(parents=True, exist_ok=True)
    models = work / "models"
    write_fixtures(models, _venv_python(lines[0]))
    port = 18400
    for line in lines:
        cases = [c for c in cases_for(line) if not args.only or c.id in args.only]
        results: dict = {}
        for variant in ("fork", "upstream"):
            for r in run_api(line, variant, cases, str(models), work):
                results.setdefault((variant, r["id"]), {})["api"] = r
            print(f"{line} {variant}: (a) done", flush=True)
        for c in [] if args.no_cli else cases:
            variants = ["fork"]
            ours = c.source.startswith("fork")
            if args.upstream_cli == "all" or (
                args.upstream_cli == "fork-cases" and ours
            ):
                variants.append("upstream")
            for variant in variants:
                port += 1
                cli = run_cli(line, variant, c, str(models), work, port)
                results[(variant, c.id)]["cli"] = cli
                print(f"{line} {variant} {c.id}: {_cli_cell(cli)}", flush=True)
        cache = work / f"results-{line}.json"
        if args.only and cache.exists():  # the other cases of the last run stay
            old = {tuple(k): v for k, v in json.loads(cache.read_text())}
            for k, v in results.items():
                old.setdefault(k, {}).update(v)
            results = old
        cache.write_text(json.dumps([[list(k), v] for k, v in results.items()]))
        render(line, work, args.out, f"python -m serving refusals --line {line}")
    return 0


def render(line: str, work: Path, out: Path | None, command: str) -> Path:
    """The report of ``line`` from ``WORK/results-LINE.json``, the fixtures
    folder of the run written as ``FIXTURES``."""
    text = (work / f"results-{line}.json").read_text()
    text = text.replace(str(work / "models"), MODEL)
    results = {tuple(k): v for k, v in json.loads(text)}
    rows = rows_for(line, results)
    out = Path(str(out).replace("LINE", line)) if out else None
    return write_report(line, rows, out, command)


def write_report(line: str, rows: list[dict], out: Path | None, command: str) -> Path:
    out = out or REPO / "reports" / "serving" / line / f"refusals-cpu-{DATE}"
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": command,
        "date": DATE,
        "host": "CPU host, 2 cores, no GPU, no Triton",
        "appendix": [NOTES, GPU_ONLY],
    }
    (out / "refusals.json").write_text(
        json.dumps({"line": line, "meta": meta, "rows": rows}, indent=1) + "\n"
    )
    (out / "README.md").write_text(markdown(line, rows, meta))
    return out


def _child_main(path: str) -> int:
    res = child(json.loads(Path(path).read_text()))
    print("RESULTS " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        sys.exit(_child_main(sys.argv[2]))
    sys.exit(main())
