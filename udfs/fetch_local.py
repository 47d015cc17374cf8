"""Reading local files a source names, inside Spark tasks, as a stranger's files.

A path stays a path: what an adapter listed is opened byte for byte as listed (no URL
parsing that would turn ``%2F`` into ``/`` or cut at ``#``, no dropped TAB/CR/LF). The
open never blocks and never follows a final symbolic link unless the source allows it
(``O_NONBLOCK | O_NOFOLLOW``); what it opened must be a regular file (a FIFO, device or
socket is refused without a byte read); and the read runs under a deadline, in bounded
chunks, capped at ``max_bytes``.

Outcomes are fetch statuses (:data:`udfs.fetch.FETCH_STATUSES`), never exceptions:
``missing_file``, ``symlink`` (a link the source does not follow), ``not_a_file``,
``too_large``, ``truncated``, ``timeout``, ``error``.
"""

from __future__ import annotations

import errno
import os
import stat
import time

__all__ = ["LOCAL_STATUSES", "file_kind", "read_local"]

# Statuses only local reads end with (the others are shared with every fetch).
LOCAL_STATUSES = ("symlink", "not_a_file")
_CHUNK = 1 << 20


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (for a reject's detail)."""
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"


def open_regular(path: str):
    """A local file opened for reading without blocking on a FIFO, refused (OSError)
    unless it is a regular file: a config path, a file a listing found, a table file
    read again where its rows are prepared."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{os.path.basename(path)!r} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_local(path: str, rng: tuple[int, int] | None, max_bytes: int, timeout_s: float,
               follow_symlinks: bool = True):
    """The bytes of a local file (or a byte range of it) as a FetchResult; never raises
    for what the file system holds."""
    from udfs.fetch_http import FetchResult

    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    deadline = time.monotonic() + timeout_s
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if os.path.islink(path):
            return FetchResult(None, "missing_file", "a dangling symbolic link")
        return FetchResult(None, "missing_file", "no such file")
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            return FetchResult(None, "symlink", "a symbolic link (the source does not "
                               "follow links: follow_symlinks)")
        if exc.errno == errno.ENXIO:  # a socket, or a FIFO with no writer
            return FetchResult(None, "not_a_file", "a socket or FIFO")
        if exc.errno == errno.EISDIR:
            return FetchResult(None, "missing_file", "is a directory")
        return FetchResult(None, "error", f"{type(exc).__name__}: {exc.strerror}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            reason = "missing_file" if stat.S_ISDIR(st.st_mode) else "not_a_file"
            return FetchResult(None, reason, file_kind(st.st_mode))
        want = rng[1] if rng is not None else st.st_size
        if want > max_bytes:
            return FetchResult(None, "too_large", f"{want} bytes")
        if rng is not None:
            os.lseek(fd, rng[0], os.SEEK_SET)
        buf = bytearray()
        while len(buf) < want:
            if time.monotonic() > deadline:
                return FetchResult(None, "timeout", f"read {len(buf)} of {want} bytes "
                                   f"in {timeout_s} s")
            piece = os.read(fd, min(_CHUNK, want - len(buf)))
            if not piece:
                break
            buf += piece
        if len(buf) != want:
            return FetchResult(None, "truncated", f"read {len(buf)} of {want} bytes")
        return FetchResult(bytes(buf), "ok")
    except OSError as exc:
        return FetchResult(None, "error", f"{type(exc).__name__}: {exc.strerror}")
    finally:
        os.close(fd)
