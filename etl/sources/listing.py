"""Driver-side file listings (local or any fsspec filesystem) with size and mtime,
and path patterns: globs (`*`, `?`, `[ab]`) and braces (`{a,b}`, `{000..099}`)."""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from etl.sources.base import file_uri, is_local_path, local_path

__all__ = ["ListedFile", "list_files", "expand_braces", "expand_pattern", "fingerprint"]

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


@dataclass(frozen=True)
class ListedFile:
    uri: str  # file:/abs/path locally, the fsspec URL otherwise
    rel: str  # relative to the listed root
    size: int
    mtime: float


def fingerprint(f: ListedFile) -> str:
    return f"{f.size}:{int(f.mtime * 1000)}"


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


def expand_pattern(pattern: str) -> list[ListedFile]:
    """Every existing file a brace/glob pattern names (a folder lists its files)."""
    seen: dict[str, ListedFile] = {}
    for p in expand_braces(pattern):
        if is_local_path(p):
            lp = str(local_path(p))
            names = sorted(__import__("glob").glob(lp, recursive=True)) if _has_glob(lp) else [lp]
            for name in names:
                if os.path.isdir(name):
                    for f in list_files(name):
                        seen.setdefault(f.uri, f)
                elif os.path.isfile(name):
                    st = os.stat(name)
                    f = ListedFile(file_uri(name), os.path.basename(name), st.st_size, st.st_mtime)
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


def list_files(root: str) -> list[ListedFile]:
    """All files under `root`, recursively, sorted (hidden files and folders skipped)."""
    out = []
    if is_local_path(root):
        base = Path(local_path(root)).resolve()
        for dp, dns, fns in os.walk(base):
            dns[:] = sorted(d for d in dns if not d.startswith("."))
            for fn in sorted(fns):
                if fn.startswith("."):
                    continue
                p = Path(dp) / fn
                st = p.stat()
                out.append(ListedFile(file_uri(p), p.relative_to(base).as_posix(),
                                      st.st_size, st.st_mtime))
        return out
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
