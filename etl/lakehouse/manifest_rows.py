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
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from etl.schema import REMOVED
from etl.transforms.bronze import RETRIED_REASONS
from etl.writers.delta import read_columns

__all__ = ["ManifestRows", "COLUMNS"]

COLUMNS = ["sample_id", "source", "source_uri", "status", "reason", "fingerprint"]


@dataclass(frozen=True)
class ManifestRows:
    """:data:`COLUMNS` of every manifest row, as this run read them."""

    table: pa.Table

    @classmethod
    def read(cls, path: str, bound: int) -> ManifestRows | None:
        """The manifest at `path` read by delta-rs; None when its log says it holds more
        than `bound` rows, or delta-rs cannot tell or read it (Spark compares then)."""
        table = read_columns(path, COLUMNS, bound=bound)
        return None if table is None else cls(table)

    def _retry(self, table: pa.Table) -> pa.ChunkedArray:
        """:func:`etl.transforms.bronze.is_retry` of each row of `table`."""
        reason = table.column("reason")
        rejected = pc.fill_null(pc.equal(table.column("status"), "rejected"), False)
        listed = pc.fill_null(pc.is_in(reason, pa.array(RETRIED_REASONS, pa.string())), False)
        http5 = pc.fill_null(pc.starts_with(reason, "http_5"), False)
        return pc.or_(pc.and_(rejected, listed), http5)

    def _of(self, source: str) -> pa.Table:
        return self.table.filter(pc.equal(self.table.column("source"), source))

    def _live(self, table: pa.Table) -> pa.Table:
        return table.filter(pc.not_equal(table.column("status"), REMOVED))

    def retried_containers(self, source: str) -> frozenset[str]:
        """:meth:`etl.lakehouse.catalog.Manifest.retried_containers` on these rows."""
        mine = self._of(source)
        uris = mine.filter(self._retry(mine)).column("source_uri")
        return frozenset(u for u in pc.unique(uris).to_pylist() if u is not None)

    def container_groups(self, source: str) -> list[dict]:
        """:meth:`etl.lakehouse.catalog.Manifest.container_groups` on these rows:
        ``source_uri, fingerprint (null for a retried record), count`` of a source's rows
        not removed from their source."""
        mine = self._of(source)
        gone = pc.and_(pc.equal(mine.column("status"), REMOVED),
                       pc.fill_null(pc.equal(mine.column("reason"), "source_removed"), False))
        mine = mine.filter(pc.invert(gone))
        known = pc.if_else(self._retry(mine), pa.scalar(None, pa.string()),
                           mine.column("fingerprint"))
        groups = pa.table({"source_uri": mine.column("source_uri"), "fingerprint": known}
                          ).group_by(["source_uri", "fingerprint"], use_threads=False
                                     ).aggregate([([], "count_all")])
        return [{"source_uri": r["source_uri"], "fingerprint": r["fingerprint"],
                 "count": r["count_all"]} for r in groups.to_pylist()]

    def holds_live(self, source: str) -> bool:
        """Whether a record of `source` is still there (accepted or rejected)."""
        return self._live(self._of(source)).num_rows > 0

    def known_of(self, sample_ids: Iterable[str]) -> pa.Table:
        """The rows of `sample_ids` (what :func:`etl.transforms.bronze.mark_unchanged`
        joins the listing with): ``sample_id, source, status, reason, fingerprint``."""
        wanted = pa.array(sorted(set(sample_ids)), pa.string())
        found = self.table.filter(pc.is_in(self.table.column("sample_id"), wanted))
        return found.select(["sample_id", "source", "status", "reason", "fingerprint"])

    def removed(self, source: str, skipped: Collection[str], listed: Collection[str]
                ) -> list[tuple[str, str]]:
        """:func:`etl.transforms.bronze.removed_records` of one source on these rows:
        ``(sample_id, status)`` of its records still there whose container was opened
        (not in `skipped`) and whose id the listing (`listed`) no longer has."""
        mine = self._live(self._of(source))
        if skipped:
            kept = pa.array(sorted(skipped), pa.string())
            mine = mine.filter(pc.invert(pc.fill_null(
                pc.is_in(mine.column("source_uri"), kept), False)))
        if listed:
            mine = mine.filter(pc.invert(pc.is_in(mine.column("sample_id"),
                                                   pa.array(sorted(set(listed)), pa.string()))))
        return sorted(zip(mine.column("sample_id").to_pylist(),
                          mine.column("status").to_pylist(), strict=True))
