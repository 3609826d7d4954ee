"""Writing a file atomically, and removing what a killed writer left.

A file is written into a workspace of its own, a hidden folder beside its
path and named after it (``.model.safetensors.<32 hex digits>.tmp``),
synced, and renamed over the path: the path holds the old file or the new
one, never part of one. A library's own temporary goes into the workspace
too (safetensors' ``save_file`` writes a ``.tmpXXXXXX`` beside its target,
named after nothing), so whatever a write leaves is in a folder that says
whose it is.

A writer that is killed (kill -9, a preempted job, a power cut) leaves its
workspace, a file the size of the checkpoint. The next write of the same
path removes it, and only it: a folder of that exact name whose lock file
it can lock. Its writer held that lock from before it wrote anything until
it was done, and a lock goes with the process that held it, so a locked
one is a write still at work (another thread, another process, another
host on a file system that locks) and stays. Where the file system has no
locks, or the platform no ``flock`` (Windows), nothing is removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Final

if sys.platform != "win32":  # (Windows has no flock: no workspace is ever taken for a leftover there)
    import fcntl

__all__ = ["write_atomically"]

_LOCK: Final = ".lock"
_MINE: Final[set[str]] = set()
"""This process's workspaces now being written: where flock is emulated
by POSIX record locks (NFS), a process's own lock does not keep it out."""
_MINE_LOCK: Final = threading.Lock()


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """Have ``write(target)`` write the file, then put it at ``path`` at once.

    The file gets the permissions that the umask gives a new file, whatever
    ``write`` made (safetensors' own are the owner's alone). An error, a
    Ctrl-C, leaves ``path`` as it was and no workspace behind; a kill leaves
    one, which the next write of ``path`` removes (`_remove_leftovers`).
    """
    directory, name = os.path.split(os.path.abspath(path))
    _remove_leftovers(directory, name)
    workspace, lock = _workspace(directory, name, path)
    try:
        target = os.path.join(workspace, name)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # (to learn what the umask gives)
        mode = os.stat(target).st_mode & 0o777
        write(target)
        os.chmod(target, mode)
        _fsync(target, os.O_RDONLY)
        os.replace(target, path)
    finally:
        _remove(workspace, lock)
        with _MINE_LOCK:
            _MINE.discard(workspace)
    if os.name == "posix":
        _fsync(directory, os.O_RDONLY)  # the rename itself survives a power cut


def _workspace(directory: str, name: str, path: str) -> tuple[str, int]:
    """A new workspace for ``name``, and its lock file's descriptor, locked."""
    while True:
        workspace = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
        try:
            os.mkdir(workspace, 0o700)
        except OSError as exc:  # (a missing folder, no permission: the error names the user's path, not ours)
            raise type(exc)(exc.errno, exc.strerror, path) from None
        with _MINE_LOCK:
            _MINE.add(workspace)
        lock_path = os.path.join(workspace, _LOCK)
        try:
            lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:  # (another write took it, still empty, for a killed writer's: it is gone)
            lock = -1
        if lock >= 0 and _locked(lock, lock_path):
            return workspace, lock
        if lock >= 0:
            os.close(lock)
        with _MINE_LOCK:
            _MINE.discard(workspace)


def _locked(lock: int, lock_path: str) -> bool:
    """Whether our new workspace's lock file is locked by us (or cannot be
    locked at all, on a file system without locks) and still in place: not
    locked first by another write, or removed by it before we locked it."""
    if sys.platform != "win32":
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # (another write locked it first, to remove it)
            return False
        except OSError:  # (no locks here: this workspace is removed by us alone)
            pass
    try:
        return os.path.samestat(os.fstat(lock), os.stat(lock_path))
    except FileNotFoundError:
        return False


def _remove_leftovers(directory: str, name: str) -> None:
    """Remove the workspaces for ``name`` whose writers are gone."""
    if sys.platform == "win32":
        return
    ours = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{32}}\.tmp")
    try:
        with os.scandir(directory) as entries:
            found = [e.path for e in entries if ours.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:  # (a missing folder: the write says so)
        return
    for workspace in found:
        with _MINE_LOCK:
            if workspace in _MINE:
                continue
        try:
            lock = os.open(os.path.join(workspace, _LOCK), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:  # (killed before it made its lock, so before it wrote: empty)
            with contextlib.suppress(OSError):
                os.rmdir(workspace)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # (its writer is at work, or the file system has no locks)
            os.close(lock)
            continue
        _remove(workspace, lock)


def _remove(workspace: str, lock: int) -> None:
    """Remove a workspace whose lock ``lock`` holds: its files, then the lock
    file (last: a workspace with files in it always has its lock), then it,
    and only then let the lock go. A writer that made that lock file and
    has yet to lock it (`_locked`) then finds it locked, or gone: released
    first, the writer could lock it and take as its own a folder about to
    be removed, under the file it was writing. (Windows cannot remove an
    open file, and there no write removes another's: closed first.)"""
    if sys.platform == "win32":
        os.close(lock)
    try:
        with contextlib.suppress(OSError), os.scandir(workspace) as entries:
            for entry in entries:
                if entry.name != _LOCK and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(workspace, _LOCK))
        with contextlib.suppress(OSError):
            os.rmdir(workspace)
    finally:
        if sys.platform != "win32":
            os.close(lock)


def _fsync(path: str, flags: int) -> None:
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
