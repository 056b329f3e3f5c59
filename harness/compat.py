"""Where the vLLM lines the harness drives differ (the fork's "stable" line,
v0.26.0, and its "current" line, v0.33.0), as small version tests; the
harness has one code path per difference, chosen here.

The version is the installed vLLM's (its package metadata, else the
``_version.py`` of the ``vllm`` package on ``sys.path``, read without
importing vLLM), else the fork line the tools select (``HSFORK_BASE``,
``hsfork.common.load_pin``). ``HSFORK_VLLM_VERSION`` overrides both (a dry
run for another line, tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from pathlib import Path

VERSION_ENV = "HSFORK_VLLM_VERSION"


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.33.0"``, ``"v0.26.0"``, ``"0.33.0rc1.dev4+g..."`` -> (0, 33, 0)."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not m:
        raise ValueError(f"not a vLLM version: {text!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def _installed_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("vllm")
    except PackageNotFoundError:
        pass
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        f = Path(loc) / "_version.py"
        if f.exists():
            m = re.search(r"__version__\s*=.*?['\"]([^'\"]+)['\"]", f.read_text())
            if m:
                return m[1]
    return None


def _pinned_version() -> str | None:
    try:
        from hsfork.common import load_pin

        return load_pin().version
    except Exception:  # noqa: BLE001 - no repository pin here
        return None


@functools.cache
def _detected() -> tuple[tuple[int, int, int], str]:
    for source, get in (("installed", _installed_version), ("pin", _pinned_version)):
        text = get()
        if text:
            return parse_version(text), source
    raise RuntimeError(f"no vLLM found and no fork pin; set {VERSION_ENV}")


def vllm_version() -> tuple[int, int, int]:
    """The vLLM version the harness targets."""
    if os.environ.get(VERSION_ENV):
        return parse_version(os.environ[VERSION_ENV])
    return _detected()[0]


def version_source() -> str:
    """How :func:`vllm_version` was found: ``env``, ``installed`` or ``pin``."""
    return "env" if os.environ.get(VERSION_ENV) else _detected()[1]


def version_str() -> str:
    return ".".join(map(str, vllm_version()))


def at_least(major: int, minor: int, patch: int = 0) -> bool:
    return vllm_version() >= (major, minor, patch)


# ---------------------------------------------------------------------------
# the differences


def passes_mamba_cache_mode() -> bool:
    """v0.26.0 takes ``mamba_cache_mode`` (none | align | all) as an engine
    argument; v0.33.0 deprecates it (a warning, no effect): Mamba prefix
    caching follows ``enable_prefix_caching`` and is always "align"
    (``MambaModelConfig.verify_and_update_config``), so it is left out."""
    return not at_least(0, 33)


def align_budget_covers_block() -> bool:
    """v0.26.0 refuses align mode when a block holds more tokens than
    ``max_num_batched_tokens`` (an assertion in ``VllmConfig``); v0.33.0
    dropped that check (a 208-token block under a 160-token budget runs)."""
    return not at_least(0, 33)


def default_runner() -> str:
    """The model runner vLLM picks with ``VLLM_USE_V2_MODEL_RUNNER`` unset:
    V1 for hybrid models on v0.26.0 (``_is_default_v2_model_runner_model``),
    Model Runner V2 on v0.33.0 (unless the config needs a
    feature MRV2 lacks, e.g. ``custom_class`` drafting). The engine's choice
    is recorded per cell (``accept.model_runner``)."""
    return "mrv2" if at_least(0, 33) else "v1"


def mrv2_ngram() -> bool:
    """Model Runner V2 drafts n-grams: v0.33.0 (``NgramGPUSpeculator`` for
    ``ngram`` and ``ngram_gpu``); v0.26.0 refuses the method."""
    return at_least(0, 33)


def eagle3_same_vocab_d2t() -> bool:
    """Whether an EAGLE-3 head whose draft vocabulary is the target's carries
    a ``d2t`` map: v0.26.0 always builds ``draft_id_to_target_id`` (and
    leaves it zero, the identity, when the checkpoint has none); v0.33.0
    builds it only for a smaller draft vocabulary and its loader refuses a
    ``d2t`` otherwise ("no module or parameter named
    'draft_id_to_target_id'")."""
    return not at_least(0, 33)


def mtp_needs_spec_config() -> bool:
    """v0.33.0's MTP classes (e.g. ``NemotronHMTP._find_quant_config``) read
    the drafter's quantization config from ``speculative_config`` when they
    are built; v0.26.0's are built from the target's config alone."""
    return at_least(0, 33)


# MRV2's speculator whose ``propose`` the scripted drafter wraps
# (harness.drafter_mrv2): MTP, EAGLE and EAGLE-3 inherit it.
_MRV2_AR_SPECULATOR = {
    # v0.26.0: spec_decode/autoregressive/speculator.py
    (0, 26): (
        "vllm.v1.worker.gpu.spec_decode.autoregressive.speculator",
        "AutoRegressiveSpeculator",
    ),
    # v0.33.0: split into target_dependent_ar (drafters reading the
    # target's hidden states: MTP, EAGLE, EAGLE-3, Gemma4) and standalone_ar
    # (draft models)
    (0, 33): (
        "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator",
        "TargetDependentARSpeculator",
    ),
}


def mrv2_ar_speculator() -> tuple[str, str]:
    """(module, class) of the MRV2 speculator whose ``propose`` MTP uses."""
    v = vllm_version()[:2]
    return _MRV2_AR_SPECULATOR[(0, 33) if v >= (0, 33) else (0, 26)]
