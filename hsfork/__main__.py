"""Command line: python -m hsfork {fetch,sync,export,version,wheel,bundle,
torch-bundle,...}."""

from __future__ import annotations

import argparse
import os
import sys

from .common import ToolError, line_names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hsfork")
    ap.add_argument(
        "--base",
        default=None,
        help="the line to act on: a line name of upstream.toml (stable, current) "
        "or its upstream version; default: $HSFORK_BASE, else the pin's default",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("lines", help="list the lines: name, upstream version, paths")
    sub.add_parser("fetch", help="download and verify the pinned upstream files")
    p = sub.add_parser("sync", help="materialize fork/ from the pin and patches/")
    p.add_argument("--force", action="store_true", help="discard fork/ work")
    sub.add_parser("export", help="write fork/'s commits back into patches/")
    sub.add_parser("version", help="print the fork's wheel version")
    p = sub.add_parser("wheel", help="build the full wheel into dist/")
    p.add_argument("--python", default=sys.executable)
    p = sub.add_parser("bundle", help="pack the air-gapped GPU bundle")
    p.add_argument("--out", default=None)
    p.add_argument("--part-size", default="60M")
    p.add_argument(
        "--with-optional",
        action="store_true",
        help="include FA2, the MoE kernels, DeepGEMM and the Rust frontend",
    )
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PART",
        help="include one optional part (fa2, moe, deep_gemm, rs); repeatable",
    )
    p.add_argument(
        "--wheels", default=None, help="folder of dependency wheels to include (cp312)"
    )
    p.add_argument(
        "--requirement",
        action="append",
        default=[],
        metavar="REQ",
        help="carry this runtime requirement too, with its dependencies (e.g. "
        "'nvidia-cutlass-dsl[cu13]==4.8.0': Kimi-Linear on v0.33.0); repeatable",
    )
    p = sub.add_parser(
        "torch-bundle",
        help="pack the torch/triton stack the line declares for an air-gapped host",
    )
    p.add_argument("--out", default=None, help="default: build/<tag>/torch-bundle")
    p.add_argument(
        "--part-size",
        default="auto",
        help="largest part (e.g. 30M); auto: one upload beside the working tree",
    )
    p.add_argument(
        "--keep-sm",
        default="90",
        help="keep the GPU code of this architecture only (all: keep everything)",
    )
    p.add_argument(
        "--use-host",
        action="append",
        default=[],
        metavar="DIST",
        help="take this CUDA library from the host even where its version is "
        "older than torch needs (e.g. nvidia-nccl-cu13 on one GPU); repeatable",
    )
    p.add_argument("--xz-level", default="6", help="xz preset (6, 9e, ...)")
    p.add_argument("--xz-threads", type=int, default=2)
    p.add_argument(
        "--wheels",
        default=None,
        help="download folder (default .cache/torch-stack/<tag>)",
    )
    p = sub.add_parser(
        "resplit",
        help="cut a built bundle or torch stack into parts that fit one upload "
        "beside today's working tree (no packing again)",
    )
    p.add_argument("dir", help="the bundle folder (with manifest.json)")
    p.add_argument(
        "--part-size",
        default="auto",
        help="largest part (e.g. 27M); auto: one upload beside the working tree",
    )
    sub.add_parser("testbed", help="create or update the line's CPU test bed venv")
    p = sub.add_parser("fixtures", help="write the offline model cache")
    p.add_argument("--out", default=None)
    p = sub.add_parser("pr", help="the upstream PR package: branches, descriptions")
    p.add_argument("--signoff", default=None, help="'Name <email>' to sign off with")
    p.add_argument("--out", default=None, help="default: build/<tag>/pr")
    p.add_argument("--check", action="store_true", help="lint and red/green tests")
    p.add_argument("--list", action="store_true", help="print the PR table")
    p.add_argument(
        "--only", default="", help="check only these PRs: NN[,NN...] (with --check)"
    )
    args = ap.parse_args(argv)
    if args.base:
        os.environ["HSFORK_BASE"] = args.base
    try:
        if args.cmd == "lines":
            from .common import fork_dir, load_pin, patches_dir, selected_line

            chosen = selected_line()
            for name in line_names():
                pin = load_pin(line=name)
                mark = "*" if name == chosen else " "
                print(
                    f"{mark} {name or '-':8} v{pin.version:8} "
                    f"patches: {patches_dir(pin)}  fork: {fork_dir(pin)}"
                )
        elif args.cmd == "fetch":
            from .fetch import fetch_all

            for kind, path in fetch_all().items():
                print(f"{kind}: {path}")
        elif args.cmd == "sync":
            from .fork import sync

            sync(force=args.force)
        elif args.cmd == "export":
            from .fork import export

            export()
        elif args.cmd == "version":
            from .fork import fork_version

            print(fork_version())
        elif args.cmd == "wheel":
            from .wheel import build_wheel

            print(build_wheel(python=args.python))
        elif args.cmd == "bundle":
            from .bundle import make_bundle

            make_bundle(
                out=args.out,
                part_size=args.part_size,
                with_optional=args.with_optional or args.include,
                wheels=args.wheels,
                requirements=args.requirement,
            )
        elif args.cmd == "torch-bundle":
            from .stage_torch import make_torch_bundle, parse_keep_sm

            make_torch_bundle(
                out=args.out,
                part_size=args.part_size,
                keep_sm=parse_keep_sm(args.keep_sm),
                level=args.xz_level,
                threads=args.xz_threads,
                wheels_dir=args.wheels,
                use_host=args.use_host,
            )
        elif args.cmd == "resplit":
            from pathlib import Path

            from .bundle import resolve_part_size, resplit

            m = resplit(Path(args.dir), resolve_part_size(args.part_size))
            print(
                f"{len(m['parts'])} part(s) of at most {m['part_size'] >> 20} MiB "
                f"in {args.dir}/upload-1..{len(m['parts'])}"
            )
        elif args.cmd == "testbed":
            from .testbed import ensure_testbed

            print(ensure_testbed())
        elif args.cmd == "fixtures":
            from .fixtures import write_model_cache

            print(write_model_cache(args.out))
        elif args.cmd == "pr":
            from .pr import list_package, make_package

            if not args.list:
                only = [f"{int(n):02d}" for n in args.only.split(",") if n.strip()]
                make_package(
                    args.signoff, out=args.out, check=args.check, only=only or None
                )
            print(list_package(out=args.out))
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
