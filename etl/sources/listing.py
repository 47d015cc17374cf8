"""Driver-side file listings (local or any fsspec filesystem) with size and mtime,
and path patterns: globs (`*`, `?`, `[ab]`) and braces (`{a,b}`, `{000..099}`).

A local listing reads nothing outside the folder it lists: every entry is examined
with ``lstat`` (never opened), and an entry that is not a plain file inside the folder
is listed with a ``problem`` -- (reason, detail) -- that its adapter turns into a
reject of that record: ``symlink`` (a link, with ``follow_symlinks`` off),
``outside_source`` (a followed link that leads out of the folder), ``dangling_link``,
``not_a_file`` (a FIFO, socket or device: opening one could block forever).

Within :func:`one_listing` (a curate night) each folder is listed once: the listing
digest that tells a quiet night, the comparison with the manifest and the read of the
new records all see the same files, and a large folder is not walked three times.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

from etl.sources.base import file_uri, is_local_path, local_path
from udfs.fetch_local import file_kind

__all__ = ["ListedFile", "list_files", "expand_braces", "expand_pattern", "is_pattern",
           "fingerprint", "listing_digest", "LISTING_REASONS", "one_listing", "listed_once"]

# Reasons a listed entry is not read (see the module docstring).
LISTING_REASONS = ("symlink", "outside_source", "dangling_link", "not_a_file")
Follow = bool | str  # SourceConfig.follow_symlinks: False, True or "anywhere"

_T = TypeVar("_T")
# The listings made within one_listing(), by what was listed; None outside it.
_LISTINGS: ContextVar[dict | None] = ContextVar("lakeshard_listings", default=None)


@contextmanager
def one_listing() -> Iterator[None]:
    """Within it, what :func:`listed_once` lists (every :func:`list_files`) is listed
    once and the later calls get that listing: one snapshot of the sources for the
    block (a curate night). Files added during it are tonight's next listing's. Per
    thread of control (a context variable): other threads list for themselves."""
    token = _LISTINGS.set({})
    try:
        yield
    finally:
        _LISTINGS.reset(token)


def listed_once(key: tuple, make: Callable[[], list[_T]]) -> list[_T]:
    """`make()`, or within :func:`one_listing` the list it made for `key` the first
    time (a new list each call: a caller may change its own)."""
    made = _LISTINGS.get()
    if made is None:
        return make()
    if key not in made:
        made[key] = tuple(make())
    return list(made[key])

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


@dataclass(frozen=True)
class ListedFile:
    uri: str  # file:/abs/path locally (verbatim, see base.file_uri), the fsspec URL otherwise
    rel: str  # relative to the listed root
    size: int
    mtime: float
    # (reason, detail) when the entry must not be read; None for a plain file.
    problem: tuple[str, str] | None = None


def fingerprint(f: ListedFile) -> str:
    return f"{f.size}:{int(f.mtime * 1000)}"


def listing_digest(files: list[ListedFile]) -> str:
    """One hash of a listing: every entry's name, size, mtime and problem, in name order.
    Equal digests mean a listing that reads the same records (curate's quiet-night check)."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.uri):
        h.update(f"{f.uri}\0{fingerprint(f)}\0{f.problem}\n".encode())
    return h.hexdigest()


def expand_braces(pattern: str) -> list[str]:
    """`a{1,2}b{00..02}` -> a1b00 a1b01 a1b02 a2b00 … (zero padding kept)."""
    parts, choices, pos = [], [], 0
    for m in _BRACE.finditer(pattern):
        parts.append(pattern[pos:m.start()])
        body = m.group(1)
        rng = _RANGE.match(body)
        if rng:
            lo, hi = int(rng.group(1)), int(rng.group(2))
            width = len(rng.group(1)) if rng.group(1).startswith("0") else 0
            step = 1 if hi >= lo else -1
            choices.append([str(i).zfill(width) for i in range(lo, hi + step, step)])
        else:
            choices.append(body.split(","))
        pos = m.end()
    parts.append(pattern[pos:])
    out = []
    for combo in itertools.product(*choices):
        out.append("".join(p + c for p, c in zip(parts, [*combo, ""], strict=True)))
    return out


def _has_glob(p: str) -> bool:
    return any(ch in p for ch in "*?[")


def is_pattern(path: str) -> bool:
    """Whether `path` is a pattern (a glob or a brace expression) rather than one path:
    it names what it matches, which may be nothing."""
    return _has_glob(path) or _BRACE.search(path) is not None


def expand_pattern(pattern: str, follow_symlinks: Follow = False) -> list[ListedFile]:
    """Every existing file a brace/glob pattern names (a folder lists its files). A
    path named literally is taken as configured; entries a glob or a folder listing
    found are checked as :func:`list_files` checks them."""
    seen: dict[str, ListedFile] = {}
    for p in expand_braces(pattern):
        if is_local_path(p):
            lp = str(local_path(p))
            if _has_glob(lp):
                base = os.path.realpath(_glob_root(lp))
                for name in sorted(glob.glob(lp, recursive=True)):
                    if os.path.isdir(name) and not os.path.islink(name):
                        for f in list_files(name, follow_symlinks):
                            seen.setdefault(f.uri, f)
                        continue
                    f = _local_entry(name, os.path.basename(name), base, follow_symlinks)
                    if f is not None:
                        seen.setdefault(f.uri, f)
            elif os.path.isdir(lp):
                for f in list_files(lp, follow_symlinks):
                    seen.setdefault(f.uri, f)
            elif os.path.lexists(lp):
                # Named in the config: a link is followed wherever it leads.
                f = _local_entry(lp, os.path.basename(lp), "/", "anywhere")
                if f is not None:
                    seen.setdefault(f.uri, f)
        else:
            import fsspec

            fs, _ = fsspec.core.url_to_fs(p)
            proto = p.split("://", 1)[0]
            names = fs.glob(p) if _has_glob(p) else ([p] if fs.exists(p) else [])
            for name in names:
                info = fs.info(name)
                uri = name if "://" in name else f"{proto}://{name}"
                if info.get("type") == "directory":
                    for f in list_files(uri):
                        seen.setdefault(f.uri, f)
                else:
                    seen.setdefault(uri, ListedFile(uri, uri.rsplit("/", 1)[-1],
                                                    int(info.get("size") or 0), _mtime(info)))
    return sorted(seen.values(), key=lambda f: f.uri)


def _mtime(info: dict) -> float:
    for k in ("mtime", "LastModified", "last_modified", "updated", "created"):
        v = info.get(k)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return float(v.timestamp())
        try:
            return float(v)
        except (TypeError, ValueError):
            continue
    return 0.0


def _glob_root(pattern: str) -> str:
    """The folder a glob searches under: its path up to the first part with a glob."""
    parts = pattern.split(os.sep)
    head = []
    for part in parts[:-1]:
        if _has_glob(part):
            break
        head.append(part)
    return os.sep.join(head) or ("/" if pattern.startswith("/") else ".")


def _inside(real: str, base: str) -> bool:
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def _local_entry(path: str, rel: str, base: str, follow: Follow) -> ListedFile | None:
    """One entry of a local listing, examined without opening it (None: it vanished
    between the listing and the look)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    problem = None
    if stat.S_ISLNK(st.st_mode):
        if follow is False:
            problem = ("symlink", "a symbolic link, not followed (the source's "
                       "follow_symlinks is off)")
        else:
            try:
                st = os.stat(path)
            except OSError:
                problem = ("dangling_link", "a symbolic link that leads nowhere")
            else:
                if follow != "anywhere" and not _inside(os.path.realpath(path), base):
                    problem = ("outside_source", "a symbolic link that leads outside "
                               "the source's folder")
    if problem is None and not stat.S_ISREG(st.st_mode):
        problem = ("not_a_file", f"{file_kind(st.st_mode)}, not read")
    return ListedFile(file_uri(path), rel, st.st_size if problem is None else 0,
                      st.st_mtime, problem)


def list_files(root: str, follow_symlinks: Follow = False) -> list[ListedFile]:
    """All files under `root`, recursively, sorted by relative path (hidden files and
    folders skipped). Locally, links and special files are listed with their
    ``problem`` (see the module docstring); a link to a folder is descended into only
    when followed (and, unless "anywhere", when it stays inside `root`), once. Within
    :func:`one_listing`, once per root."""
    return listed_once(("files", root, follow_symlinks),
                       lambda: _list_files(root, follow_symlinks))


def _list_files(root: str, follow_symlinks: Follow) -> list[ListedFile]:
    out = []
    if is_local_path(root):
        base = os.path.realpath(local_path(root))
        seen = {(os.stat(base).st_dev, os.stat(base).st_ino)}

        def visit(folder: str, rel: str) -> None:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:
                return  # an unreadable folder lists nothing (as os.walk)
            for e in entries:
                if e.name.startswith("."):
                    continue
                path, name = os.path.join(folder, e.name), f"{rel}{e.name}"
                try:
                    is_link = e.is_symlink()
                    is_dir = e.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if is_dir:
                    visit(path, name + "/")
                    continue
                if is_link and follow_symlinks is not False and os.path.isdir(path):
                    real = os.path.realpath(path)
                    st = os.stat(path)
                    if (follow_symlinks == "anywhere" or _inside(real, base)) and \
                            (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        visit(path, name + "/")
                    continue
                f = _local_entry(path, name, base, follow_symlinks)
                if f is not None:
                    out.append(f)

        visit(base, "")
        return sorted(out, key=lambda f: f.rel)
    import fsspec

    fs, path = fsspec.core.url_to_fs(root)
    proto = root.split("://", 1)[0]
    base = path.rstrip("/") + "/"
    for name, info in sorted(fs.find(path, detail=True).items()):
        rel = name[len(base):] if name.startswith(base) else name
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        out.append(ListedFile(f"{proto}://{name}", rel, int(info.get("size") or 0),
                              _mtime(info)))
    return out
