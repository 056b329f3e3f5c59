"""Combine the V1-matrix reports of 2026-11-21 into SUMMARY.md.

Per cell and variant the completed result (ok/diverged) wins over an
error/rejected one; the source file is named. Run from this folder."""

import glob
import json

KEY = ("model", "drafter", "k", "batch", "cache_mode", "graphs", "async",
       "chunked", "preempt")  # fmt: skip
RANK = {"ok": 3, "diverged": 3, "error": 1, "rejected": 0}


def variant(path: str) -> str:
    return "upstream" if "upstream" in path else "fork"


def main() -> None:
    rows: dict[tuple, dict[str, tuple[dict, str]]] = {}
    files = sorted(glob.glob("v1-matrix-*.json")) + sorted(glob.glob("isolated/*.json"))
    for f in files:
        if "0001-only" in f:
            continue
        for c in json.load(open(f)):
            key = tuple(c[k] if k != "async" else c["async"] for k in KEY)
            v = variant(f)
            old = rows.setdefault(key, {}).get(v)
            if old is None or RANK.get(c["status"], 0) > RANK.get(old[0]["status"], 0):
                rows[key][v] = (c, f)

    def cell(x):
        if x is None:
            return "–"
        c, f = x
        s = c["status"]
        if s in ("ok", "diverged"):
            txt = f"**{s}**" if s == "diverged" else s
            return (f"{txt}: {c['divergences']} div, {c['ties']} ties / "
                    f"{c['tokens']} tok <sub>{f}</sub>")  # fmt: skip
        return f"{s} <sub>{f}</sub>"

    head = ("| " + " | ".join(KEY) + " | fork (p4) | upstream v0.26.0 |\n|"
            + "---|" * (len(KEY) + 2))  # fmt: skip
    lines = [head]
    for key, v in rows.items():
        lines.append("| " + " | ".join(map(str, key)) + f" | {cell(v.get('fork'))}"
                     f" | {cell(v.get('upstream'))} |")  # fmt: skip
    with open("SUMMARY.md", "w") as fh:
        fh.write("# V1-runner matrix: fork vs upstream v0.26.0 (H100, bf16, 2026-11-21)\n\n")
        fh.write("See README.md in this folder for how to read it.\n\n")
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
