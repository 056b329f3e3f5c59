"""Command line: python -m hsfork {fetch,sync,export,version,wheel,bundle,...}."""

from __future__ import annotations

import argparse
import sys

from .common import ToolError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hsfork")
    sub = ap.add_subparsers(dest="cmd", required=True)
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
    p = sub.add_parser("fixtures", help="write the offline model cache")
    p.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fetch":
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
            )
        elif args.cmd == "fixtures":
            from .fixtures import write_model_cache

            print(write_model_cache(args.out))
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
