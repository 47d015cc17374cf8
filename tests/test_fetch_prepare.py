"""Fetch and prepare in one batch function (udfs/ingest.py, run by
etl.transforms.prepare.fetch_and_prepare in a mapInArrow): the batch function on Arrow
batches without Spark (a fetched URL, a 404 from the loopback server, a corrupt and an
embedded image, a row not to process, one batch fetched ahead, a bug of ours), then in
Spark: the same outcome as the two UDFs it replaced (fetch, sha2, refusal by hash,
prepare), a takedown by the source bytes' hash after the prepare, one Python function in
the plan, and the tasks writing the rows they accept as Spark would store them."""

from __future__ import annotations

import hashlib
import io

import pyarrow as pa
import pytest
from httpserver import Server
from PIL import Image
from pyspark.sql import functions as F
from support import jpeg_bytes, non_null_fields, png_bytes

from etl.config import FetchConfig, PrepareConfig, SourceConfig
from udfs.fetch import RefRules, rules_for
from udfs.ingest import FETCH_PREPARE_ARROW, FETCH_PREPARE_TYPE, fetch_prepare_batches

LOOPBACK = ["127.0.0.1/32"]
FETCH = FetchConfig(retries=0, timeout_s=2.0, allow_networks=LOOPBACK)
PREPARE = PrepareConfig(min_side=8, threads=1)
WEB = SourceConfig(name="web", kind="table", path="/x", columns={"key": "k", "url": "u"})
RULES = {"web": rules_for(WEB)}
PHOTO = jpeg_bytes((64, 48), color=(200, 30, 30))
EMBEDDED = png_bytes((40, 30))
CORRUPT = b"\x89PNG but not really an image"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def server():
    with Server() as srv:
        srv.files["a.jpg"] = PHOTO
        yield srv


_ARG_TYPES = (pa.bool_(), pa.string(), pa.string(), pa.int64(), pa.int64(), pa.binary())


def _batch(rows):
    """(process, source, ref, offset, length, image) as Arrow arrays, as the task's
    batch_args gives them."""
    cols = list(zip(*rows, strict=True))
    return tuple(pa.array(c, t) for c, t in zip(cols, _ARG_TYPES, strict=True))


def _rows(batch: pa.RecordBatch) -> list[dict]:
    return batch.to_pylist()


def test_one_batch_fetches_hashes_and_prepares(server):
    batch = _batch([
        (True, "web", f"{server.url}/img/a.jpg", None, None, None),  # fetched
        (True, "web", f"{server.url}/404", None, None, None),  # a 404
        (True, "web", None, None, None, CORRUPT),  # carries bytes that are no image
        (True, "web", None, None, None, EMBEDDED),  # carries its image
        (False, "web", None, None, None, None),  # an earlier failure: not processed
        (True, "web", None, None, None, None),  # readable, but nothing at all
    ])
    results = list(fetch_prepare_batches(iter([batch]), FETCH, RULES, PREPARE))
    assert len(results) == 1
    assert results[0].schema.names == FETCH_PREPARE_TYPE.fieldNames()
    assert results[0].schema == FETCH_PREPARE_ARROW
    fetched, missing, corrupt, embedded, skipped, empty = _rows(results[0])

    assert (fetched["fetch_status"], fetched["fetch_attempts"]) == ("ok", 1)
    assert fetched["original_sha256"] == sha(PHOTO)
    assert (fetched["status"], fetched["original_format"]) == ("ok", "JPEG")
    assert (fetched["width"], fetched["height"]) == (64, 48)
    assert fetched["image_sha256"] == sha(fetched["image"])
    assert Image.open(io.BytesIO(fetched["image"])).size == (64, 48)
    assert fetched["original_size_bytes"] == len(PHOTO)

    assert (missing["fetch_status"], missing["fetch_attempts"]) == ("http_404", 1)
    assert missing["original_sha256"] is None  # nothing was fetched: nothing hashed
    assert all(missing[f] is None for f in ("status", "reason", "image", "width", "flags"))

    assert corrupt["fetch_status"] is None and corrupt["original_sha256"] == sha(CORRUPT)
    assert (corrupt["status"], corrupt["reason"]) == ("rejected", "undecodable")
    assert corrupt["image"] is None and corrupt["original_size_bytes"] == len(CORRUPT)

    assert embedded["fetch_status"] is None and embedded["original_sha256"] == sha(EMBEDDED)
    assert (embedded["status"], embedded["original_format"]) == ("ok", "PNG")
    assert (embedded["width"], embedded["height"], embedded["keep"]) == (40, 30, True)
    assert embedded["image"][:2] == b"\xff\xd8"

    assert all(v is None for v in skipped.values())
    assert empty["fetch_status"] is None and empty["original_sha256"] is None
    assert (empty["status"], empty["reason"]) == ("rejected", "empty")
    assert server.hits["/img/a.jpg"] >= 1 and server.hits["/404"] >= 1


def test_a_member_s_byte_range_is_fetched_and_prepared(tmp_path):
    """A reference with an offset and a length (a tar member) reads just those bytes:
    the offsets arrive as Arrow's integers."""
    shard = tmp_path / "shard.bin"
    head = b"x" * 1000
    shard.write_bytes(head + PHOTO + b"y" * 10)
    batch = _batch([(True, "own", str(shard), len(head), len(PHOTO), None)])
    (row,) = _rows(next(fetch_prepare_batches(iter([batch]), FETCH, {"own": RefRules()},
                                              PREPARE)))
    assert (row["fetch_status"], row["original_sha256"]) == ("ok", sha(PHOTO))
    assert (row["status"], row["width"], row["height"]) == ("ok", 64, 48)
    assert row["original_size_bytes"] == len(PHOTO)


def test_the_next_batch_is_fetched_before_this_one_is_returned(server, tmp_path):
    files = []
    for i in range(7):
        path = tmp_path / f"f{i}.jpg"
        if i != 4:  # one file does not exist
            path.write_bytes(jpeg_bytes((16 + i, 12), color=(i * 30, 10, 10)))
        files.append(path)
    rules = {"list": RefRules(own=False, local=True)}
    batches = [[(True, "list", str(p), None, None, None) for p in files[i:i + 3]]
               for i in range(0, 7, 3)]  # 3 + 3 + 1 rows
    pulled = []

    def feed():
        for b in batches:
            pulled.append(len(b))
            yield _batch(b)

    out = []
    for result in fetch_prepare_batches(feed(), FETCH, rules, PREPARE):
        # A batch is returned only once the one after it was taken (and its fetches
        # started): the first result comes after the second batch was pulled.
        assert len(pulled) == min(len(batches), len(out) + 2)
        out.extend(_rows(result))
    assert [len(b) for b in batches] == pulled and len(out) == len(files)
    for path, row in zip(files, out, strict=True):
        if path.exists():
            assert row["original_sha256"] == sha(path.read_bytes())
            assert (row["status"], row["width"]) == ("ok", Image.open(path).width)
        else:
            assert (row["fetch_status"], row["status"]) == ("missing_file", None)


def test_a_prepare_bug_is_internal_error_and_a_wiring_bug_fails(monkeypatch):
    from udfs import images

    batch = _batch([(True, "web", None, None, None, EMBEDDED)])

    def broken(data, opts):
        return {}["no such key"]  # a bug in our own prepare code

    monkeypatch.setattr(images, "prepare_image", broken)
    (row,) = _rows(next(fetch_prepare_batches(iter([batch]), FETCH, RULES, PREPARE)))
    assert (row["status"], row["reason"]) == ("error", "internal_error")
    assert row["detail"].startswith("KeyError: 'no such key'")
    assert row["original_sha256"] == sha(EMBEDDED)  # the bytes were there
    monkeypatch.undo()
    # A row of a source the UDF was not given rules for is our bug: the task fails.
    with pytest.raises(KeyError):
        list(fetch_prepare_batches(iter([batch]), FETCH, {}, PREPARE))


# ------------------------------------------------------------------------ in Spark

COLUMNS = ("sample_id string, source string, image_bytes binary, image_ref string, "
           "image_offset long, image_length long, read_status string, read_reason string")


def _frame(spark, server, tmp_path):
    (tmp_path / "b.jpg").write_bytes(PHOTO)
    return spark.createDataFrame([
        ("fetched", "web", None, f"{server.url}/img/a.jpg", None, None, "ok", None),
        ("missing", "web", None, f"{server.url}/404", None, None, "ok", None),
        ("refused", "web", None, f"{server.url}/img/a.jpg", None, None, "ok", None),
        ("local", "web", None, (tmp_path / "b.jpg").as_uri(), None, None, "ok", None),
        ("embedded", "web", EMBEDDED, None, None, None, "ok", None),
        ("corrupt", "web", CORRUPT, None, None, None, "ok", None),
        ("dup", "web", EMBEDDED, None, None, None, "rejected", "duplicate_key"),
        ("none", "web", None, None, None, None, "ok", None),
    ], COLUMNS)


def _refused(spark, hashes):
    return spark.createDataFrame([("image_sha256", h, "req-1") for h in hashes],
                                 "kind string, value string, request_id string")


def _outcome(df):
    return {r.sample_id: (r.status, r.stage, r.reason, r.read_status, r.read_reason,
                          r.fetch_failed, r.fetch_detail, r.takedown_detail,
                          r.original_sha256,
                          None if r.prepared is None else r.prepared.asDict())
            for r in df.collect()}


def _refused_by_hash(spark, server, tmp_path):
    """_frame's rows, the row "refused" fetching other.jpg, whose bytes' hash a takedown
    names (no key or URL gives it away); the fetch settings and sources to run them."""
    server.files["other.jpg"] = jpeg_bytes((20, 20), color=(1, 2, 3))
    df = _frame(spark, server, tmp_path).withColumn(
        "image_ref", F.when(F.col("sample_id") == "refused",
                            F.lit(f"{server.url}/img/other.jpg")).otherwise(F.col("image_ref")))
    refused = _refused(spark, [sha(server.files["other.jpg"])])
    return (df, refused, FetchConfig(retries=0, allow_networks=LOOPBACK),
            [WEB.model_copy(update={"allow_local": True})])


def test_one_udf_ends_as_the_two_did_and_refuses_by_hash_after_preparing(
        spark, server, tmp_path):
    from etl.transforms.bronze import refuse_taken_down
    from etl.transforms.fetch import fetch_images
    from etl.transforms.prepare import fetch_and_prepare, prepare_images, prepared_outcomes

    df, refused, opts, sources = _refused_by_hash(spark, server, tmp_path)

    fused = fetch_and_prepare(df, opts, sources, PREPARE)
    assert "image_bytes" not in fused.columns
    final = prepared_outcomes(refuse_taken_down(fused, refused, by_hash=True))
    plan = final._jdf.queryExecution().executedPlan().toString()
    assert plan.count("MapInArrow") == 1, plan  # one Python function, below the join
    new = _outcome(final)
    # The two-UDF path it replaces: fetch (bytes back to Spark), sha2, refuse, prepare.
    old_rows = fetch_images(df, opts, sources).withColumn(
        "original_sha256",
        F.when(F.col("image_bytes").isNotNull(), F.sha2(F.col("image_bytes"), 256)))
    old = _outcome(prepare_images(refuse_taken_down(old_rows, refused, by_hash=True),
                                  PREPARE))
    assert new == old

    status = {k: v[:3] for k, v in new.items()}
    assert status == {
        "fetched": ("ok", "prepare", None),
        "missing": ("rejected", "ingest", "http_404"),  # curate marks it stage fetch
        "refused": ("rejected", "ingest", "taken_down"),
        "local": ("ok", "prepare", None),
        "embedded": ("ok", "prepare", None),
        "corrupt": ("rejected", "prepare", "undecodable"),
        "dup": ("rejected", "ingest", "duplicate_key"),
        "none": ("rejected", "prepare", "empty"),
    }
    # Hashes of the source bytes, computed here with hashlib.
    assert {k: v[8] for k, v in new.items()} == {
        "fetched": sha(PHOTO), "missing": None, "refused": sha(server.files["other.jpg"]),
        "local": sha(PHOTO), "embedded": sha(EMBEDDED), "corrupt": sha(CORRUPT),
        "dup": sha(EMBEDDED), "none": None}
    # The refused row was prepared in the UDF, yet nothing of it is left.
    assert new["refused"][9] is None and new["refused"][7] == (
        "takedown req-1: same image sha256")
    assert new["missing"][5:7] == (True, "Not Found")  # the server's reason phrase
    assert new["dup"][9] is None and new["missing"][9] is None
    assert new["fetched"][9]["image_sha256"] == sha(new["fetched"][9]["image"])


def test_on_the_driver_the_same_rows_come_out_with_no_python_udf_in_the_plan(
        spark, server, tmp_path, monkeypatch):
    import etl.transforms.prepare as prep
    from etl.transforms.bronze import refuse_taken_down

    df, refused, opts, sources = _refused_by_hash(spark, server, tmp_path)

    def final(on_driver):
        return prep.prepared_outcomes(refuse_taken_down(
            prep.fetch_and_prepare(df, opts, sources, PREPARE, on_driver=on_driver),
            refused, by_hash=True))

    in_spark = _outcome(final(False))
    monkeypatch.setattr(prep, "_DRIVER_BATCH", 3)  # 8 rows: three batches, one behind
    here = final(True)
    plan = here._jdf.queryExecution().executedPlan().toString()
    assert "EvalPython" not in plan and "MapInArrow" not in plan, plan
    assert _outcome(here) == in_spark
    assert in_spark["fetched"][0] == "ok" and in_spark["missing"][2] == "http_404"
    empty = prep.fetch_and_prepare(df.limit(0), opts, sources, PREPARE, on_driver=True)
    assert empty.schema == prep.fetch_and_prepare(df, opts, sources, PREPARE).schema
    assert empty.collect() == []


def test_many_batches_in_one_task_keep_each_row_with_its_image(spark, tmp_path):
    from etl.transforms.prepare import fetch_and_prepare, prepared_outcomes

    files = []
    for i in range(11):
        path = tmp_path / f"f{i:02d}.png"
        if i % 5 != 2:  # two files do not exist
            path.write_bytes(png_bytes((10 + i, 9)))
        files.append(path)
    listed = spark.createDataFrame(
        [(f"id{i}", "list", str(p), "ok") for i, p in enumerate(files)],
        "sample_id string, source string, image_ref string, read_status string",
    ).select("sample_id", "source", "image_ref",
             F.lit(None).cast("long").alias("image_offset"),
             F.lit(None).cast("long").alias("image_length"),
             F.lit(None).cast("binary").alias("image_bytes"),
             "read_status", F.lit(None).cast("string").alias("read_reason"))
    source = SourceConfig(name="list", kind="table", path=str(tmp_path / "l.parquet"),
                          columns={"key": "k", "url": "u"}, allow_local=True)
    before = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "3")  # 4 batches
    try:
        out = prepared_outcomes(fetch_and_prepare(
            listed.coalesce(1), FetchConfig(retries=0), [source], PREPARE))
        plan = out._jdf.queryExecution().executedPlan().toString()
        rows = {r.image_ref: r for r in out.collect()}
    finally:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", before)
    assert plan.count("MapInArrow") == 1 and "EvalPython" not in plan, plan
    assert len(rows) == len(files)
    for i, path in enumerate(files):
        row = rows[str(path)]
        if path.exists():
            assert row.original_sha256 == sha(path.read_bytes())
            assert (row.status, row.prepared.width, row.prepared.height) == ("ok", 10 + i, 9)
        else:
            assert (row.status, row.reason, row.fetch_failed) == (
                "rejected", "missing_file", True)
            assert row.prepared is None and row.original_sha256 is None


@pytest.mark.parametrize("batch_rows", ["3", "1"])
def test_tasks_write_the_rows_they_accept_as_spark_would_store_them(spark, server, tmp_path,
                                                                    batch_rows):
    """With a sink, each task writes the rows it accepts (here a Lance append): the rows
    stored are, byte for byte, what accepted_rows makes of the same rows prepared
    without one; a row refused by its source bytes' hash or by its JPEG's is not
    written; every row says whether it was, in agreement with its final status. In
    batches of 3 rows some of a batch are accepted; of 1 row, all of it or none."""
    from datetime import datetime

    import lance
    from pyspark.sql import types as T
    from pyspark.sql.pandas.types import to_arrow_schema

    import etl.transforms.prepare as prep
    from etl.schema import UPSTREAM_FIELDS
    from etl.transforms.bronze import refuse_prepared, refuse_taken_down
    from etl.transforms.prepare_task import FLAG, WRITTEN, RowSink
    from etl.writers.lance import pending_append
    from udfs.images import prepare_image

    df, _, opts, sources = _refused_by_hash(spark, server, tmp_path)
    df = df.withColumns({
        "source_key": F.concat(F.lit("key-"), "sample_id"),
        "source_uri": F.coalesce("image_ref", F.lit("embedded")),
        "caption_original": F.concat(F.lit("a photo: "), "sample_id"),
        "license": F.when(F.col("sample_id") == "local", F.lit("cc-by")),
        "metadata_json": F.lit("{}"),
        **{f.name: F.lit(None).cast(f.dataType) for f in UPSTREAM_FIELDS},
    }).withColumn("upstream_quality", F.when(F.col("sample_id") == "fetched", F.lit(0.25))
                  .when(F.col("sample_id") == "local", F.lit(float("nan"))))
    # Refused: other.jpg's source bytes (row "refused") and the JPEG the embedded PNG
    # becomes (row "embedded": known only once prepared).
    jpeg = prepare_image(EMBEDDED, PREPARE).image_sha256
    hashes = [sha(server.files["other.jpg"]), jpeg]
    refused = _refused(spark, hashes)
    now = datetime(2026, 12, 2, 3, 4, 5, 678901)
    extra = tuple(f.name for f in UPSTREAM_FIELDS)

    def final(sink):
        out = prep.fetch_and_prepare(df.coalesce(1), opts, sources, PREPARE, sink=sink)
        return refuse_prepared(prep.prepared_outcomes(
            refuse_taken_down(out, refused, by_hash=True)), refused)

    plain = final(None)
    expected = prep.accepted_rows(plain, run_id="r1", ingested_at=F.lit(now), extra=extra)
    schema = prep.curated_schema(df.schema, extra=extra)
    assert schema == expected.schema  # known before anything runs
    path = str(tmp_path / "curated.lance")
    pending = pending_append(path, to_arrow_schema(schema))
    sink = RowSink(pending.write_task, pending.schema, "r1", T.TimestampType().toInternal(now),
                   spark.sparkContext.broadcast(frozenset(hashes)))
    before = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", batch_rows)
    try:
        rows = final(sink).collect()
    finally:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", before)
    status = {r.sample_id: r.status for r in rows}
    assert {k for k, v in status.items() if v == "ok"} == {"fetched", "local"}
    assert status["embedded"] == "rejected" and status["refused"] == "rejected"
    assert {r.sample_id: r[FLAG] for r in rows} == {k: v == "ok" for k, v in status.items()}
    lists = [r[WRITTEN] for r in rows if r[WRITTEN] is not None]
    assert len(lists) == 1  # one task, its fragments listed once
    assert all(r.prepared is None or r.prepared.image is None for r in rows)
    pending.commit(lists)
    got = lance.dataset(path).to_table().sort_by("sample_id")
    want = expected.toArrow().sort_by("sample_id")
    assert got.schema.names == want.schema.names
    assert got.num_rows == 2
    for name in want.schema.names:  # NaN != NaN: compare as text
        assert str(got.column(name).to_pylist()) == str(want.column(name).to_pylist()), name
    # Apart from the images, the outcome is the one without a sink.
    without_images = {k: v[:9] + (None if v[9] is None else {**v[9], "image": None},)
                      for k, v in _outcome(plain).items()}
    assert {r.sample_id: _outcome_row(r) for r in rows} == without_images


def _outcome_row(r):
    return (r.status, r.stage, r.reason, r.read_status, r.read_reason, r.fetch_failed,
            r.fetch_detail, r.takedown_detail, r.original_sha256,
            None if r.prepared is None else r.prepared.asDict())


def test_the_result_type_is_nullable_throughout_and_holds_the_prepared_fields():
    from udfs.images import PREPARED_TYPE

    assert non_null_fields(FETCH_PREPARE_TYPE) == []  # Spark 4.0: udfs/arrow_types.py
    assert FETCH_PREPARE_TYPE.names == ["fetch_status", "fetch_detail", "fetch_attempts",
                                        "original_sha256", *PREPARED_TYPE.names]
    assert non_null_fields(PREPARED_TYPE)  # the declared type itself is unchanged
