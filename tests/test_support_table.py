# SPDX-License-Identifier: Apache-2.0
"""The README's support table is generated (``python -m harness
support-table``): the generator on a tiny synthetic report folder, and the
README's marked region against the report folder its marker names, so that
README and evidence cannot drift. No vLLM import."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from harness import support_table as st

REPO = Path(__file__).resolve().parent.parent

REFUSED = (
    "pydantic_core._pydantic_core.ValidationError: 1 validation error for "
    "VllmConfig\n  Value error, Currently, async scheduling is only supported "
    "with EAGLE/MTP kind of speculative decoding [type=value_error, "
    "input_value=ArgsKwargs((), {'model_co... 'x': 0}), input_type=ArgsKwargs]"
)


def cell(model, drafter, status, runner="v1", cache_mode="none", batch=8, **kw):
    c = {"model": model, "runner": runner, "cache_mode": cache_mode,
         "drafter": drafter, "k": 4, "batch": batch, "graphs": "eager",
         "async": False, "chunked": False, "preempt": False,
         "kv_cache_dtype": "auto", "status": status, "tokens": 100,
         "divergences": 3 if status == "diverged" else 0, "ties": 0}  # fmt: skip
    c.update(kw)
    return c


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "v9.9.9" / "full-matrix-h100-2030-01-02"
    d.mkdir(parents=True)
    fork = [
        cell("qwen3_5", "ngram", "ok", batch=1),
        cell("qwen3_5", "ngram", "ok", batch=8),
        cell("qwen3_5", "ngram", "ok", cache_mode="align"),
        cell("qwen3_5", "scripted:random", "rejected", error=REFUSED),
        # the same reason with other trailing text: one footnote
        cell(
            "qwen3_5",
            "scripted:heterogeneous",
            "rejected",
            error=REFUSED.replace("'x': 0", "'y': 1"),
        ),  # fmt: skip
        cell("qwen3_5", "scripted:all_zero", "ok", runner="mrv2"),
        cell("nemotron_h", "mtp", "diverged", runner="mrv2", cache_mode="align"),
        cell(
            "nemotron_h",
            "mtp",
            "error",
            error="Traceback\nRuntimeError: boom at step 3. More text {'a': 1}",
        ),  # fmt: skip
        cell("mystery", "suffix", "ok", kv_cache_dtype="fp8"),
    ]
    (d / "a-fork.json").write_text(json.dumps(fork))
    # a cell two slices share counts once
    (d / "b-fork.json").write_text(json.dumps(fork[:1]))
    upstream = [
        cell("qwen3_5", "ngram", "diverged"),
        cell("mystery", "suffix", "error"),
    ]
    (d / "a-upstream.json").write_text(json.dumps(upstream))
    return d


def parse(md: str) -> dict[tuple[str, str], str]:
    """(target, drafter column) -> entry of the generated table."""
    lines = [x for x in md.splitlines() if x.startswith("| ")]
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    out = {}
    for row in lines[1:]:
        cols = [x.strip() for x in row.strip("|").split("|")]
        for h, v in zip(head[1:], cols[1:], strict=True):
            out[cols[0], h] = v
    return out


def test_synthetic_folder(folder: Path):
    md = st.table(folder, base=folder.parent)
    t = parse(md)
    q, n, x = (
        "Qwen3.5 (GDN), random weights",
        "NemotronH (Mamba2)",
        "mystery, incl. KV cache fp8",
    )
    columns = ("n-gram", "MTP", "scripted drafts (test drafter)", "suffix decoding")
    assert set(t) == {(m, d) for m in (q, n, x) for d in columns}
    assert t[q, "n-gram"] == "V1: none 2 identical; align 1 identical<br>MRV2: not run"
    assert t[q, "scripted drafts (test drafter)"] == (
        "V1: none 2 refused¹; align not run<br>MRV2: none 1 identical; align not run"
    )
    assert t[n, "MTP"] == (
        "V1: none 1 errored²; align not run<br>MRV2: none not run; align 1 **diverged**"
    )
    assert t[n, "n-gram"] == "not run"
    assert t[x, "suffix decoding"].startswith("V1: none 1 identical")
    # footnotes: one per distinct reason, in order of first use
    notes = [x for x in md.splitlines() if x.startswith("- ")]
    assert notes == [
        "- ¹ Currently, async scheduling is only supported with EAGLE/MTP kind "
        "of speculative decoding.",
        "- ² boom at step 3.",
    ]
    # caption and upstream line
    assert "(line v9.9.9, H100, 2030-01-02)" in md
    # the cell two slices share counts once
    assert "the fork's 9 cells (5 identical, 1 diverged, 1 errored, 2 refused)" in md
    assert (
        "Upstream v9.9.9 in the same matrix (2 cells): 0 identical, 1 diverged, "
        "1 errored, 0 refused; errored per target: mystery 1 of 1.\n"
    ) in md


def test_tensor_parallel_cells_get_a_column_of_their_own(tmp_path: Path):
    """Cells at tensor_parallel_size > 1 leave the drafter columns for a TP
    column; one that diverged against the eager TP=1 reference (no
    ``reference_tp`` of its own TP) counts as judged against TP=1, not as
    diverged, with a footnote saying why; one judged against its own TP
    stays diverged."""
    d = tmp_path / "v9.9.9" / "full-matrix-h100-2030-01-02"
    d.mkdir(parents=True)
    tp = {"engine": {"tensor_parallel_size": 2}}
    fork = [
        cell("nemotron_h", "ngram", "ok"),
        cell("nemotron_h", "ngram", "diverged", graphs="piecewise", **tp),
        cell("nemotron_h", "mtp", "diverged", runner="default", reference_tp=2, **tp),
        cell("nemotron_h", "none", "diverged", runner="default", reference_tp=1, **tp),
    ]
    (d / "tp2-fork.json").write_text(json.dumps(fork))
    md = st.table(d, base=d.parent)
    t = parse(md)
    n = "NemotronH (Mamba2)"
    assert set(h for _, h in t) == {"n-gram", "TP=2 (tensor parallel), any drafter"}
    assert t[n, "n-gram"] == "V1: none 1 identical<br>default: not run"
    assert t[n, "TP=2 (tensor parallel), any drafter"] == (
        "*n-gram*: V1: none 1 judged against TP=1¹<br>default: not run"
        "<br>*MTP*: V1: not run<br>default: none 1 **diverged**"
        "<br>*no drafter (control)*: V1: not run<br>default: none 1 judged "
        "against TP=1¹"
    )
    notes = [x for x in md.splitlines() if x.startswith("- ")]
    assert notes == [f"- ¹ {st.TP1_REFERENCE}."]
    assert "the fork's 4 cells (1 identical, 1 diverged, 2 judged against TP=1, " in md
    assert "tensor-parallel cells in the TP column, by drafter" in md


def test_reason_shortening():
    assert st.reason({"error": REFUSED}) == (
        "Currently, async scheduling is only supported with EAGLE/MTP kind of "
        "speculative decoding"
    )
    assert st.reason({"error": "ValueError: Following weights were not "
                      "initialized from checkpoint: {'a', 'b'}"}) == (
        "Following weights were not initialized from checkpoint"
    )  # fmt: skip
    assert st.reason({"error": "AssertionError"}) == "AssertionError"
    assert st.reason({}) == "no reason given"


def test_readme_region_rewritten_alone(folder: Path, tmp_path: Path):
    readme = tmp_path / "README.md"
    marker = f"<!-- support-table BEGIN line=v9.9.9 dir={folder} -->\n"
    readme.write_text(f"before\n\n{marker}stale\n{st.END}\n\nafter\n")
    assert st.main([str(folder), "--readme", str(readme), "--check"]) == 1
    assert st.main([str(folder), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("before\n\n<!-- support-table BEGIN line=v9.9.9 dir=")
    assert text.endswith(f"{st.END}\n\nafter\n")
    assert st.table(folder, "v9.9.9", tmp_path) in text
    assert st.main(["--line", "v9.9.9", "--readme", str(readme), "--check"]) == 0


def test_readme_matches_the_reports():
    """README.md's generated region is the generator's output for the report
    folder its marker names; if this fails, run
    ``python -m harness support-table --readme README.md``."""
    text = (REPO / "README.md").read_text()
    found = st.regions(text)
    assert found, "README.md has no support-table region"
    for m, end in found:
        line = m.group(1)
        folder, *also = (REPO / x for x in st.marker_dirs(m))
        for d in (folder, *also):
            assert d.is_dir(), f"the marker names a missing folder: {d}"
        body = text[m.end() : end]
        assert body == st.table(folder, line, REPO, also), (
            f"README.md's support table of {line} is stale: run python -m "
            f"harness support-table --line {line} --readme README.md"
        )


def test_readme_region_is_the_newest_matrix():
    text = (REPO / "README.md").read_text()
    for m, _ in st.regions(text):
        first, *also = st.marker_dirs(m)
        assert (REPO / first).resolve() == st.newest(m.group(1)).resolve()
        assert re.search(r"/full-matrix-[^/]*\d{4}-\d{2}-\d{2}$", first)
        # the folders after it hold slices run later: none is a whole matrix
        assert not any("/full-matrix-" in d for d in also)


def test_python_m_harness_support_table_check(tmp_path: Path, capsys):
    """``--check`` without ``--line`` checks every line's region: a stale
    v0.33.0 region failed it only under ``--line v0.33.0`` before."""
    from harness.__main__ import main

    readme = REPO / "README.md"
    assert main(["support-table", "--readme", str(readme), "--check"]) == 0
    text = readme.read_text()
    region = text.index("<!-- support-table BEGIN line=v0.33.0")
    at = text.index("| target |", region)
    stale = tmp_path / "README.md"
    stale.write_text(text[:at] + "| target | stale |" + text[at + 10 :])
    assert main(["support-table", "--readme", str(stale), "--check"]) == 1
    assert "support table of v0.33.0 is stale" in capsys.readouterr().err


def test_unstarted_counts_only_slices_the_matrix_ran(tmp_path: Path):
    """Cells of a slice with a fork report but no result are unstarted; a
    slice with no report at all (added to the matrix after the run) is not
    counted."""
    from harness.equivalence import slice_cells
    from harness.full_matrix import collect
    from harness.support_table import _unstarted

    smoke = slice_cells("v1-smoke")
    done = {**smoke[0].key(), "status": "ok", "tokens": 1, "divergences": 0,
            "ties": 0}  # fmt: skip
    (tmp_path / "v1-smoke-fork.json").write_text(json.dumps([done]))
    got = collect(tmp_path)
    assert _unstarted(got, tmp_path) == (
        f", or one of the {len(smoke) - 1} cells a run left without a result "
        "(a call's deadline, or model files missing on the host)"
    )
    # one cell left: said so, not "one of the 1 cells"
    (tmp_path / "v1-smoke-fork.json").write_text(
        json.dumps([{**done, **c.key()} for c in smoke[:-1]])
    )
    assert _unstarted(collect(tmp_path), tmp_path).startswith(
        ", or the one cell a run left without a result"
    )


def test_not_run_lists_each_cell_left_without_a_result(tmp_path: Path, capsys):
    """``--not-run`` prints each fork cell a folder's slices hold and no
    report gives a result, with its slice: the cells a later folder ran
    drop out, the count matches the caption's."""
    from harness.equivalence import slice_cells
    from harness.support_table import main

    smoke = slice_cells("v1-smoke")

    def done(c):
        return {**c.key(), "status": "ok", "tokens": 1, "divergences": 0, "ties": 0}

    first = tmp_path / "v0.26.0" / "full-matrix-h100-2030-01-05"
    later = tmp_path / "v0.26.0" / "smoke-rerun-h100-2030-01-06"
    first.mkdir(parents=True)
    later.mkdir(parents=True)
    (first / "v1-smoke-fork.json").write_text(json.dumps([done(smoke[0])]))
    (later / "v1-smoke-fork.json").write_text(json.dumps([done(smoke[1])]))
    assert main(["--not-run", "--line", "v0.26.0", str(first), str(later)]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(rows) == len(smoke) - 2
    assert {r["slice"] for r in rows} == {"v1-smoke"}
    left = [{k: v for k, v in r.items() if k != "slice"} for r in rows]
    assert smoke[0].key() not in left and smoke[1].key() not in left
    assert smoke[2].key() in left

    # what it prints is what `harness.equivalence --cells` reruns
    from harness.equivalence import listed_cells

    owed = tmp_path / "owed.jsonl"
    owed.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [c.key() for c in listed_cells(smoke, owed)] == [c.key() for c in smoke[2:]]


def test_owed_adds_the_speculative_cells_judged_before_a_rule(tmp_path: Path, capsys):
    """``--owed``: the cells without a result, then the speculative cells
    whose verdict a later oracle rule would give otherwise, with "why":
    "stale": diverged by drift alone without the control floor, and TP
    cells judged against TP=1. Controls (drafter "none"), cells with the
    control floor and TP cells judged at their own TP are not owed."""
    import os
    from unittest import mock

    from harness import compat
    from harness.equivalence import slice_cells
    from harness.support_table import main

    def row(c, status, **kw):
        return {**c.key(), "status": status, "tokens": 10, "ties": 0,
                "divergences": 0, **kw}  # fmt: skip

    line = "v0.33.0"  # the cells' keys as that line's harness builds them
    with mock.patch.dict(os.environ, {compat.VERSION_ENV: line}):
        fp8, tp = slice_cells("fp8"), slice_cells("tp2-probe")
    mtp = next(c for c in fp8 if c.drafter == "mtp" and c.graphs != "eager")
    ngram = next(c for c in fp8 if c.drafter == "ngram")
    control = next(c for c in fp8 if c.drafter == "none")
    tp_ngram = next(c for c in tp if c.drafter == "ngram")
    tp_mtp = next(c for c in tp if c.drafter == "mtp")
    d = tmp_path / line / "slices-h100-2030-01-05"
    d.mkdir(parents=True)
    (d / "fp8-fork.json").write_text(json.dumps([
        row(mtp, "diverged"),  # drift only, before the control floor
        row(ngram, "diverged", drift_control_floor_why="x"),  # judged with it
        row(control, "diverged"),  # a control's drift is the target's
    ]))  # fmt: skip
    # a TP slice is not in the whole matrix: a later folder's
    later = tmp_path / line / "tp2-h100x2-2030-01-06"
    later.mkdir()
    (later / "tp2-probe-fork.json").write_text(json.dumps([
        row(tp_ngram, "diverged", divergences=5),  # against TP=1
        row(tp_mtp, "diverged", divergences=5, reference_tp=2),
    ]))  # fmt: skip
    assert main(["--owed", "--line", line, str(d), str(later)]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    stale = [(r["slice"], r["drafter"]) for r in rows if r.get("why") == "stale"]
    assert sorted(stale) == [("fp8", "mtp"), ("tp2-probe", "ngram")]
    # the rest are the slices' cells without a result
    assert all("why" not in r for r in rows if (r["slice"], r["drafter"]) not in stale)
    # --not-run alone leaves the stale ones out
    assert main(["--not-run", "--line", line, str(d), str(later)]) == 0
    assert "stale" not in capsys.readouterr().out


def test_later_folders_add_cells_and_override_the_same_cell(folder: Path):
    """A folder of slices run after the whole matrix adds its cells; a cell
    it ran again takes its result there; the caption names it; the README
    marker lists both folders and --check accepts the rewritten region."""
    later = folder.parent / "families-h200-2030-01-05"
    later.mkdir()
    (later / "README.md").write_text("later\n")
    # the matrix's diverged NemotronH MTP cell, run again: identical now
    again = cell("nemotron_h", "mtp", "ok", runner="mrv2", cache_mode="align")
    new = cell("zamba2", "ngram", "ok")
    (later / "families-fork-1-of-2.json").write_text(json.dumps([again, new]))
    md = st.table(folder, base=folder.parent, also=[later])
    t = parse(md)
    assert t["NemotronH (Mamba2)", "MTP"].endswith(
        "MRV2: none not run; align 1 identical"
    )
    assert t["Zamba2 (Mamba2)", "n-gram"].startswith("V1: none 1 identical")
    assert "the fork's 10 cells (7 identical, 0 diverged" in md
    assert "slices run after it in [`families-h200-2030-01-05`](" in md
    # the later folder's slice counts its cells that did not run as unstarted
    from harness.equivalence import slice_cells

    n = len(slice_cells("families"))  # the folder's two cells are not its own
    assert f"or one of the {n} cells a run left without a result" in md
    readme = folder.parent / "README.md"
    readme.write_text(f"<!-- support-table BEGIN line=v9.9.9 dir=x -->\n{st.END}\n")
    assert st.main([str(folder), str(later), "--readme", str(readme)]) == 0
    ((m, _),) = st.regions(readme.read_text())
    assert [Path(d).name for d in st.marker_dirs(m)] == [folder.name, later.name]
    assert st.main(["--line", "v9.9.9", "--readme", str(readme), "--check"]) == 0


def test_without_folders_the_marker_keeps_its_later_slices():
    """``--readme`` with no folder: the newest whole matrix first, then the
    later-slice folders the marker names (the README's region stays what
    the generator makes of them)."""
    text = (REPO / "README.md").read_text()
    for m, _ in st.regions(text):
        named = [REPO / d for d in st.marker_dirs(m)]
        got = st.default_dirs(text, m.group(1))
        assert [d.resolve() for d in got] == [d.resolve() for d in named]


def test_errored_cells_their_slice_no_longer_holds_are_left_out(folder: Path):
    """An errored cell of a slice redefined since it ran (its model or
    engine no longer in the slice) is dropped and counted in the caption; a
    diverged cell is never dropped, and an errored cell the slice still
    holds stays."""
    from harness.equivalence import slice_cells

    later = folder.parent / "flashinfer-h200-2030-01-06"
    later.mkdir()
    held = {**slice_cells("flashinfer")[0].key(), "status": "error",
            "error": "RuntimeError: still held", "tokens": 0, "divergences": 0,
            "ties": 0}  # fmt: skip
    gone = {**held, "engine": {"attention_backend": "NOT_IN_THE_SLICE"},
            "error": "RuntimeError: retired"}  # fmt: skip
    diverged = {**gone, "status": "diverged", "divergences": 2,
                "runner": "mrv2"}  # fmt: skip
    # a refusal of a cell the slice no longer holds (a harness pool the
    # engine refused, since resized) is left out too
    refused = {**gone, "status": "rejected", "runner": "default",
               "error": "ValueError: To serve one request: retired"}  # fmt: skip
    (later / "flashinfer-fork-1-of-2.json").write_text(
        json.dumps([held, gone, diverged, refused])
    )
    got, retired = st.gather(folder, [later])
    assert retired == 2
    statuses = sorted(c["status"] for c, f in got["fork"].values()
                      if f.startswith("flashinfer"))  # fmt: skip
    assert statuses == ["diverged", "error"]
    md = st.table(folder, base=folder.parent, also=[later])
    assert (
        "Left out: 2 errored or refused cells of slices redefined since they ran" in md
    )
    notes = [x for x in md.splitlines() if x.startswith("- ")]
    assert any("still held" in x for x in notes)
    assert not any("retired" in x for x in notes)


def test_slices_are_read_as_the_tables_line_builds_them(folder: Path, monkeypatch):
    """A slice can differ by line (the flashinfer slice's chunked align
    cells take a larger token budget on v0.26.0): an errored cell keyed as
    the other line builds it is left out of this line's table, whatever
    vLLM the generating process has."""
    from harness.equivalence import slice_cells

    monkeypatch.setenv("HSFORK_VLLM_VERSION", "0.33.0")
    old = next(c for c in slice_cells("flashinfer") if c.chunked and c.k == 64)
    later = folder.parent / "flashinfer-h200-2030-01-07"
    later.mkdir()
    row = {**old.key(), "status": "error", "error": "AssertionError: budget",
           "tokens": 0, "divergences": 0, "ties": 0}  # fmt: skip
    (later / "flashinfer-fork-1-of-2.json").write_text(json.dumps([row]))
    left_out = "Left out: 1 errored or refused cells of slices redefined since they ran"
    assert left_out in st.table(folder, "v0.26.0", folder.parent, [later])
    assert left_out not in st.table(folder, "v0.33.0", folder.parent, [later])
    assert os.environ["HSFORK_VLLM_VERSION"] == "0.33.0"  # restored


# what v0.33.0 says for method "medusa" (it has no Medusa), as a refused
# cell's error carries it
MEDUSA_REFUSED = (
    "pydantic_core._pydantic_core.ValidationError: 1 validation error for "
    "SpeculativeConfig\nmethod\n  Input should be 'ngram', 'draft_model', "
    "'eagle', 'eagle3', 'dflash', 'ngram_gpu' or 'dspark' "
    "[type=literal_error, input_value='medusa', input_type=str]\n"
    "    For further information visit https://errors.pydantic.dev/2.14/v/"
    "literal_error"
)


def test_medusa_and_dspark_columns(tmp_path: Path):
    """Medusa and DSpark cells get a column each, after DFlash's; a method
    the line lacks is refused with the field, the value and what the field
    takes as its footnote."""
    d = tmp_path / "v9.9.9" / "full-matrix-h100-2030-01-02"
    d.mkdir(parents=True)
    fork = [
        cell("qwen3_5", "dflash", "ok", runner="mrv2"),
        cell("qwen3_5", "medusa", "rejected", error=MEDUSA_REFUSED),
        cell("qwen3_5", "dspark", "ok", runner="mrv2", cache_mode="align"),
    ]
    (d / "a-fork.json").write_text(json.dumps(fork))
    md = st.table(d, base=d.parent)
    head = next(x for x in md.splitlines() if x.startswith("| target"))
    assert head == "| target | DFlash | DSpark | Medusa |"
    t = parse(md)
    q = "Qwen3.5 (GDN), random weights"
    assert t[q, "DSpark"] == "V1: not run<br>MRV2: none not run; align 1 identical"
    assert t[q, "Medusa"] == "V1: none 1 refused¹; align not run<br>MRV2: not run"
    notes = [x for x in md.splitlines() if x.startswith("- ")]
    assert notes == [
        "- ¹ method 'medusa': Input should be 'ngram', 'draft_model', 'eagle', "
        "'eagle3', 'dflash', 'ngram_gpu' or 'dspark'."
    ]


def test_a_cell_whose_margin_takes_in_most_positions_is_inconclusive(tmp_path):
    """A reported cell with more than a quarter of its positions inside the
    tie margin (written ok or diverged, before the rule existed) reads
    inconclusive, with a footnote saying why, and counts apart."""
    d = tmp_path / "v9.9.9" / "full-matrix-h100-2030-01-03"
    d.mkdir(parents=True)
    wide = {"ties": 426, "tokens": 768, "tie_margin": 7.75}
    fork = [
        cell("nemotron_h", "mtp", "ok"),
        cell("nemotron_h", "mtp", "diverged", cache_mode="align", **wide),
    ]
    (d / "a-fork.json").write_text(json.dumps(fork))
    md = st.table(d, base=d.parent)
    t = parse(md)
    assert t["NemotronH (Mamba2)", "MTP"] == (
        "V1: none 1 identical; align 1 inconclusive¹"
    )
    notes = [x for x in md.splitlines() if x.startswith("- ")]
    assert notes == [f"- ¹ {st.INCONCLUSIVE}."]
    assert "(1 identical, 0 diverged, 1 inconclusive, 0 errored, 0 refused)" in md


def test_a_cell_diverged_by_drift_alone_says_so(tmp_path):
    """A diverged cell where no token differs gets a footnote: a speculative
    one judged without its control floor says that the control decides; a
    drafter "none" control says its drift is not speculation's; one judged
    with its control floor (or whose control failed to run), or with
    flipped tokens, gets none."""
    d = tmp_path / "v9.9.9" / "full-matrix-h100-2030-01-04"
    d.mkdir(parents=True)
    fp = {"graphs": "full_and_piecewise", "divergences": 0}
    fork = [
        cell("qwen3_5", "mtp", "diverged", **fp),
        cell("qwen3_5", "mtp", "diverged", cache_mode="align", **fp,
             drift_control_floor_why="over the plain and context floors"),
        cell("qwen3_5", "none", "diverged", **fp),
        cell("qwen3_5", "ngram", "diverged"),
        cell("qwen3_5", "mtp", "diverged", runner="mrv2", **fp,
             drift_control_floor_error="RuntimeError: no engine"),
    ]  # fmt: skip
    (d / "a-fork.json").write_text(json.dumps(fork))
    md = st.table(d, base=d.parent)
    t = parse(md)
    q = "Qwen3.5 (GDN), random weights"
    assert t[q, "MTP"] == (
        "V1: none 1 **diverged**¹; align 1 **diverged**<br>"
        "MRV2: none 1 **diverged**; align not run"
    )
    no_mrv2 = "; align not run<br>MRV2: not run"
    # the control is counted apart from the diverged cells: no token
    # differs, and its drift is the target's under that engine
    assert t[q, "no drafter (control)"] == (
        "V1: none 1 target drift (no drafter)²" + no_mrv2
    )
    assert t[q, "n-gram"] == "V1: none 1 **diverged**" + no_mrv2
    notes = [x for x in md.splitlines() if x.startswith("- ")]
    assert notes == [f"- ¹ {st.DRIFT_ONLY}.", f"- ² {st.CONTROL_DRIFT}."]
    assert "(0 identical, 4 diverged, 1 target drift (no drafter), 0 errored" in md
    # a control that flipped tokens is a divergence like any other
    fork[2]["divergences"] = 3
    (d / "a-fork.json").write_text(json.dumps(fork))
    t = parse(st.table(d, base=d.parent))
    assert t[q, "no drafter (control)"] == "V1: none 1 **diverged**" + no_mrv2
