"""Source adapters: one per ``kind``, registered in ``SOURCE_KINDS``.

Each adapter turns one configured source into rows of the common source schema
(:data:`etl.schema.SOURCE_SCHEMA`, via :func:`finish_ingest`). Adapters are checked
twice on the driver before any Spark job: ``validate_config`` on the parsed config
alone, ``check_inputs`` against the inputs themselves (paths exist, mapped columns
exist).
"""

from __future__ import annotations

from etl.sources.base import SourceAdapter, finish_ingest, finish_ingest_arrow
from etl.sources.file_table import TableSource
from etl.sources.image_folder import ImageFolderSource
from etl.sources.lake_table import DeltaSource, LanceSource
from etl.sources.webdataset import WebDatasetSource

__all__ = ["SOURCE_KINDS", "SourceAdapter", "finish_ingest", "finish_ingest_arrow", "adapter_for"]

SOURCE_KINDS: dict[str, SourceAdapter] = {
    a.kind: a
    for a in (
        ImageFolderSource(),
        WebDatasetSource(),
        TableSource(),
        DeltaSource(),
        LanceSource(),
    )
}


def adapter_for(kind: str) -> SourceAdapter:
    return SOURCE_KINDS[kind]
