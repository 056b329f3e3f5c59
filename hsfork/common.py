"""Paths, the upstream pin and small helpers shared by the fork tooling."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class ToolError(RuntimeError):
    """An error meant for the user: printed without a traceback."""


def env_path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).resolve() if value else default


def pin_file() -> Path:
    return env_path("HSFORK_PIN", REPO / "upstream.toml")


def cache_dir() -> Path:
    return env_path("HSFORK_CACHE", REPO / ".cache" / "upstream")


def fork_dir() -> Path:
    return env_path("HSFORK_FORK", REPO / "fork")


def patches_dir() -> Path:
    return env_path("HSFORK_PATCHES", REPO / "patches")


def dist_dir() -> Path:
    return env_path("HSFORK_DIST", REPO / "dist")


@dataclass(frozen=True)
class PinnedFile:
    kind: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    tag: str
    cuda: str
    files: tuple[PinnedFile, ...]

    def file(self, kind: str) -> PinnedFile:
        for f in self.files:
            if f.kind == kind:
                return f
        raise ToolError(f"{pin_file()}: no file of kind {kind!r} is pinned")


def load_pin(path: Path | None = None) -> Pin:
    path = path or pin_file()
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    pkg = data["package"]
    files = tuple(
        PinnedFile(f["kind"], f["filename"], f["sha256"].lower()) for f in data["files"]
    )
    return Pin(
        name=pkg["name"],
        version=pkg["version"],
        tag=pkg.get("tag", f"v{pkg['version']}"),
        cuda=pkg.get("cuda", ""),
        files=files,
    )


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def run(
    cmd: list[str],
    cwd: Path | None = None,
    check: bool = True,
    capture: bool = True,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        text=True,
        capture_output=capture,
        env=env,
        input=input,
    )
    if check and proc.returncode != 0:
        out = ((proc.stdout or "") + (proc.stderr or "")).strip()
        raise ToolError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{out}")
    return proc


def info(msg: str) -> None:
    print(f"[hsfork] {msg}", file=sys.stderr, flush=True)
