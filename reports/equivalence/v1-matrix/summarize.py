"""Combine the V1-matrix reports of 2026-11-21 into SUMMARY.md.

Per cell and variant the completed result (ok/diverged) wins over an
error/rejected one; the source file is named (``harness.report.side_by_side``).
Run from this folder with the repository on PYTHONPATH."""

import glob

from harness.report import side_by_side


def main() -> None:
    files = sorted(glob.glob("v1-matrix-*.json")) + sorted(glob.glob("isolated/*.json"))
    files = [f for f in files if "0001-only" not in f]
    with open("SUMMARY.md", "w") as fh:
        fh.write("# V1-runner matrix: fork vs upstream v0.26.0 (H100, bf16, 2026-11-21)\n\n")
        fh.write("See README.md in this folder for how to read it. The fork column is\n")
        fh.write("the series of that day (patches 0001-0004).\n\n")
        fh.write(side_by_side(files))


if __name__ == "__main__":
    main()
