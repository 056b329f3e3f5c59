"""Fetch the pinned upstream files through the configured package index.

The index is pip's: ``HSFORK_INDEX_URL``, else ``PIP_INDEX_URL``, else pip's
``index-url`` setting, else pip's built-in default. Its extra index URLs are
tried after it. Files are found through the simple repository API (PEP 503
HTML or PEP 691 JSON), downloaded next to their final place, verified against
the pinned sha256 and only then renamed into the cache.

Why not ``pip download``: for the sdist pip prepares metadata through the
package's build backend, whose build requirements (torch==2.11.0 with CUDA)
it installs first; that fails, or fetches gigabytes, on a CPU machine. The
wheel would work, but one lookup path for both keeps the errors uniform.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from .common import (
    Pin,
    PinnedFile,
    ToolError,
    cache_dir,
    info,
    load_pin,
    run,
    sha256_file,
)

_ANCHOR = re.compile(r"<a\s[^>]*?href=\"([^\"]+)\"[^>]*>([^<]+)</a>", re.I)
_TIMEOUT = float(os.environ.get("HSFORK_FETCH_TIMEOUT", "60"))


def _pip_config(key: str) -> str:
    proc = run(
        [sys.executable, "-m", "pip", "config", "get", key],
        check=False,
    )
    return proc.stdout.strip() if proc.returncode == 0 else ""


def index_urls() -> list[str]:
    """The index URLs to look in, in order."""
    primary = os.environ.get("HSFORK_INDEX_URL") or os.environ.get("PIP_INDEX_URL")
    extras: list[str] = []
    if not primary:
        for key in ("global.index-url", "install.index-url", "download.index-url"):
            if primary := _pip_config(key):
                break
    if not primary:
        from pip._internal.models.index import PyPI  # pip's own default

        primary = PyPI.simple_url
    if "HSFORK_INDEX_URL" not in os.environ:
        raw = os.environ.get("PIP_EXTRA_INDEX_URL") or _pip_config(
            "global.extra-index-url"
        )
        extras = raw.split()
    return [primary, *extras]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _open(url: str, accept: str | None = None):
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.request.url2pathname(parsed.path))
        if path.is_dir():
            path = path / "index.html"
        return open(path, "rb")
    headers = {"Accept": accept} if accept else {}
    return urllib.request.urlopen(
        urllib.request.Request(url, headers=headers), timeout=_TIMEOUT
    )


def find_links(index_url: str, project: str) -> dict[str, tuple[str, str | None]]:
    """filename -> (absolute url, sha256 reported by the index or None)."""
    page = index_url.rstrip("/") + f"/{_normalize(project)}/"
    accept = (
        "application/vnd.pypi.simple.v1+json, "
        "application/vnd.pypi.simple.v1+html;q=0.5, text/html;q=0.1"
    )
    with _open(page, accept) as resp:
        body = resp.read()
        ctype = getattr(resp, "headers", {}).get("content-type", "") or ""
    links: dict[str, tuple[str, str | None]] = {}
    if "json" in ctype:
        for f in json.loads(body)["files"]:
            url = urllib.parse.urljoin(page, f["url"])
            links[f["filename"]] = (
                url.split("#")[0],
                f.get("hashes", {}).get("sha256"),
            )
        return links
    for href, text in _ANCHOR.findall(body.decode("utf-8", "replace")):
        href = html.unescape(href)
        url, _, frag = urllib.parse.urljoin(page, href).partition("#")
        sha = frag.split("=", 1)[1] if frag.startswith("sha256=") else None
        links[html.unescape(text).strip()] = (url, sha)
    return links


def _download(url: str, dest: Path, want: PinnedFile) -> None:
    part = dest.with_name(f".{dest.name}.part")
    h = hashlib.sha256()
    try:
        with _open(url) as resp, open(part, "wb") as out:
            while block := resp.read(1 << 20):
                h.update(block)
                out.write(block)
        got = h.hexdigest()
        if got != want.sha256:
            raise ToolError(
                f"sha256 mismatch for {want.filename}: expected {want.sha256}, "
                f"got {got}; the download was discarded"
            )
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def fetch_file(pin: Pin, want: PinnedFile, dest_dir: Path | None = None) -> Path:
    """Return the cached, verified path of one pinned file, fetching if needed."""
    dest_dir = dest_dir or cache_dir()
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / want.filename
    if dest.exists():
        got = sha256_file(dest)
        if got == want.sha256:
            return dest
        info(f"cached {dest} has sha256 {got}, expected {want.sha256}: refetching")
        dest.unlink()

    errors: list[str] = []
    for index in index_urls():
        try:
            links = find_links(index, pin.name)
        except (OSError, urllib.error.URLError, ValueError) as e:
            errors.append(f"{index}: {e}")
            continue
        if want.filename not in links:
            errors.append(f"{index}: no file {want.filename} for {pin.name}")
            continue
        url, index_sha = links[want.filename]
        if index_sha and index_sha.lower() != want.sha256:
            raise ToolError(
                f"sha256 mismatch for {want.filename}: expected {want.sha256}, "
                f"the index {index} lists {index_sha}; nothing was downloaded"
            )
        info(f"fetching {want.filename}")
        try:
            _download(url, dest, want)
        except (OSError, urllib.error.URLError) as e:
            errors.append(f"{url}: {e}")
            continue
        return dest
    detail = "\n  ".join(errors)
    raise ToolError(
        f"cannot fetch {want.filename} (expected sha256 {want.sha256}):\n  {detail}"
    )


def fetch_all(pin: Pin | None = None) -> dict[str, Path]:
    pin = pin or load_pin()
    return {f.kind: fetch_file(pin, f) for f in pin.files}
