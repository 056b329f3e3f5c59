"""The weight-read floor of a decode step: the bytes of the weights one
decode step reads (the language model without its embedding table, plus
``lm_head``; from the safetensors headers) over the device's copy bandwidth
(``measure_bandwidth``: a device-to-device copy of a large tensor, CUDA
events).

    python -m benchmarks.serve_bench bandwidth [--gib 2] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path

from . import BenchError


def safetensors_sizes(path: str | Path) -> dict[str, int]:
    """``{tensor name: bytes}`` from a safetensors file's header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    return {
        k: v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in head.items()
        if k != "__metadata__"
    }


def decode_weight_bytes(model_dir: str | Path) -> dict:
    """Bytes of the weights one decode step of the served language model
    reads: every ``model.language_model.*`` tensor except the embedding
    table (a decode step gathers a few rows of it) plus ``lm_head`` (read
    whole; the embedding table when the checkpoint ties it). Not counted:
    the vision tower (``--language-model-only``), the MTP layer (no
    speculation), KV cache and recurrent state."""
    model_dir = Path(model_dir)
    sizes: dict[str, int] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        sizes.update(safetensors_sizes(f))
    if not sizes:
        raise BenchError(f"no safetensors in {model_dir}")
    return decode_bytes_of(sizes)


def decode_bytes_of(sizes: dict[str, int]) -> dict:
    """``decode_weight_bytes`` from ``{tensor name: bytes}``."""
    embed = "model.language_model.embed_tokens.weight"
    body = sum(
        b
        for k, b in sizes.items()
        if k.startswith("model.language_model.") and k != embed
    )
    head = sum(b for k, b in sizes.items() if k.startswith("lm_head."))
    tied = head == 0 and embed in sizes
    if tied:
        head = sizes[embed]
    other = sum(sizes.values()) - body - head - (0 if tied else sizes.get(embed, 0))
    return {
        "decode_bytes": body + head,
        "language_model_bytes": body,
        "lm_head_bytes": head,
        "tied": tied,
        "embed_bytes": sizes.get(embed, 0),
        "not_read_bytes": other,
        "checkpoint_bytes": sum(sizes.values()),
    }


def weight_read_floor_ms(weight_bytes: float, bandwidth_gbps: float) -> float:
    """Milliseconds to read ``weight_bytes`` at ``bandwidth_gbps`` (GB/s,
    10^9 bytes)."""
    if bandwidth_gbps <= 0:
        raise ValueError("bandwidth must be positive")
    return weight_bytes / (bandwidth_gbps * 1e9) * 1e3


def measure_bandwidth(
    nbytes: int = 2 << 30, iters: int = 20, device: str = "cuda"
) -> dict:
    """Device-to-device copy of an ``nbytes`` tensor, ``iters`` times after
    a warm-up; bandwidth counts the bytes read and written (2 * nbytes per
    copy), as a weight read streams them: GB/s = 2 * nbytes * iters / s."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    cuda = device.startswith("cuda")
    for _ in range(3):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        secs = start.elapsed_time(end) / 1e3
        name = torch.cuda.get_device_name()
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        secs = time.perf_counter() - t0
        name = device
    gbps = 2 * nbytes * iters / secs / 1e9
    del src, dst
    return {
        "copy_gbps": round(gbps, 1),
        "nbytes": nbytes,
        "iters": iters,
        "seconds": round(secs, 6),
        "device": name,
        "method": "dst.copy_(src), bytes read + written",
    }


def bandwidth_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench bandwidth")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = measure_bandwidth(int(a.gib * (1 << 30)), a.iters, a.device)
    text = json.dumps(res)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0
