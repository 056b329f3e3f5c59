"""Fork vs upstream v0.26.0, side by side in one GPU call.

On the GPU host, from the repository root::

    source /tmp/hybridspec/env.sh
    python3 -m benchmarks.side_by_side --modes none,ngram_nomatch --deadline 540
    python3 -m benchmarks.side_by_side --modes scripted70 --deadline 540

Each (mode, variant) is one process of ``benchmarks.decode_latency`` (one
engine serving every batch size), the vLLM install picked by PYTHONPATH:

- fork: the PYTHONPATH of ``/tmp/hybridspec/env.sh`` (``site:deps:repo``)
  with this repository first;
- upstream: the same with ``/tmp/hybridspec/site`` replaced by
  ``/tmp/upstream-site``, a copy of it with ``patches/*.patch`` reversed
  (``git apply -R --include='vllm/*'``), made here when missing.

The variants alternate, fork-first and upstream-first in turn (ABBA over
repeats), so slow drift of the machine cancels. Results go to ``$OUT``
(default ``./out``) as they come: ``<mode>-<variant>-r<repeat>.json``, the
child logs under ``logs/``, and after each pair the ratio table
(``<run>.md``, ``<run>.json``, ``<run>.png``). Arguments after ``--`` go to
every ``decode_latency`` process (e.g. ``-- --tokens 96 --eager``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import BenchError
from benchmarks.decode_latency import MODES
from hsfork.common import patches_dir

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("fork", "upstream")
FINGERPRINT_FILE = Path("vllm/v1/spec_decode/utils.py")
FINGERPRINT = "def mark_zero_draft_decodes"
MARKER = ".hsfork-upstream"


def _csv(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"choose from {','.join(choices)}: {text!r}"
            )
        return items

    return parse


def split_passthrough(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """(own arguments, arguments after ``--`` for decode_latency)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv, extra = split_passthrough(argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side")
    ap.add_argument("--modes", type=_csv(MODES), default=list(MODES))
    ap.add_argument("--variants", type=_csv(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=1, help="pairs per mode (ABBA)")
    ap.add_argument(
        "--deadline",
        type=float,
        default=540.0,
        help="seconds for the whole call: no pair starts that cannot end by "
        "then (0: no deadline; every process runs to its end)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT") or "out")
    ap.add_argument("--run", default="decode-latency", help="report name")
    # the line's install and its variant sites (harness/upstream_site.sh
    # exports both; another line installed beside the first has its own)
    home = os.environ.get("HS_HOME", "/tmp/hybridspec")
    sites = os.environ.get("HS_SITE_ROOT", "/tmp")
    ap.add_argument("--fork-site", default=os.path.join(home, "site"))
    ap.add_argument("--upstream-site", default=os.path.join(sites, "upstream-site"))
    ap.add_argument(
        "--patches",
        default=None,
        help="the fork's patch series (default: the selected line's, HSFORK_BASE)",
    )
    ap.add_argument(
        "--engine-estimate",
        type=float,
        default=150.0,
        help="seconds one process is assumed to take before one has run",
    )
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--dry-run", action="store_true", help="print the plan only")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    a.extra = extra
    return a


def plan(modes: list[str], variants: list[str], repeats: int):
    """[(mode, repeat, variants in run order)]: the order flips with each
    repeat and each mode (fork-upstream, upstream-fork, ...)."""
    out = []
    for i, mode in enumerate(modes):
        for r in range(repeats):
            order = list(variants)
            if (i + r) % 2 == 1:
                order.reverse()
            out.append((mode, r, order))
    return out


def _norm(p: str) -> str:
    return os.path.normpath(p) if p else p


def variant_pythonpath(
    pythonpath: str, variant: str, repo: str, fork_site: str, upstream_site: str
) -> str:
    """PYTHONPATH for ``variant``: the repository first, then the given
    path with the fork's site swapped for upstream's where asked."""
    parts = [_norm(p) for p in pythonpath.split(os.pathsep) if p]
    fork_site, upstream_site, repo = (
        _norm(fork_site),
        _norm(upstream_site),
        _norm(repo),
    )
    if fork_site not in parts:
        raise BenchError(
            f"{fork_site} is not on PYTHONPATH: source /tmp/hybridspec/env.sh first"
        )
    if variant == "upstream":
        parts = [upstream_site if p == fork_site else p for p in parts]
    elif variant != "fork":
        raise BenchError(f"unknown variant {variant!r}")
    return os.pathsep.join([repo] + [p for p in parts if p != repo])


def child_env(base: dict[str, str], pythonpath: str) -> dict[str, str]:
    env = dict(base)
    env["PYTHONPATH"] = pythonpath
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def series(patches_dir: str | Path) -> list[Path]:
    """The patch files in series order."""
    d = Path(patches_dir)
    s = d / "series"
    if s.exists():
        names = [
            ln.strip()
            for ln in s.read_text().splitlines()
            if ln.strip() and not ln.startswith("#")
        ]
        return [d / n for n in names]
    return sorted(d.glob("*.patch"))


def has_fingerprint(site: str | Path) -> bool:
    f = Path(site) / FINGERPRINT_FILE
    return f.exists() and FINGERPRINT in f.read_text()


def series_digest(patches: list[Path]) -> str:
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def vllm_sections(patch_text: str) -> str:
    """The parts of a git patch that change files under ``vllm/``."""
    keep: list[str] = []
    cur: list[str] | None = None
    for line in patch_text.splitlines(keepends=True):
        if line.startswith("diff --git "):
            cur = [] if line.startswith("diff --git a/vllm/") else None
            if cur is not None:
                keep.append("")  # section marker
        if cur is not None:
            keep[-1] += line
    return "".join(keep)


def reverse_patch(patch: Path, root: Path) -> None:
    """Reverse the ``vllm/`` part of ``patch`` in ``root`` (git apply, or
    patch(1) where git is missing)."""
    # no repository above root may take over the paths (git apply would
    # resolve them from that repository's top level)
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(root).resolve().parent))
    try:
        r = subprocess.run(
            ["git", "apply", "-R", "--include=vllm/*", str(patch.resolve())],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
        )
        tool = "git apply -R"
    except FileNotFoundError:
        r = subprocess.run(
            ["patch", "-R", "-p1", "--forward", "--no-backup-if-mismatch"],
            cwd=root,
            input=vllm_sections(patch.read_text()),
            capture_output=True,
            text=True,
        )
        tool = "patch -R"
    if r.returncode != 0:
        raise BenchError(f"{tool} {patch.name} failed in {root}:\n{r.stdout}{r.stderr}")


def ensure_upstream_site(
    fork_site: str, upstream_site: str, patches: list[Path]
) -> str:
    """Make ``upstream_site``: the fork's site with the series reversed."""
    if not patches:
        raise BenchError("no patches found: the upstream site would equal the fork's")
    digest = series_digest(patches)
    up = Path(upstream_site)
    marker = up / MARKER
    if marker.exists() and marker.read_text().strip() == digest:
        if has_fingerprint(up):
            raise BenchError(f"{up} still has the fork's patches")
        return "reused"
    if not has_fingerprint(fork_site):
        raise BenchError(
            f"{fork_site} lacks the fork's patches ({FINGERPRINT} not in "
            f"{FINGERPRINT_FILE}): is the bundle up to date?"
        )
    tmp = Path(str(up) + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(fork_site, tmp, symlinks=True)
    for p in reversed(patches):
        reverse_patch(p, tmp)
    if has_fingerprint(tmp):
        raise BenchError(f"{tmp}: reversing the series left {FINGERPRINT}")
    (tmp / MARKER).write_text(digest + "\n")
    if up.exists():
        shutil.rmtree(up)
    tmp.rename(up)
    return "made"


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_child(
    cmd: list[str], env: dict, log: Path, timeout: float
) -> tuple[int, float]:
    """Run ``cmd`` in its own process group; kill that group on timeout
    (``math.inf``: none)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=None if math.isinf(timeout) else max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    return rc, time.time() - t0


def _num(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_variant(doc: dict | None, variant: str) -> str | None:
    """Why ``doc`` is not a run of ``variant`` (None when it is)."""
    if doc is None:
        return None
    fp = doc.get("fork_patches")
    if fp is None:
        return None
    if fp != (variant == "fork"):
        return (
            f"the {variant} run imported vllm from {doc.get('vllm_file')} "
            f"with fork patches present = {fp}"
        )
    return None


def report(out: Path, run: str) -> str | None:
    try:
        from benchmarks.plot import write_report

        paths = write_report([out], out, run)
        return paths["md"].read_text()
    except Exception as e:  # noqa: BLE001 - the JSONs are the result
        print(f"[side-by-side] report failed: {e!r}", flush=True)
        return None


def run_estimate(walls: dict[str, float], mode: str, default: float) -> float:
    """Seconds one more run of ``mode`` is expected to take.

    ``walls`` holds each mode's latest run. The first run of a mode compiles
    its graphs and every later one (either variant) reads them from the
    compile cache, so a mode's latest run is its estimate; a mode not run yet
    may compile, so it takes the longest run seen, else ``default``.
    """
    if mode in walls:
        return walls[mode]
    return max(walls.values(), default=default)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.time()
    deadline = t0 + a.deadline if a.deadline > 0 else math.inf
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[side-by-side {time.time() - t0:6.1f}s] {msg}", flush=True)

    steps = plan(a.modes, a.variants, a.repeats)
    try:
        base_pp = os.environ.get("PYTHONPATH", "")
        pps = {
            v: variant_pythonpath(base_pp, v, str(REPO), a.fork_site, a.upstream_site)
            for v in a.variants
        }
        for mode, r, order in steps:
            say(f"plan: {mode} repeat {r}: {' then '.join(order)}")
        for v, pp in pps.items():
            say(f"{v} PYTHONPATH={pp}")
        if a.dry_run:
            return 0
        if "fork" in a.variants and not has_fingerprint(a.fork_site):
            raise BenchError(f"{a.fork_site} lacks the fork's patches")
        if "upstream" in a.variants:
            how = ensure_upstream_site(
                a.fork_site, a.upstream_site, series(a.patches or patches_dir())
            )
            say(f"upstream site {a.upstream_site}: {how}")
    except BenchError as e:
        say(f"ERROR: {e}")
        return 2

    walls: dict[str, float] = {}
    failures: list[str] = []
    skipped: list[str] = []
    for mode, r, order in steps:
        est = run_estimate(walls, mode, a.engine_estimate)
        if deadline - time.time() < len(order) * est:
            skipped.append(f"{mode} r{r}")
            say(f"skip {mode} repeat {r}: {deadline - time.time():.0f}s left, "
                f"need ~{len(order) * est:.0f}s")  # fmt: skip
            continue
        for i, v in enumerate(order):
            left = deadline - time.time()
            reserve = est * (len(order) - 1 - i)  # for the partners still to run
            # decode_latency's --deadline; 0: none
            proc_deadline = (
                0.0 if math.isinf(left) else max(left - reserve - 10.0, 30.0)
            )
            name = f"{mode}-{v}-r{r}"
            path = out / f"{name}.json"
            cmd = [
                a.python, "-m", "benchmarks.decode_latency", "--mode", mode,
                "--variant", v, "--repeat", str(r), "--out", str(path),
                "--deadline", f"{proc_deadline:.0f}", *a.extra,
            ]  # fmt: skip
            say(f"start {name} (deadline {proc_deadline:.0f}s)")
            env = child_env(dict(os.environ), pps[v])
            rc, wall = run_child(cmd, env, out / "logs" / f"{name}.log", left - 3.0)
            walls[mode] = wall
            doc = _load(path)
            status = doc.get("status") if doc else "no-json"
            say(
                f"done {name}: rc {rc}, {wall:.0f}s, status {status}, "
                f"engine start {_num(doc.get('engine_start_s') if doc else None)}s"
            )
            for row in (doc or {}).get("results", []):
                say(
                    f"  BS {row.get('bs')}: median {_num(row.get('median_ms'))} ms, "
                    f"drafts {row.get('drafts_scheduled')}, "
                    f"acceptance {_num(row.get('acceptance'))}"
                )
            if rc != 0 or status not in ("ok", "partial"):
                failures.append(name)
                print(_tail(out / "logs" / f"{name}.log"), flush=True)
            why = check_variant(doc, v)
            if why:
                say(f"ERROR: {why}; stopping")
                report(out, a.run)
                return 2
            if not (doc or {}).get("results") and i < len(order) - 1:
                # no number to pair with: keep the time for the next mode
                say(
                    f"no result from {name}: its partner is skipped "
                    "(if the engine fails with CUDA graphs, try -- --eager)"
                )
                skipped.append(f"{mode} r{r} {' '.join(order[i + 1 :])}")
                break
        report(out, a.run)
    md = report(out, a.run)
    if md:  # the ratio table (the per-run table is in the file)
        print(md.split("\n## Runs")[0], flush=True)
    say(
        json.dumps(
            {"failures": failures, "skipped": skipped, "out": str(out), "run": a.run}
        )
    )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
