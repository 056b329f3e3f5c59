"""Data of the ``fastapply`` lm-eval task (``fastapply.yaml``).

``load_fastapply`` is the task's ``custom_dataset``: it reads
``fastapply.jsonl`` beside this file (found relative to this file, so
``--include_path`` works from any directory). Run this file as a script
from the repository root to regenerate the JSONL from the generator::

    python serving/lm_eval_task/utils.py [--n 64] [--seed 0]

Rows: ``prompt`` and ``answer`` as text for the fixture's word-level
tokenizer (``t<id>`` words, the answer without its end-of-text token),
their readable forms (``harness.fastapply.detok``) and token counts. The
set is ``harness.fastapply.make_eval_set(n, seed)``: the held-out examples
the fixture was evaluated on (seed 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "fastapply.jsonl"


def rows(n: int = 64, seed: int = 0) -> list[dict]:
    sys.path.insert(0, str(HERE.parent.parent))
    from harness import fastapply as fa
    from serving.make_model import prompt_text

    out = []
    for i, (p, ans) in enumerate(fa.make_eval_set(n, seed)):
        out.append(
            {
                "id": i,
                "prompt": prompt_text(p),
                "answer": prompt_text(ans[:-1]),
                "prompt_readable": fa.detok(p),
                "answer_readable": fa.detok(ans[:-1]),
                "prompt_tokens": len(p),
                "answer_tokens": len(ans),
            }
        )
    return out


def write(path: Path = DATA, n: int = 64, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed)))
    return path


def read(path: Path = DATA) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def load_fastapply(**kwargs):
    """The task's dataset: ``{"test": rows}``. Built from an Arrow table
    with a fixed fingerprint (the JSONL's sha256): ``Dataset.from_list``
    fingerprints by pickling with dill, which fails with some pyarrow/dill
    pairs (seen here: pyarrow 26, dill 0.4.1, ``MonthDayNano``)."""
    import hashlib

    import datasets
    import pyarrow as pa

    digest = hashlib.sha256(DATA.read_bytes()).hexdigest()[:16]
    table = pa.Table.from_pylist(read())
    test = datasets.Dataset(table, split="test", fingerprint=f"fastapply-{digest}")
    return datasets.DatasetDict({"test": test})


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write(DATA, a.n, a.seed))
