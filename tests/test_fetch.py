# SPDX-License-Identifier: Apache-2.0
"""Fetching the pinned upstream files through a (local) package index."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from hsfork.common import Pin, PinnedFile, ToolError
from hsfork.fetch import fetch_file, find_links

PAYLOAD = b"pretend this is vllm-0.26.0.tar.gz\n" * 100
GOOD = hashlib.sha256(PAYLOAD).hexdigest()
BAD = "0" * 64


def _index(root: Path, listed_sha: str | None, *, json_api: bool = False) -> str:
    """A PEP 503 (or 691) simple index under ``root`` holding one file."""
    files = root / "files"
    files.mkdir(parents=True)
    (files / "vllm-0.26.0.tar.gz").write_bytes(PAYLOAD)
    page = root / "simple" / "vllm"
    page.mkdir(parents=True)
    frag = f"#sha256={listed_sha}" if listed_sha else ""
    (page / "index.html").write_text(
        "<!DOCTYPE html><html><body>\n"
        f'<a href="../../files/vllm-0.26.0.tar.gz{frag}">vllm-0.26.0.tar.gz</a>\n'
        '<a href="../../files/other.whl">vllm-0.25.0-py3-none-any.whl</a>\n'
        "</body></html>\n"
    )
    return (root / "simple").as_uri()


def _pin(sha: str, filename: str = "vllm-0.26.0.tar.gz") -> tuple[Pin, PinnedFile]:
    f = PinnedFile("sdist", filename, sha)
    return Pin("vllm", "0.26.0", "v0.26.0", "13.0", (f,)), f


def test_index_links_parse_hash_fragments(tmp_path):
    url = _index(tmp_path, GOOD)
    links = find_links(url, "vllm")
    assert links["vllm-0.26.0.tar.gz"][1] == GOOD
    assert links["vllm-0.26.0.tar.gz"][0].endswith("/files/vllm-0.26.0.tar.gz")
    assert links["vllm-0.25.0-py3-none-any.whl"][1] is None


def test_fetch_verifies_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HSFORK_INDEX_URL", _index(tmp_path / "idx", GOOD))
    pin, f = _pin(GOOD)
    cache = tmp_path / "cache"
    path = fetch_file(pin, f, cache)
    assert path.read_bytes() == PAYLOAD
    # cached: no index needed any more
    monkeypatch.setenv("HSFORK_INDEX_URL", "http://127.0.0.1:9/simple")
    assert fetch_file(pin, f, cache) == path


def test_hash_mismatch_listed_by_index(tmp_path, monkeypatch):
    monkeypatch.setenv("HSFORK_INDEX_URL", _index(tmp_path / "idx", GOOD))
    pin, f = _pin(BAD)
    cache = tmp_path / "cache"
    with pytest.raises(ToolError) as err:
        fetch_file(pin, f, cache)
    assert "vllm-0.26.0.tar.gz" in str(err.value) and BAD in str(err.value)
    assert list(cache.iterdir()) == []


def test_hash_mismatch_of_downloaded_bytes(tmp_path, monkeypatch):
    # the index lists no hash: the download itself must be checked
    monkeypatch.setenv("HSFORK_INDEX_URL", _index(tmp_path / "idx", None))
    pin, f = _pin(BAD)
    cache = tmp_path / "cache"
    with pytest.raises(ToolError, match=f"vllm-0.26.0.tar.gz: expected {BAD}"):
        fetch_file(pin, f, cache)
    assert list(cache.iterdir()) == []  # no partial file left behind


def test_corrupt_cache_is_refetched(tmp_path, monkeypatch):
    monkeypatch.setenv("HSFORK_INDEX_URL", _index(tmp_path / "idx", GOOD))
    pin, f = _pin(GOOD)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f.filename).write_bytes(b"truncated")
    assert fetch_file(pin, f, cache).read_bytes() == PAYLOAD


def test_missing_file_names_file_and_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("HSFORK_INDEX_URL", _index(tmp_path / "idx", GOOD))
    pin, f = _pin(GOOD, filename="vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    with pytest.raises(ToolError) as err:
        fetch_file(pin, f, tmp_path / "cache")
    msg = str(err.value)
    assert "cannot fetch vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl" in msg
    assert GOOD in msg and "no file" in msg


def test_no_network_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HSFORK_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("HSFORK_FETCH_TIMEOUT", "5")
    pin, f = _pin(GOOD)
    with pytest.raises(ToolError) as err:
        fetch_file(pin, f, tmp_path / "cache")
    msg = str(err.value)
    assert "cannot fetch vllm-0.26.0.tar.gz" in msg and GOOD in msg
    assert "127.0.0.1:9" in msg
    assert list((tmp_path / "cache").iterdir()) == []


def test_json_simple_api(tmp_path, monkeypatch):
    """PEP 691 JSON answers are read too (served through a stub opener)."""
    body = json.dumps(
        {
            "files": [
                {
                    "filename": "vllm-0.26.0.tar.gz",
                    "url": "/f/vllm.tgz",
                    "hashes": {"sha256": GOOD},
                }
            ]
        }
    ).encode()

    class Resp:
        headers = {"content-type": "application/vnd.pypi.simple.v1+json"}

        def read(self):
            return body

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    import hsfork.fetch as fetch

    monkeypatch.setattr(fetch, "_open", lambda url, accept=None: Resp())
    links = fetch.find_links("https://index.invalid/simple", "vllm")
    assert links == {"vllm-0.26.0.tar.gz": ("https://index.invalid/f/vllm.tgz", GOOD)}
