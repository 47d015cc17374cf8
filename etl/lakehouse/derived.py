"""Derived state: small JSON documents computed from tables and kept beside them, so that
a run knows what it would otherwise have to read a table for.

One mechanism for every such shortcut (datatrove's completion markers and per-task stats
are the model): a document is written **after** the commit it describes, names its
**kind** and **format**, and carries the **key** it was computed at -- the table versions
and settings its figures depend on. :meth:`DerivedState.load` returns the payload only
when all three match; a missing, unreadable, foreign (another kind or format) or stale
(another key) document reads as None and its owner computes the figures again from the
tables. Derived state is never the truth: deleting ``<root>/_lakeshard/`` costs a run
some reads, never a wrong figure.

Its users: curate's source versions and quiet-night key
(:mod:`etl.lakehouse.curate_state`), what an
export counted from the dedup table and the manifest (:mod:`etl.jobs.export`), the
corpus-wide counts kept per Lance fragment and Delta file (:mod:`etl.lakehouse.counts`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from etl.writers.remote import read_file, write_file

__all__ = ["DerivedState"]

log = logging.getLogger(__name__)


def _canonical(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value, sort_keys=True))


@dataclass(frozen=True)
class DerivedState:
    """The document at `path`, of one `kind` and `format`."""

    path: str
    kind: str
    format: int = 1

    def _document(self) -> dict | None:
        try:
            body = read_file(self.path)
            doc = json.loads(body) if body else None
        except (OSError, ValueError) as exc:
            log.info("%s: %s unreadable (%s): computing it again", self.kind, self.path, exc)
            return None
        if not isinstance(doc, dict) or doc.get("kind") != self.kind or \
                doc.get("format") != self.format or not isinstance(doc.get("payload"), dict):
            return None
        return doc

    def load(self, key: Mapping | None = None) -> dict | None:
        """The payload if the document was computed at `key` (`None`: at any key)."""
        doc = self._document()
        if doc is None or (key is not None and doc.get("key") != _canonical(key)):
            return None
        return doc["payload"]

    def save(self, key: Mapping | None, payload: Mapping) -> None:
        """Written once the commit it describes is done; not rewritten when unchanged. A
        document that cannot be written costs the next run the reads, not a failure."""
        doc = {"kind": self.kind, "format": self.format, "key": _canonical(key),
               "payload": _canonical(payload)}
        if self._document() == doc:
            return
        try:
            write_file(self.path, json.dumps(doc, sort_keys=True,
                                             separators=(",", ":")).encode())
        except OSError as exc:
            log.warning("%s: could not write %s (%s)", self.kind, self.path, exc)

    def clear(self) -> None:
        """Forget the payload (before, or instead of, a commit it would no longer describe):
        the document is kept with no key, which no :meth:`load` with a key matches."""
        if self._document() is not None:
            self.save(None, {})
