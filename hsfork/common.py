"""Paths, the upstream pin and small helpers shared by the fork tooling."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
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


def dist_dir() -> Path:
    return env_path("HSFORK_DIST", REPO / "dist")


@dataclass(frozen=True)
class PinnedFile:
    kind: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class Pin:
    """One line of the fork: an upstream release and what we build on it."""

    name: str
    version: str
    tag: str
    cuda: str
    files: tuple[PinnedFile, ...]
    # "stable", "current", ...; "" for a single-line pin file
    line: str = ""
    # the torch the upstream wheel declares
    torch: str = ""
    # the torchvision it declares (built against that torch: a host's
    # torchvision for another torch fails to import under it)
    torchvision: str = ""
    # what the CPU test bed installs (hsfork/testbed.py)
    testbed: dict[str, str] = field(default_factory=dict)

    def file(self, kind: str) -> PinnedFile:
        for f in self.files:
            if f.kind == kind:
                return f
        raise ToolError(f"{pin_file()}: no file of kind {kind!r} is pinned")


def _read_pin_file(path: Path) -> dict:
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def line_names(path: Path | None = None) -> dict[str, str]:
    """line name -> upstream version, in the pin file's order."""
    data = _read_pin_file(path or pin_file())
    if "lines" not in data:
        return {"": data["package"]["version"]}
    return {name: spec["version"] for name, spec in data["lines"].items()}


def selected_line(path: Path | None = None) -> str:
    """The line the tools act on: ``HSFORK_BASE`` (a line name or an upstream
    version, with or without a leading ``v``), else the pin file's default."""
    data = _read_pin_file(path or pin_file())
    if "lines" not in data:
        return ""
    want = os.environ.get("HSFORK_BASE", "").strip() or data.get("default", "")
    for name, spec in data["lines"].items():
        if want in (name, spec["version"], "v" + spec["version"]):
            return name
    known = ", ".join(f"{n} (v{s['version']})" for n, s in data["lines"].items())
    raise ToolError(f"unknown base {want!r}; the lines are: {known}")


def load_pin(path: Path | None = None, line: str | None = None) -> Pin:
    """The pin of ``line`` (default: the selected line)."""
    path = path or pin_file()
    data = _read_pin_file(path)
    if "lines" in data:
        line = line if line is not None else selected_line(path)
        if line not in data["lines"]:
            raise ToolError(f"{path}: no line {line!r}")
        pkg = data["lines"][line]
        raw_files = pkg["files"]
    else:  # a single-line pin: [package] and [[files]]
        line, pkg, raw_files = "", data["package"], data["files"]
    files = tuple(
        PinnedFile(f["kind"], f["filename"], f["sha256"].lower()) for f in raw_files
    )
    testbed = {
        k.removeprefix("testbed_"): str(v)
        for k, v in pkg.items()
        if k.startswith("testbed_")
    }
    return Pin(
        name=pkg["name"],
        version=pkg["version"],
        tag=pkg.get("tag", f"v{pkg['version']}"),
        cuda=pkg.get("cuda", ""),
        files=files,
        line=line,
        torch=pkg.get("torch", ""),
        torchvision=pkg.get("torchvision", ""),
        testbed=testbed,
    )


def _line_path(var: str, base: Path, pin: Pin | None) -> Path:
    """``var`` if set, else ``base``/<tag> (``base`` for a one-line pin)."""
    if os.environ.get(var):
        return env_path(var, base)
    pin = pin or load_pin()
    return base / pin.tag if pin.line else base


def fork_dir(pin: Pin | None = None) -> Path:
    return _line_path("HSFORK_FORK", REPO / "fork", pin)


def patches_dir(pin: Pin | None = None) -> Path:
    return _line_path("HSFORK_PATCHES", REPO / "patches", pin)


def venv_dir(pin: Pin | None = None) -> Path:
    return _line_path("HSFORK_VENV", REPO / ".venv", pin)


def build_dir(pin: Pin | None = None) -> Path:
    return _line_path("HSFORK_BUILD", REPO / "build", pin)


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
