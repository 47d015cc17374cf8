"""Curate's derived state (:class:`~etl.lakehouse.derived.DerivedState`), one owner for
its documents, under the layout's ``_lakeshard/`` folder:

* ``source_versions.json``: per source with a history (Delta, Lance), the version the last
  completed curate fully handled -- where the next run's history of deletions starts;
* ``curate_quiet.json``: tonight's key (every source's listing digest and config, the
  manifest's and the takedowns' versions, lakeshard's version) and, when the last run left
  the same key, its figures: a quiet night records them and lists, compares and merges
  nothing;
* ``table_containers.json``: per table source whose records embed their images, each
  file's fingerprint (size and mtime) when it was last read in full and how many records
  it listed, keyed by the manifest version written after that read. A file with the same
  fingerprint tonight is not opened: its records count as unchanged
  (:func:`etl.lakehouse.source_diff.compare`).

Like every derived document, none is the truth: missing, damaged or stale, it reads as
None and the run compares every source in full.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pyspark.sql import SparkSession

from etl.config import Config, SourceConfig
from etl.lakehouse.derived import DerivedState
from etl.ledger import code_version
from etl.sources import adapter_for
from etl.tables import Layout
from etl.transforms.bronze import retried

__all__ = ["SOURCE_VERSION", "CurateState", "Quiet", "TableVersions", "ContainerMemo",
           "version_key"]

log = logging.getLogger(__name__)

# Key of the version a run read of a source with a history (in the versions document and
# in the ledger's table_versions): source:<name>:<hash of its path>, so a source pointed
# elsewhere starts over instead of reading another table's history.
SOURCE_VERSION = "source:"
# The manifest's and the takedowns' versions as their logs say now (read when asked: the
# quiet key lists the sources first).
TableVersions = Callable[[], tuple[int | None, int | None]]
# Per source: container (table file) URI -> (fingerprint when read in full, records listed).
ContainerMemo = dict[str, dict[str, tuple[str, int]]]


def version_key(source: SourceConfig) -> str:
    """The ledger's and the versions document's key of `source`'s version."""
    where = hashlib.sha256(source.path.encode()).hexdigest()[:8]
    return f"{SOURCE_VERSION}{source.name}:{where}"


@dataclass(frozen=True)
class Quiet:
    """Step "check for change": tonight's key and, when the last run left the same key and
    nothing it processed is retried, its figures (``unchanged``, ``scans``, ``versions``
    per source)."""
    key: dict | None  # None: a source kind that cannot tell cheaply, or no tables yet
    payload: dict | None  # None: a full run

    @property
    def hit(self) -> bool:
        return self.payload is not None


@dataclass(frozen=True)
class CurateState:
    """Curate's two documents under ``<root>/_lakeshard/``."""

    versions: DerivedState
    quiet: DerivedState
    containers: DerivedState

    @classmethod
    def of(cls, paths: Layout) -> CurateState:
        return cls(DerivedState(paths.source_versions, "source_versions"),
                   DerivedState(paths.curate_quiet, "curate_quiet"),
                   DerivedState(paths.table_containers,
                                "table_containers"))

    def table_containers(self, manifest_version: int | None) -> ContainerMemo:
        """The table files the run that wrote manifest version `manifest_version` had
        read in full; {} when the document is missing, unreadable or written at another
        version (any other write of the manifest since -- a crash after the merge, a
        `forget` -- and every file is read again)."""
        if manifest_version is None:
            return {}
        kept = self.containers.load(_containers_key(manifest_version)) or {}
        try:
            return {name: {uri: (str(fp), int(n)) for uri, (fp, n) in files.items()}
                    for name, files in kept.items()}
        except (ValueError, TypeError, AttributeError):
            log.warning("curate: table containers unreadable: reading every table file")
            return {}

    def remember_containers(self, manifest_version: int | None,
                            memo: ContainerMemo | None) -> None:
        """Written after the run's last commit to the manifest, at its version; `memo`
        None (a run that did not compare table files in Spark): forgotten."""
        if memo is None or manifest_version is None:
            self.containers.clear()
            return
        self.containers.save(_containers_key(manifest_version), memo)

    def source_versions(self) -> dict[str, int]:
        """The source versions the last completed curate read; {} when there is no
        (readable) record: every source is then compared in full."""
        kept = self.versions.load() or {}
        try:
            return {k: int(v) for k, v in kept.items() if k.startswith(SOURCE_VERSION)}
        except (ValueError, TypeError):
            log.warning("curate: source versions unreadable: comparing every source in full")
            return {}

    def record_versions(self, versions: Mapping[str, int]) -> None:
        """Written once the run's removals are done (a run that dies before leaves the
        last record, and the next run looks at the history since then again)."""
        self.versions.save(None, versions)

    def remember_versions(self, cfg: Config, read: Mapping[str, int | None],
                          handled: Mapping[str, int], deferred: Sequence[str]) -> None:
        """The source versions this run fully handled (`handled`, ledger keys), for the
        next run's history; a source whose removals were `deferred` (names) keeps the
        version last fully handled. Nothing when no source has a history (`read`)."""
        if all(v is None for v in read.values()):
            return
        keep = {version_key(s) for s in cfg.sources if s.name in deferred}
        kept = {k: v for k, v in self.source_versions().items() if k in keep}
        self.record_versions({**kept, **handled})

    def check_quiet(self, cfg: Config, table_versions: TableVersions,
                    curated_exists: Callable[[], bool]) -> Quiet:
        """Tonight's key -- the sources listed before any table is read, then the
        manifest's and the takedowns' versions (`table_versions`) -- and the last run's
        figures when it left the same key."""
        sources = _sources_key(cfg)
        if sources is None:
            return Quiet(None, None)
        key = _quiet_key(sources, *table_versions())
        if key["manifest"] is None or not curated_exists():
            return Quiet(key, None)
        return Quiet(key, self.quiet.load(key))

    def remember_quiet(self, spark: SparkSession, cfg: Config, quiet: Quiet, *,
                       versions: Mapping[str, int | None], listed: Mapping[str, int],
                       outcome_rows: Sequence, deferred: Sequence[str],
                       handled: Mapping[str, int], table_versions: TableVersions) -> None:
        """Written after the run's last commit, when a rerun on the same listing would
        find every record unchanged: nothing processed is retried (or a second copy of
        a key), no source's removals were `deferred`, no source table moved between its
        digest and its read (`versions`). `listed`: per source, the records listed or
        skipped whole; `handled`: the source versions fully handled."""
        if quiet.key is None or deferred or any(
                r["status"] != "ok" and (retried(r["reason"]) or r["reason"] == "duplicate_key")
                for r in outcome_rows):
            self.quiet.clear()
            return
        if any(quiet.key["sources"][name][1] != f"version {v}"
               for name, v in versions.items() if v is not None):
            self.quiet.clear()  # the table moved between the digest and the read
            return
        scans = {}
        for s in cfg.sources:
            version = versions.get(s.name)
            scans[s.name] = ("kept" if s.on_removed == "keep" else "listing" if version is None
                             else adapter_for(s.kind).deleted_keys(spark, s, version,
                                                                   version)[1])
        self.quiet.save(_quiet_key(quiet.key["sources"], *table_versions()),
                        {"unchanged": {s.name: listed.get(s.name, 0) for s in cfg.sources},
                         "scans": scans, "versions": dict(handled)})


def _containers_key(manifest_version: int) -> dict:
    """Only the manifest's version: a file's size and mtime mean the same to every
    release (an upgrade does not reread what an unchanged record would not either)."""
    return {"manifest": int(manifest_version)}


def _sources_key(cfg: Config) -> dict[str, list[str]] | None:
    out = {}
    for s in cfg.sources:
        digest = adapter_for(s.kind).listing_digest(s)
        if digest is None:
            return None
        out[s.name] = [hashlib.sha256(s.model_dump_json().encode()).hexdigest()[:16], digest]
    return out


def _quiet_key(sources: dict, manifest_version: int | None,
               takedowns_version: int | None) -> dict:
    return {"sources": sources, "manifest": manifest_version,
            "takedowns": takedowns_version, "code": code_version()}
