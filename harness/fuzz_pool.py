"""The fuzzer's KV pool hook (``harness.fuzz``): a configuration with a
small pool asks for ``num_gpu_blocks_override = POOL_BASE + slack``, and
this hook, wrapped around the engine core's ``get_kv_cache_configs``
(called in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), replaces it by the
least number of blocks vLLM's own admission check accepts (one request of
``max_model_len``; searched with vLLM's own function, so the block sizes
vLLM picks at start, its KV cache groups and the cache mode are all
accounted for), plus one block per Mamba group and sequence, plus
``slack``. ``harness.equivalence._engine`` installs it before an engine
with such an override starts. Apart from ``harness.fuzz`` so that the
equivalence harness can install it without importing the fuzzer.

Hand-written: a few lines around one vLLM function; no library does this.
"""

from __future__ import annotations

from collections.abc import Callable

# num_gpu_blocks_override at or above POOL_BASE means "the least pool the
# engine starts with, plus (value - POOL_BASE) blocks"
POOL_BASE = 1 << 30
# an engine that refuses to start for its KV pool: a fuzzer bug
POOL_REFUSALS = (
    "To serve at least one request",
    "No available memory for the cache blocks",
)


POOL_LOG: list[dict] = []


def least_pool(fits: Callable[[int], bool], start: int = 8) -> int:
    """The least n >= 1 with fits(n), fits monotone: doubling, then
    bisection."""
    hi = start
    while not fits(hi):
        hi *= 2
        if hi > POOL_BASE:
            raise RuntimeError("no pool size fits")
    lo = 0  # fits(lo) is False or lo is 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def mamba_groups(configs) -> int:
    """KV cache groups of recurrent state (MambaSpec: Mamba2, GDN, ...)."""
    groups = getattr(configs[0], "kv_cache_groups", []) if configs else []
    return sum(type(g.kv_cache_spec).__name__ == "MambaSpec" for g in groups)


def sized(orig: Callable, count_mamba: Callable = mamba_groups) -> Callable:
    """Wrap vLLM's ``get_kv_cache_configs(vllm_config, ...)``: an override of
    ``POOL_BASE + slack`` becomes the least pool vLLM's own admission check
    accepts, plus one block per Mamba group and sequence, plus slack."""

    def fits_with(vllm_config, args, kw) -> Callable[[int], bool]:
        def fits(n: int) -> bool:
            vllm_config.cache_config.num_gpu_blocks_override = n
            try:
                orig(vllm_config, *args, **kw)
                return True
            except ValueError as e:
                if any(m in str(e) for m in POOL_REFUSALS):
                    return False
                raise

        return fits

    def wrapper(vllm_config, *args, **kw):
        cc = vllm_config.cache_config
        o = cc.num_gpu_blocks_override
        if o is None or o < POOL_BASE:
            return orig(vllm_config, *args, **kw)
        slack = o - POOL_BASE
        least = least_pool(fits_with(vllm_config, args, kw))
        cc.num_gpu_blocks_override = least
        m = count_mamba(orig(vllm_config, *args, **kw))
        seqs = vllm_config.scheduler_config.max_num_seqs
        blocks = least + m * seqs + slack
        cc.num_gpu_blocks_override = blocks
        POOL_LOG.append(
            {
                "least": least,
                "mamba_groups": m,
                "max_num_seqs": seqs,
                "slack": slack,
                "blocks": blocks,
                "block_size": cc.block_size,
            }
        )
        return orig(vllm_config, *args, **kw)

    wrapper.__wrapped__ = orig
    return wrapper


def install_pool_hook() -> bool:
    """Wrap the engine core's ``get_kv_cache_configs`` (once); False where
    vLLM is not importable (a dry run)."""
    try:
        import vllm.v1.engine.core as core
    except Exception:  # noqa: BLE001 - no vLLM here
        return False
    if not hasattr(core.get_kv_cache_configs, "__wrapped__"):
        core.get_kv_cache_configs = sized(core.get_kv_cache_configs)
    return True
