"""A checkpoint's file as monadl reads it (`monadl.checkpoint`): the manifest
in its header and the digests that tell a damaged file (`digest`,
`text_digest`), one opening for the manifest and the arrays a load uses
(`opened`, which reads those alone, each into an array of its own), and,
where the file cannot be read, why, from its own header's numbers
(`unreadable`: cut short, or with bytes after its end).

Why not safetensors' own reader: it copies an array's bytes out of its
memory map into a buffer and gives a view of that, so a load that hands
the array to a weight (which must own its data, for steps written in place)
copied it again, and a load held every array of the file twice before it
changed anything. Here each array the load uses is read straight into an
array that owns its memory, and the others (the optimizer state that
``optimizer_state=False`` leaves, the weights a ``strict=False`` load passes
over) are not read at all. Files are written by safetensors.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from io import FileIO
from typing import Any, Final, final

import numpy as np

from monadl.errors import CheckpointError

__all__ = [
    "FORMAT",
    "MANIFEST_DIGEST_KEY",
    "MANIFEST_KEY",
    "VERSION",
    "Opened",
    "digest",
    "opened",
    "text_digest",
    "unreadable",
]

MANIFEST_KEY: Final = "monadl"
MANIFEST_DIGEST_KEY: Final = "monadl.digest"  # (beside the manifest, not in it: it covers the manifest's exact text)
FORMAT: Final = "monadl.checkpoint"
VERSION: Final = 1


def digest(array: Any) -> str | None:
    """A stored array's bytes, hashed (BLAKE2b, 16 bytes, with its dtype and shape); None for no array."""
    if array is None:
        return None
    hashed = hashlib.blake2b(f"{array.dtype.str}{array.shape}".encode(), digest_size=16)
    hashed.update(_bytes(np.ascontiguousarray(array)))  # (its memory, not a copy: a table's digest cost a table)
    return hashed.hexdigest()


def _bytes(array: np.ndarray[Any, Any]) -> memoryview:
    """A C-ordered array's memory as bytes, a view (``tobytes`` copies)."""
    return array.reshape(-1).view(np.uint8).data


def text_digest(text: str) -> str:
    """The manifest's text, hashed (BLAKE2b, 16 bytes): its names, shapes,
    the optimizer states' numbers (Adam's step counts) and the metadata."""
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


_MAX_HEADER: Final = 100_000_000  # (safetensors' own limit: a longer one is no header)


def unreadable(path: str, error: object) -> str:
    """Why safetensors cannot read ``path``: cut short (a full disk, a copy
    interrupted), or with bytes after its end, as its own header's numbers
    (its length, the arrays' offsets) tell; else it is no safetensors file."""
    size = os.path.getsize(path)
    if size < 8:
        return (
            f"{path} is {size} bytes long, too short for a checkpoint (a safetensors file begins with 8 bytes that "
            "give its header's length): truncated, or never written?; nothing was loaded"
        )
    expected = _expected_size(path)
    if expected is not None and size < expected[0]:
        return (
            f"{path} is truncated: {size} bytes, and its header expects {'' if expected[1] else 'at least '}"
            f"{expected[0]} (a full disk, a copy cut short?); nothing was loaded"
        )
    if expected is not None and size > expected[0]:
        return (
            f"{path} has {size - expected[0]} bytes after its end ({size} bytes, and its header expects "
            f"{expected[0]}: written over a longer file, or appended to?); nothing was loaded"
        )
    return f"{path} is not a safetensors file: {error}"


def _expected_size(path: str) -> tuple[int, bool] | None:
    """The size that ``path``'s header gives it, and whether the header's
    JSON was there whole (else the size is where the header would end: a
    floor); None where its first bytes are no safetensors header, or where
    the length they give is not that of the header that follows them."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if length > _MAX_HEADER:
            return None
        header = file.read(length)
    if len(header) < length:
        text = header.decode("utf-8", "replace")
        try:
            stop = json.JSONDecoder().raw_decode(text)[1]
        except ValueError:
            return 8 + length, False
        if text[stop:].strip(" "):  # (other bytes after a whole header: its length, not the file, is damaged)
            return None
        header = text[:stop].encode()  # (cut inside the spaces that pad a header: its JSON is whole)
    try:
        entries = json.loads(header)
        end = max((int(v["data_offsets"][1]) for k, v in entries.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # (its JSON damaged, or not of safetensors)
        return None
    return 8 + length + end, True


_UNREAD: Final = frozenset({"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"})
"""safetensors dtypes that NumPy has none for: refused by name, not as a damaged file."""
_DTYPES: Final = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "U64": np.uint64,
    "I32": np.int32,
    "U32": np.uint32,
    "I16": np.int16,
    "U16": np.uint16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "C64": np.complex64,
}
"""safetensors' dtypes that NumPy holds (those ``safetensors.numpy`` writes)."""


class _Unreadable(Exception):
    """Why a file is no safetensors file, in a few words for `unreadable`."""


@final
class _Unsupported(_Unreadable):
    """Why a safetensors file holds what monadl does not read."""


@final
class _Entry:
    """Where one array lies in the file, and its dtype and shape."""

    __slots__ = ("begin", "dtype", "end", "shape")

    def __init__(self, dtype: np.dtype[Any], shape: tuple[int, ...], begin: int, end: int) -> None:
        self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end


@final
class Opened:
    """A checkpoint held open: its manifest, and its arrays, read by `read`
    from this opening (a save that replaces the file meanwhile, another
    process saving the checkpoint that this one evaluates, must not pair one
    file's manifest with the next one's arrays, which their digests then
    call damaged)."""

    __slots__ = ("_entries", "_file", "_start", "manifest", "path")

    def __init__(self, path: str, file: FileIO, entries: dict[str, _Entry], start: int, manifest: Any) -> None:
        self.path, self._file, self._entries, self._start = path, file, entries, start
        self.manifest: dict[str, Any] = manifest

    def read(self, keys: Iterable[str]) -> dict[str, Any]:
        """The arrays named ``keys``, each in an array of its own (C order,
        native byte order, NumPy's own dtype object, writeable), all checked
        against the manifest's digests: a damaged one, or one the file lacks,
        is refused, naming them all."""
        arrays = {key: self._array(key) for key in dict.fromkeys(keys) if key in self._entries}
        saved = self.manifest.get("digests", {})  # (a checkpoint written before digests has none: read as it is)
        damaged = sorted(
            key
            for key in dict.fromkeys(keys)
            if key not in arrays or (key in saved and digest(arrays[key]) != saved[key])
        )
        if damaged:
            raise CheckpointError(
                f"{self.path} is damaged: the bytes of {', '.join(map(repr, damaged))} are not those saved; "
                "nothing was loaded"
            )
        return arrays

    def _array(self, key: str) -> Any:
        entry = self._entries[key]
        array: np.ndarray[Any, Any] = np.empty(entry.shape, entry.dtype)
        into = _bytes(array)
        self._file.seek(self._start + entry.begin)
        done = 0
        while done < len(into):  # (one read returns at most 2 GiB on Linux)
            count = self._file.readinto(into[done:])
            if not count:
                raise CheckpointError(unreadable(self.path, f"the file ends inside the array {key!r}"))
            done += count
        if sys.byteorder == "big" and array.dtype.itemsize > 1:  # (safetensors stores little-endian)
            array.byteswap(inplace=True)
        return array


@contextmanager
def opened(path: str) -> Iterator[Opened]:
    """``path`` opened: its manifest read and checked, its arrays ready to
    read (`Opened.read`); a file that is no checkpoint, or is damaged, is
    refused with `CheckpointError` saying why."""
    with open(path, "rb", buffering=0) as file:
        try:
            entries, header, start = _header(file)
        except _Unsupported as error:
            raise CheckpointError(f"{path} is a safetensors file, but {error}") from None
        except _Unreadable as error:
            raise CheckpointError(unreadable(path, error)) from None
        yield Opened(path, file, entries, start, _manifest(path, header))


def _header(file: FileIO) -> tuple[dict[str, _Entry], dict[str, str], int]:
    """The arrays' places, the text header (``__metadata__``) and where the
    arrays begin, checked as safetensors checks them: every array's bytes
    its dtype and shape's, the arrays one after the other from the header's
    end to the file's."""
    size = os.fstat(file.fileno()).st_size
    prefix = file.read(8)
    if len(prefix) < 8:
        raise _Unreadable("shorter than its 8-byte header length")
    length = int.from_bytes(prefix, "little")
    if length > _MAX_HEADER or 8 + length > size:
        raise _Unreadable(f"invalid header length {length} (the file holds {size - len(prefix)} bytes after it)")
    try:  # (UTF-8 alone, as safetensors reads it: json.loads of bytes would take UTF-16 and UTF-32 too)
        header = json.loads(file.read(length).decode("utf-8"))
    except ValueError as error:  # (a UnicodeDecodeError too)
        raise _Unreadable(f"its header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise _Unreadable("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _Unreadable("its __metadata__ is not a mapping of str to str")
    entries = {key: _entry(key, value) for key, value in header.items()}
    end = 0
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != end:
            raise _Unreadable("its arrays' offsets overlap or leave a gap")
        end = entry.end
    if 8 + length + end != size:
        raise _Unreadable(f"its arrays end at byte {8 + length + end} of {size}")
    return entries, metadata, 8 + length


def _entry(key: str, value: Any) -> _Entry:
    try:
        kind = value["dtype"]
        if kind in _UNREAD:
            raise _Unsupported(
                f"its array {key!r} has safetensors dtype {kind}, which NumPy has no dtype for and monadl does not "
                "read (a checkpoint of monadl's holds float16, float32 and float64 weights): convert the file's "
                "arrays first (with PyTorch: tensor.float())"
            )
        dtype = np.dtype(_DTYPES[kind])
        shape = tuple(value["shape"])
        begin, end = value["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise _Unreadable(f"its header's entry for {key!r} is not a safetensors array's: {value!r}") from None
    numbers = (*shape, begin, end)
    if not all(type(n) is int and n >= 0 for n in numbers) or end - begin != math.prod(shape) * dtype.itemsize:
        raise _Unreadable(f"its header's entry for {key!r} is not a safetensors array's: {value!r}")
    return _Entry(dtype, shape, begin, end)


def _manifest(path: str, header: dict[str, str]) -> dict[str, Any]:
    if MANIFEST_KEY not in header:
        raise CheckpointError(f"{path} is a safetensors file but not a monadl checkpoint (no manifest in its header)")
    saved = header.get(MANIFEST_DIGEST_KEY)  # (none in a checkpoint written before it: read as it is)
    if saved is not None and text_digest(header[MANIFEST_KEY]) != saved:
        raise CheckpointError(
            f"{path} is damaged: its manifest (the weights' names and shapes, the optimizer states' numbers "
            "such as step counts, the metadata) is not the one saved; nothing was loaded"
        )
    try:
        manifest: dict[str, Any] = json.loads(header[MANIFEST_KEY])
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: its manifest is not JSON: {error}") from None
    if manifest.get("format") != FORMAT or manifest.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{path}: a checkpoint of format {manifest.get('format')!r} version {manifest.get('version')!r}; "
            f"this monadl reads {FORMAT!r} up to version {VERSION}"
        )
    return manifest
