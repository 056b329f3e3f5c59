# SPDX-License-Identifier: Apache-2.0
"""Every relative link of the front pages resolves: README.md, docs/*.md and
reports/README.md link only to files and folders that exist in this checkout.
Web links and in-page anchors are not checked; links inside code (fenced
blocks, inline code) are not links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [REPO / "README.md", REPO / "reports" / "README.md", *(REPO / "docs").glob("*.md")]
)

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target "title") and ![alt](target); the text may hold brackets
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)")
# [label]: target
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)=["']([^"']+)["']""")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", re.I)


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link in markdown ``text``."""

    def blank(m: re.Match) -> str:  # keep line numbers
        return re.sub(r"[^\n]", " ", m.group(0))

    text = INLINE_CODE.sub(blank, FENCE.sub(blank, text))
    found = []
    for rx in (INLINE_LINK, REFERENCE, HTML_LINK):
        for m in rx.finditer(text):
            target = m.group(1).strip("<>")
            found.append((text.count("\n", 0, m.start()) + 1, target))
    return sorted(found)


def broken(page: Path) -> list[str]:
    out = []
    for line, target in links(page.read_text()):
        if not target or EXTERNAL.match(target):
            continue
        path = re.split(r"[#?]", target, maxsplit=1)[0]
        if not path:
            continue
        base = REPO if path.startswith("/") else page.parent
        if not (base / path.lstrip("/")).exists():
            out.append(f"{page.relative_to(REPO)}:{line}: {target}")
    return out


def test_the_pages_exist():
    names = {str(p.relative_to(REPO)) for p in PAGES}
    assert {"README.md", "reports/README.md", "docs/maintainers.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    bad = broken(page)
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_link_parser():
    text = (
        'see [a](docs/a.md#x) and ![p](img/p.png "t") and [b [c]](<b c.md>)\n'
        "`[not](a link)` [web](https://x.org) [anchor](#top)\n"
        "```\n[in](code.md)\n```\n"
        "[ref]: ../r.md\n"
        '<a href="h.md">h</a>\n'
    )
    assert links(text) == [
        (1, "b c.md"),
        (1, "docs/a.md#x"),
        (1, "img/p.png"),
        (2, "#top"),
        (2, "https://x.org"),
        (6, "../r.md"),
        (7, "h.md"),
    ]


def unindexed(reports: Path) -> list[str]:
    """The report folders (``<kind>/<line>/<folder>``) that neither
    ``reports/README.md`` nor their line's own index
    (``<kind>/<line>/README.md``) links to."""
    index = reports / "README.md"
    targets = {
        (index.parent / re.split(r"[#?]", t)[0]).resolve()
        for _, t in links(index.read_text())
        if not EXTERNAL.match(t)
    }
    out = []
    for d in sorted(reports.glob("*/v*/*/")):
        if not d.is_dir():
            continue
        sub = d.parent / "README.md"
        if sub.exists():
            targets |= {
                (sub.parent / re.split(r"[#?]", t)[0]).resolve()
                for _, t in links(sub.read_text())
                if not EXTERNAL.match(t)
            }
        here = {d.resolve(), (d / "README.md").resolve()}
        if not here & targets:
            out.append(str(d.relative_to(reports)))
    return out


def test_every_report_folder_is_indexed(tmp_path: Path):
    """A report folder nobody links to is a result nobody finds: every
    ``reports/<kind>/<line>/<folder>`` is linked from ``reports/README.md``
    or from its line's own index."""
    assert unindexed(REPO / "reports") == []
    # the check itself: a folder without a link is named
    (tmp_path / "equivalence" / "v9.9.9" / "lost-h100-2030-01-01").mkdir(parents=True)
    (tmp_path / "equivalence" / "v9.9.9" / "found-h100-2030-01-01").mkdir()
    (tmp_path / "README.md").write_text(
        "| [found](equivalence/v9.9.9/found-h100-2030-01-01/) | ... |\n"
    )
    assert unindexed(tmp_path) == ["equivalence/v9.9.9/lost-h100-2030-01-01"]
