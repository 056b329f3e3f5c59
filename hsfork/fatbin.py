"""Drop the GPU code that one GPU architecture cannot run from CUDA ELF files.

A CUDA shared library carries its device code in the ``.nv_fatbin`` section:
a run of fatbin blobs (magic ``0xBA55ED50``), one per translation unit, each a
list of entries, one per target: machine code (SASS, an ELF "cubin") built for
one ``sm_XY``, or PTX for one ``compute_XY``. When a module is loaded the
driver picks, for each blob, the entry that fits the device: a cubin of the
device's own major architecture (SASS does not run across majors: sm_80 code
does not run on sm_90), else PTX of an architecture no newer than the device,
which it compiles. Every other entry is never read on that device.

``prune`` keeps the cubins of ``keep_sm`` (for 90: sm_90 and sm_90a, both
marked 90) and every PTX that device could compile (compute_XY <= keep_sm) and
overwrites the payload of every other entry with zeros, in place: the file
keeps its size and layout (no offset or symbol moves, no relinking), only its
unused device code turns into runs of zeros that xz packs to almost nothing.
The entry headers stay, so a device of another architecture would find its
entry and fail to load it: a pruned file is only for ``keep_sm`` devices.

NVIDIA documents no stable layout for these headers; the reader below only
uses the fields that every known producer writes (kind, header size, payload
size, architecture), checks each blob's bounds, and leaves a file whose
section it cannot walk untouched. On the GPU host, loading the libraries and
running a kernel of each (``stage_torch`` and ``install_bundle.sh --check``)
is the check that nothing it needs was dropped.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1
KIND_CUBIN = 2
_BLOB = struct.Struct("<IHHQ")  # magic, version, header size, size of entries
_ENTRY = struct.Struct("<HHIQ")  # kind, version, header size, padded payload
_ARCH_AT = 28  # u32 within the entry header


@dataclass
class PruneStats:
    blobs: int = 0
    kept: dict[str, int] = field(default_factory=dict)  # "sm_90" -> bytes
    dropped: dict[str, int] = field(default_factory=dict)
    skipped: str = ""  # why nothing was done, if so

    @property
    def dropped_bytes(self) -> int:
        return sum(self.dropped.values())

    @property
    def kept_bytes(self) -> int:
        return sum(self.kept.values())


def _sections(data: bytes | bytearray) -> dict[str, tuple[int, int]]:
    """name -> (offset, size) of an ELF64 little-endian file's sections."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return {}
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if not shoff or shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        return {}
    raw = []
    for i in range(shnum):
        name, _typ, _flags, _addr, off, size = struct.unpack_from(
            "<IIQQQQ", data, shoff + i * shentsize
        )
        raw.append((name, off, size))
    stroff = raw[shstrndx][1]
    out = {}
    for name, off, size in raw:
        start = stroff + name
        end = data.find(b"\0", start)
        out[bytes(data[start:end]).decode(errors="replace")] = (off, size)
    return out


def _label(kind: int, arch: int) -> str:
    return f"{'sm' if kind == KIND_CUBIN else 'compute'}_{arch}"


def _keeps(kind: int, arch: int, keep_sm: int) -> bool:
    if kind == KIND_CUBIN:
        return arch // 10 == keep_sm // 10 and arch <= keep_sm
    if kind == KIND_PTX:
        return arch <= keep_sm
    return True  # unknown kinds stay


def prune(data: bytearray, keep_sm: int = 90, dry_run: bool = False) -> PruneStats:
    """Zero in ``data`` (an ELF file's bytes) every fatbin entry a
    ``sm_<keep_sm>`` device never loads; see the module docstring."""
    stats = PruneStats()
    sec = _sections(data).get(".nv_fatbin")
    if sec is None:
        stats.skipped = "no .nv_fatbin section"
        return stats
    start, size = sec
    end = start + size
    if end > len(data):
        stats.skipped = ".nv_fatbin runs past the end of the file"
        return stats
    zero: list[tuple[int, int]] = []
    pos = start
    while pos + _BLOB.size <= end:
        magic, _ver, hsize, fsize = _BLOB.unpack_from(data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # blobs are 8-byte aligned, padding between them
            continue
        blob_end = pos + hsize + fsize
        if hsize < _BLOB.size or blob_end > end:
            stats.skipped = f"fatbin blob at {pos:#x} out of bounds"
            return stats
        stats.blobs += 1
        e = pos + hsize
        while e < blob_end:
            if e + _ARCH_AT + 4 > blob_end:
                stats.skipped = f"fatbin entry at {e:#x} out of bounds"
                return stats
            kind, _ev, ehsize, padded = _ENTRY.unpack_from(data, e)
            arch = struct.unpack_from("<I", data, e + _ARCH_AT)[0]
            payload = e + ehsize
            if ehsize < _ARCH_AT + 4 or payload + padded > blob_end:
                stats.skipped = f"fatbin entry at {e:#x} out of bounds"
                return stats
            book = stats.kept if _keeps(kind, arch, keep_sm) else stats.dropped
            label = _label(kind, arch)
            book[label] = book.get(label, 0) + padded
            if book is stats.dropped:
                zero.append((payload, padded))
            e = payload + padded
        pos = blob_end
    if not dry_run:
        for off, n in zero:
            data[off : off + n] = bytes(n)
    return stats


def keeps_anything_for(stats: PruneStats, keep_sm: int) -> bool:
    """Whether a pruned file still holds code a ``keep_sm`` device can run
    (false for a library built only for other architectures)."""
    return stats.kept_bytes > 0 or not stats.dropped
