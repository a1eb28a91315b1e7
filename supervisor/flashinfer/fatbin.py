"""What a compiled JIT module holds: ELF integrity and the CUDA targets in its fatbin.

Pure: bytes in, facts out. No CUDA tool is needed (this machine has no
``cuobjdump``), so the fatbin container is read directly. Its layout, as
written by nvcc 12.x and 13.x into the ``.nv_fatbin`` section::

    container: u32 magic 0xBA55ED50, u16 version, u16 header size, u64 body size
    entry:     u16 kind (1 PTX, 2 ELF/SASS), u16 version, u32 header size,
               u64 payload size, ..., u32 sm number at byte 28,
               u64 flags at byte 40 (0x100000 'a' arch-specific, 0x200000 'f' family)

The flag bits were read off binaries built here for sm_120, sm_120a, sm_120f,
sm_90a and compute_90 (see tests/unit/flashinfer/test_fatbin.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

FATBIN_MAGIC = 0xBA55ED50
_FLAG_ARCH_SPECIFIC = 0x100000
_FLAG_FAMILY = 0x200000
_ELF_MAGIC = b"\x7fELF"
_SHT_NOBITS = 8


class ElfError(ValueError):
    """The file is not a complete 64-bit little-endian ELF shared object."""


@dataclass(frozen=True)
class CudaTarget:
    """One fatbin entry: SASS for ``sm_NNN[a|f]`` or PTX for ``compute_NNN[a|f]``."""

    kind: Literal["sass", "ptx"]
    sm: int
    variant: Literal["", "a", "f"]

    @property
    def name(self) -> str:
        prefix = "sm" if self.kind == "sass" else "compute"
        return f"{prefix}_{self.sm}{self.variant}"

    def runs_on(self, major: int, minor: int) -> bool:
        """Whether a device of compute capability ``major.minor`` can run this entry.

        SASS runs on the same major with an equal or newer minor; ``a`` code
        only on exactly its capability; ``f`` code on its family (same major).
        Plain PTX is JIT-compiled forward by the driver to any newer device.
        """
        own_major, own_minor = divmod(self.sm, 10)
        if self.variant == "a":
            return (own_major, own_minor) == (major, minor)
        if self.variant == "f" or self.kind == "sass":
            return own_major == major and own_minor <= minor
        return self.sm <= major * 10 + minor


def parse_arch(arch: str) -> tuple[int, int]:
    """``"12.0"`` -> ``(12, 0)``. Raises ValueError for anything else."""
    major_text, dot, minor_text = arch.partition(".")
    if not dot or not major_text.isdigit() or not minor_text.isdigit() or len(minor_text) != 1:
        raise ValueError(f"not a compute capability like '12.0': {arch!r}")
    return int(major_text), int(minor_text)


def _sections(data: bytes) -> dict[str, tuple[int, int, int]]:
    """Section name -> (offset, size, type), checking every bound against the file."""
    if len(data) < 64 or data[:4] != _ELF_MAGIC:
        raise ElfError("no ELF header")
    if data[4] != 2 or data[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF")
    (e_type,) = struct.unpack_from("<H", data, 16)
    if e_type != 3:
        raise ElfError(f"ELF type {e_type} is not a shared object")
    (phoff, shoff) = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", data, 0x36)
    size = len(data)
    if phoff + phentsize * phnum > size:
        raise ElfError(f"program headers end past the file ({size} bytes): truncated")
    if shnum == 0 or shoff + shentsize * shnum > size:
        raise ElfError(f"section headers end past the file ({size} bytes): truncated")
    for index in range(phnum):
        (p_offset,) = struct.unpack_from("<Q", data, phoff + index * phentsize + 8)
        (p_filesz,) = struct.unpack_from("<Q", data, phoff + index * phentsize + 32)
        if p_offset + p_filesz > size:
            raise ElfError(f"segment {index} ends past the file: truncated")
    raw: list[tuple[int, int, int, int]] = []
    for index in range(shnum):
        base = shoff + index * shentsize
        name, sh_type = struct.unpack_from("<II", data, base)
        offset, sh_size = struct.unpack_from("<QQ", data, base + 24)
        if sh_type != _SHT_NOBITS and offset + sh_size > size:
            raise ElfError(f"section {index} ends past the file: truncated")
        raw.append((name, sh_type, offset, sh_size))
    if shstrndx >= len(raw):
        raise ElfError("no section name table")
    strtab = raw[shstrndx][2]
    sections: dict[str, tuple[int, int, int]] = {}
    for name, sh_type, offset, sh_size in raw:
        end = data.find(b"\0", strtab + name)
        label = data[strtab + name : end].decode("ascii", "replace")
        sections[label] = (offset, sh_size, sh_type)
    return sections


def check_elf(data: bytes) -> None:
    """Raise ElfError unless ``data`` is a complete ELF shared object."""
    _sections(data)


_DT_NEEDED = 1


def needed_libraries(data: bytes) -> list[str]:
    """The shared libraries the object asks the loader for (``DT_NEEDED``), in order.

    Read from ``.dynamic`` and its string table ``.dynstr``; raises ElfError for an
    incomplete ELF.
    """
    sections = _sections(data)
    if ".dynamic" not in sections or ".dynstr" not in sections:
        return []
    offset, size, _ = sections[".dynamic"]
    strings, strings_size, _ = sections[".dynstr"]
    names: list[str] = []
    for entry in range(offset, offset + size - 15, 16):
        tag, value = struct.unpack_from("<qQ", data, entry)
        if tag == 0:
            break
        if tag == _DT_NEEDED and value < strings_size:
            end = data.find(b"\0", strings + value, strings + strings_size)
            names.append(data[strings + value : end].decode("ascii", "replace"))
    return names


def cudart_major(data: bytes) -> int | None:
    """The CUDA runtime major the object links (``libcudart.so.13`` -> 13), if any."""
    for name in needed_libraries(data):
        prefix = "libcudart.so."
        if name.startswith(prefix) and name[len(prefix) :].split(".")[0].isdigit():
            return int(name[len(prefix) :].split(".")[0])
    return None


def cuda_targets(data: bytes) -> list[CudaTarget]:
    """Every CUDA target embedded in the shared object, in file order.

    Raises ElfError for an incomplete ELF or a malformed fatbin.
    """
    sections = _sections(data)
    if ".nv_fatbin" not in sections:
        return []
    offset, size, _ = sections[".nv_fatbin"]
    end = offset + size
    targets: list[CudaTarget] = []
    position = offset
    while position + 16 <= end:
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", data, position)
        if magic != FATBIN_MAGIC:
            # Containers are 8-byte aligned; zero padding may sit between them.
            if magic == 0:
                position += 8
                continue
            raise ElfError(f"bad fatbin magic {magic:#x} at {position}")
        entry = position + header_size
        body_end = entry + body_size
        if body_end > end:
            raise ElfError("fatbin container ends past its section: truncated")
        while entry + 48 <= body_end:
            kind, _ev, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            (sm,) = struct.unpack_from("<I", data, entry + 28)
            (flags,) = struct.unpack_from("<Q", data, entry + 40)
            if kind in (1, 2):
                variant: Literal["", "a", "f"] = ""
                if flags & _FLAG_FAMILY:
                    variant = "f"
                elif flags & _FLAG_ARCH_SPECIFIC:
                    variant = "a"
                targets.append(CudaTarget("ptx" if kind == 1 else "sass", sm, variant))
            if entry_header == 0:
                raise ElfError("fatbin entry with an empty header")
            entry += entry_header + payload
        position = body_end
    return targets
