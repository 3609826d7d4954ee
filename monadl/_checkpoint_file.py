"""A checkpoint's file as monadl reads it (`monadl.checkpoint`): the manifest
in its header and the digests that tell a damaged file (`digest`,
`text_digest`), one opening for the manifest and the arrays (`read`), and,
where safetensors cannot read it, why, from its own header's numbers
(`unreadable`: cut short, or with bytes after its end)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Final

import numpy as np
from safetensors import SafetensorError, safe_open

from monadl.errors import CheckpointError

__all__ = ["FORMAT", "MANIFEST_DIGEST_KEY", "MANIFEST_KEY", "VERSION", "digest", "read", "text_digest", "unreadable"]

MANIFEST_KEY: Final = "monadl"
MANIFEST_DIGEST_KEY: Final = "monadl.digest"  # (beside the manifest, not in it: it covers the manifest's exact text)
FORMAT: Final = "monadl.checkpoint"
VERSION: Final = 1


def digest(array: Any) -> str | None:
    """A stored array's bytes, hashed (BLAKE2b, 16 bytes, with its dtype and shape); None for no array."""
    if array is None:
        return None
    hashed = hashlib.blake2b(f"{array.dtype.str}{array.shape}".encode(), digest_size=16)
    hashed.update(np.ascontiguousarray(array).tobytes())
    return hashed.hexdigest()


def text_digest(text: str) -> str:
    """The manifest's text, hashed (BLAKE2b, 16 bytes): its names, shapes,
    the optimizer states' numbers (Adam's step counts) and the metadata."""
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


_MAX_HEADER: Final = 100_000_000  # (safetensors' own limit: a longer one is no header)


def unreadable(path: str, error: SafetensorError) -> str:
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


def read(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest and the arrays of ``path``, read through one opening of
    it: a save that replaces the file meanwhile (another process saving the
    checkpoint that this one evaluates) must not pair one file's manifest
    with the next one's arrays, which their digests then call damaged."""
    with safe_open(path, framework="numpy") as file:
        manifest = _manifest(path, file.metadata() or {})
        return manifest, {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 - not iterable


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
