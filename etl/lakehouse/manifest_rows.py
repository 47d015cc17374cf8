"""The manifest's narrow columns read by delta-rs into this process, for a comparison
whose listing is small even though the manifest is not: a night that opened only the
table files or shards that changed (:mod:`etl.lakehouse.source_diff`).

What the Spark path asks of the manifest's snapshot -- which containers hold a record
to retry, which shards are unchanged, which manifest rows the listed keys already have,
which records the listing no longer has -- is asked here of one Arrow table of
``sample_id, source, source_uri, status, reason, fingerprint``: a few hundred
milliseconds at a million rows, where the Spark path runs a dozen jobs over a
checkpointed snapshot. Read only while the manifest holds at most ``driver.scan_rows``
rows (:mod:`etl.config.bounds`); each answer is the same rule as its Spark twin in
:mod:`etl.transforms.bronze` (``tests/test_driver_diff.py`` compares the two paths).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from etl.schema import REMOVED
from etl.transforms.bronze import RETRIED_REASONS
from etl.writers.delta import read_columns

__all__ = ["ManifestRows", "COLUMNS"]

COLUMNS = ["sample_id", "source", "source_uri", "status", "reason", "fingerprint"]


@dataclass(frozen=True)
class ManifestRows:
    """:data:`COLUMNS` of every manifest row, as this run read them. Each question is a
    mask over the columns, and only the rows it answers with are taken out of them (a
    filter of the whole table would copy its six string columns, a million rows each,
    for every question)."""

    table: pa.Table
    _masks: dict = field(init=False, default_factory=dict, compare=False, repr=False)

    @classmethod
    def read(cls, path: str, bound: int) -> ManifestRows | None:
        """The manifest at `path` read by delta-rs; None when its log says it holds more
        than `bound` rows, or delta-rs cannot tell or read it (Spark compares then)."""
        table = read_columns(path, COLUMNS, bound=bound)
        return None if table is None else cls(table)

    def _mask(self, name: str, make) -> pa.ChunkedArray:
        if name not in self._masks:
            self._masks[name] = make()
        return self._masks[name]

    def _of(self, source: str) -> pa.ChunkedArray:
        """Which rows are `source`'s."""
        return self._mask(f"source:{source}", lambda: pc.fill_null(
            pc.equal(self.table.column("source"), source), False))

    def _live(self) -> pa.ChunkedArray:
        """Which rows are still there (accepted or rejected)."""
        return self._mask("live", lambda: pc.fill_null(
            pc.not_equal(self.table.column("status"), REMOVED), False))

    def _retry(self) -> pa.ChunkedArray:
        """:func:`etl.transforms.bronze.is_retry` of each row."""
        def make():
            reason = self.table.column("reason")
            rejected = pc.fill_null(pc.equal(self.table.column("status"), "rejected"), False)
            listed = pc.fill_null(pc.is_in(reason, pa.array(RETRIED_REASONS, pa.string())),
                                  False)
            http5 = pc.fill_null(pc.starts_with(reason, "http_5"), False)
            return pc.or_(pc.and_(rejected, listed), http5)
        return self._mask("retry", make)

    def _rows(self, mask: pa.ChunkedArray, columns: list[str]) -> pa.Table:
        return self.table.select(columns).filter(mask)

    def retried_containers(self, source: str) -> frozenset[str]:
        """:meth:`etl.lakehouse.catalog.Manifest.retried_containers` on these rows."""
        uris = self._rows(pc.and_(self._of(source), self._retry()),
                          ["source_uri"]).column("source_uri")
        return frozenset(u for u in pc.unique(uris).to_pylist() if u is not None)

    def container_groups(self, source: str) -> list[dict]:
        """:meth:`etl.lakehouse.catalog.Manifest.container_groups` on these rows:
        ``source_uri, fingerprint (null for a retried record), count`` of a source's rows
        not removed from their source."""
        gone = pc.and_(pc.equal(self.table.column("status"), REMOVED), pc.fill_null(
            pc.equal(self.table.column("reason"), "source_removed"), False))
        keep = pc.and_(self._of(source), pc.fill_null(pc.invert(gone), False))
        mine = self._rows(keep, ["source_uri", "fingerprint"])
        known = pc.if_else(self._retry().filter(keep), pa.scalar(None, pa.string()),
                           mine.column("fingerprint"))
        groups = pa.table({"source_uri": mine.column("source_uri"), "fingerprint": known}
                          ).group_by(["source_uri", "fingerprint"], use_threads=False
                                     ).aggregate([([], "count_all")])
        return [{"source_uri": r["source_uri"], "fingerprint": r["fingerprint"],
                 "count": r["count_all"]} for r in groups.to_pylist()]

    def holds_live(self, source: str) -> bool:
        """Whether a record of `source` is still there (accepted or rejected)."""
        return pc.any(pc.and_(self._of(source), self._live())).as_py() is True

    def known_of(self, sample_ids: Iterable[str]) -> pa.Table:
        """The rows of `sample_ids` (what :func:`etl.transforms.bronze.mark_unchanged`
        joins the listing with): ``sample_id, source, status, reason, fingerprint``."""
        wanted = pa.array(sorted(set(sample_ids)), pa.string())
        return self._rows(pc.is_in(self.table.column("sample_id"), wanted),
                          ["sample_id", "source", "status", "reason", "fingerprint"])

    def removed(self, source: str, skipped: Collection[str], listed: Collection[str]
                ) -> list[tuple[str, str]]:
        """:func:`etl.transforms.bronze.removed_records` of one source on these rows:
        ``(sample_id, status)`` of its records still there whose container was opened
        (not in `skipped`) and whose id the listing (`listed`) no longer has."""
        mask = pc.and_(self._of(source), self._live())
        if skipped:
            kept = pa.array(sorted(skipped), pa.string())
            mask = pc.and_(mask, pc.invert(pc.fill_null(
                pc.is_in(self.table.column("source_uri"), kept), False)))
        mine = self._rows(mask, ["sample_id", "status"])
        if listed:
            mine = mine.filter(pc.invert(pc.is_in(mine.column("sample_id"),
                                                   pa.array(sorted(set(listed)), pa.string()))))
        return sorted(zip(mine.column("sample_id").to_pylist(),
                          mine.column("status").to_pylist(), strict=True))
