"""Curate's comparison of a folder listing with the manifest, on the driver (delta-rs
reads the manifest's key columns, only new and changed records go through Spark) and in
Spark (a join with the manifest snapshot), gives the same answer on the same tables:
which records are new or changed, how many are unchanged, which left the source. The
expectations are written down from the edits the test makes to the folder."""

from __future__ import annotations

import json
import os

import pytest
from conftest import make_config
from support import photo, photo_folder

from etl import tables
from etl.config import PrepareConfig
from etl.jobs import curate as curate_job
from etl.lakehouse.catalog import Catalog
from etl.lakehouse.curate_state import CurateState
from etl.pipeline.checks import check_sources
from etl.runtime.local import is_local
from etl.schema import sample_id_of
from etl.sources import listing
from etl.sources.file_table import TableSource
from etl.sources.image_folder import ImageFolderSource

pytestmark = pytest.mark.slow


def _diff(spark, cfg, *, driver: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not driver:
            m.setattr(ImageFolderSource, "driver_listing", lambda self, source: None)
        cat = Catalog.of(spark, cfg)
        diff = cat.manifest.diff(cfg, CurateState.of(tables.layout(cfg)))
        removals = diff.removals
        todo = sorted(r.source_key for r in diff.listed.where("NOT unchanged").collect())
        gone = sorted((r.sample_id, r.status) for r in removals.records.collect()) \
            if removals.records is not None else []
        return (diff.in_driver,
                {k: (v["n"], v["unchanged"]) for k, v in diff.stats.items()},
                todo, gone, removals.scans)


def test_driver_and_spark_comparisons_of_a_folder_agree(spark, tmp_path, monkeypatch):
    folder = photo_folder(tmp_path / "photos", 8)  # bad.jpg: rejected as undecodable
    cfg = make_config(tmp_path / "root", [
        {"name": "photos", "kind": "image_folder", "path": str(folder)}])
    check_sources(cfg)
    curate_job.curate(spark, cfg, "night-1")

    (folder / "p8.jpg").write_bytes(photo(8))  # new
    (folder / "p2.jpg").write_bytes(photo(12))  # changed: another size
    st = (folder / "p3.jpg").stat()
    os.utime(folder / "p3.jpg", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched
    (folder / "p1.txt").write_text("another caption, longer")  # a sidecar changed
    (folder / "p4.jpg").unlink()  # removed from the source
    (folder / "bad.jpg").unlink()  # a rejected record removed
    # A record whose last outcome is retried (a transient fetch failure) is read again.
    spark.sql(f"UPDATE delta.`{Catalog.of(spark, cfg).manifest.path}` SET status = "
              f"'rejected', stage = 'fetch', reason = 'timeout' WHERE source_key = 'p5.jpg'")

    driver = _diff(spark, cfg, driver=True, monkeypatch=monkeypatch)
    in_spark = _diff(spark, cfg, driver=False, monkeypatch=monkeypatch)
    assert driver[0] and not in_spark[0]  # each took the path it was meant to
    # A manifest of more rows than driver.ids: the same answer, from Spark's join.
    past_bound = _diff(spark, cfg.model_copy(update={
        "driver": cfg.driver.model_copy(update={"ids": 3})}), driver=True,
        monkeypatch=monkeypatch)
    assert not past_bound[0] and past_bound[1:] == in_spark[1:]
    # Compared here but too many for the driver: Spark's tasks, counted without asking.
    _assert_tasks_counted(spark, cfg.model_copy(update={
        "driver": cfg.driver.model_copy(update={"prepare_rows": 0})}), 5)
    assert driver[1:] == in_spark[1:]
    listed_now = 8  # p0-p3, p5-p8
    todo = ["p1.jpg", "p2.jpg", "p3.jpg", "p5.jpg", "p8.jpg"]
    gone = sorted([(sample_id_of("photos", "p4.jpg"), "accepted"),
                   (sample_id_of("photos", "bad.jpg"), "rejected")])
    assert driver[1:] == ({"photos": (listed_now, listed_now - len(todo))}, todo, gone,
                          {"photos": "listing"})


def test_an_empty_listing_defers_removals_on_the_driver(spark, tmp_path, monkeypatch):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(photo(1))
    cfg = make_config(tmp_path / "root", [
        {"name": "photos", "kind": "image_folder", "path": str(folder)}])
    check_sources(cfg)
    curate_job.curate(spark, cfg, "night-1")
    (folder / "a.jpg").unlink()  # an unmounted volume looks like this
    driver = _diff(spark, cfg, driver=True, monkeypatch=monkeypatch)
    in_spark = _diff(spark, cfg, driver=False, monkeypatch=monkeypatch)
    assert driver[1:] == in_spark[1:] == (
        {}, [], [],
        {"photos": "deferred: the source lists no record at all"})


def test_a_night_lists_each_folder_once_and_reads_what_it_listed(spark, tmp_path,
                                                                  monkeypatch):
    """The quiet-night digest, the comparison with the manifest and the read of the new
    records come from one listing: a folder is walked once a night, and a photo that
    arrives after the walk is the next night's -- not read tonight beside a digest that
    did not see it."""
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(3):
        (folder / f"p{i}.jpg").write_bytes(photo(i))
    cfg = make_config(tmp_path / "root", [
        {"name": "photos", "kind": "image_folder", "path": str(folder)}])
    check_sources(cfg)
    curate_job.curate(spark, cfg, "night-1")

    (folder / "p3.jpg").write_bytes(photo(3))  # new before the night
    walks, made = [], []
    walk, rows = listing._list_files, ImageFolderSource._rows

    def walking(root, follow):
        walks.append(root)
        files = walk(root, follow)
        (folder / "p4.jpg").write_bytes(photo(4))  # arrives just after the walk
        return files

    def making(source):
        made.append(source.path)
        return rows(source)

    with monkeypatch.context() as m:
        m.setattr(listing, "_list_files", walking)
        m.setattr(ImageFolderSource, "_rows", staticmethod(making))
        night = curate_job.curate(spark, cfg, "night-2")
        assert walks == [str(folder)] and made == [str(folder)]
        (c2,) = night.counts
        assert (c2.seen, c2.accepted, c2.unchanged) == (1, 1, 3)  # p3 only: p4 unseen
        walks.clear()
        # Outside a night every listing walks the folder again.
        assert len(ImageFolderSource._listed(cfg.sources[0])) == 5
        assert len(ImageFolderSource._listed(cfg.sources[0])) == 5
        assert len(walks) == 2

    (c3,) = curate_job.curate(spark, cfg, "night-3").counts  # not quiet: p4 is new
    assert (c3.seen, c3.accepted, c3.unchanged) == (1, 1, 4)
    assert curate_job.curate(spark, cfg, "night-4").counts[0].unchanged == 5


def _table_diff(spark, cfg, *, here: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not here:
            m.setattr(TableSource, "lists_in_driver", lambda self, source, skip=frozenset(): False)
        cat = Catalog.of(spark, cfg)
        diff = cat.manifest.diff(cfg, CurateState.of(tables.layout(cfg)))
        removals = diff.removals
        rows = diff.listed.where("NOT unchanged").collect()
        todo = sorted(((r.source_key, r.read_reason, r.image_ref, r.occurrence)
                       for r in rows), key=lambda t: tuple(str(v) for v in t))
        # The rest of each row, as finish_ingest makes it (the same in both ways).
        full = sorted(tuple(str(v) for v in r) for r in rows)
        gone = sorted((r.sample_id, r.status) for r in removals.records.collect()) \
            if removals.records is not None else []
        return (is_local(diff.listed),
                {k: (v["n"], v["unchanged"], v["failures"])
                 for k, v in diff.stats.items()},
                todo, gone, removals.scans, full)


def _jsonl(path, rows) -> None:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))


def test_a_url_list_compared_here_and_in_spark_agree(spark, tmp_path, monkeypatch):
    """A small local URL list is numbered and compared on the driver, as Spark does it:
    repeated keys (the readable copy first), a malformed line, a first run without a
    manifest, then new, retried and removed records, then an unreadable file."""
    lists = tmp_path / "lists"
    lists.mkdir()
    for i in range(6):
        (lists / f"p{i}.jpg").write_bytes(photo(i))
    rows = [{"key": f"k{i}", "url": f"p{i}.jpg", "caption": f"photo {i}"} for i in range(5)]
    rows[0]["lic"] = "cc0-1.0"  # its own licence; the others take the source's
    rows += [{"key": "k1", "url": "missing-elsewhere.jpg"},  # a second copy of k1
             {"key": "k2"},  # a copy of k2 without a reference: rejected, never kept first
             "not json\n"]  # malformed_row
    _jsonl(lists / "a.jsonl", rows)
    cfg = make_config(tmp_path / "root", [
        {"name": "web", "kind": "table", "path": str(lists), "license": "cc-by-4.0",
         "columns": {"key": "key", "url": "url", "caption": "caption", "license": "lic"}}])
    check_sources(cfg)

    here = _table_diff(spark, cfg, here=True, monkeypatch=monkeypatch)
    in_spark = _table_diff(spark, cfg, here=False, monkeypatch=monkeypatch)
    assert here[0] and not in_spark[0]  # each took the path it was meant to
    assert here[1:] == in_spark[1:]
    stats, todo, gone, scans, full = here[1:]
    assert stats == {"web": (8, 0, 0)} and gone == [] and scans == {}
    first = {(k, reason, occ) for k, reason, _, occ in todo}
    assert {k for k, reason, occ in first if occ == 1 and reason is None} == {
        "k0", "k1", "k2", "k3", "k4"}
    assert ("k1", None, 2) in first and ("k2", "missing_image", 2) in first
    assert [(r, o) for k, r, o in first if k.startswith("a.jsonl#")] == [("malformed_row", 1)]
    # The copy of k1 kept is the one whose reference sorts first, as in Spark.
    assert [ref for k, _, ref, occ in todo if k == "k1" and occ == 1] == [
        min(str(lists / "p1.jpg"), str(lists / "missing-elsewhere.jpg"))]
    ids = {r[0] for r in full}  # sample_id, the schema's first column
    assert sample_id_of("web", "k3") in ids and len(ids) == 6
    assert sum("cc0-1.0" in r for r in full) == 1 and sum("cc-by-4.0" in r for r in full) == 7

    curate_job.curate(spark, cfg, "night-1")
    _jsonl(lists / "a.jsonl", [r for r in rows if not isinstance(r, dict) or r.get("key") != "k3"]
           + [{"key": "k5", "url": "p5.jpg"}])  # k3 removed, k5 new
    spark.sql(f"UPDATE delta.`{Catalog.of(spark, cfg).manifest.path}` SET status = "
              f"'rejected', stage = 'fetch', reason = 'timeout' WHERE source_key = 'k4'")
    here = _table_diff(spark, cfg, here=True, monkeypatch=monkeypatch)
    in_spark = _table_diff(spark, cfg, here=False, monkeypatch=monkeypatch)
    assert here[0] and not in_spark[0]
    assert here[1:] == in_spark[1:]
    stats, todo, gone, scans, full = here[1:]
    # 8 listed: k0-k2, k4, k5, the copies of k1 and k2, the malformed line; new: k5;
    # retried: k4; the malformed line is keyed by its line number, which moved.
    assert {k for k, *_ in todo} == {"k4", "k5", "a.jsonl#line7"}
    assert stats == {"web": (8, 5, 0)}
    assert {sid for sid, _ in gone} == {sample_id_of("web", "k3"),
                                        sample_id_of("web", "a.jsonl#line8")}
    assert scans == {"web": "listing"}

    (lists / "b.parquet").write_bytes(b"PAR1 not a parquet file")  # unreadable: removals
    here = _table_diff(spark, cfg, here=True, monkeypatch=monkeypatch)  # wait for a full
    in_spark = _table_diff(spark, cfg, here=False, monkeypatch=monkeypatch)  # listing
    assert here[1:] == in_spark[1:]
    assert here[1]["web"][2] == 1 and here[3] == []
    assert here[4] == {"web": "deferred: 1 record(s) of unreadable files/shards"}


@pytest.mark.parametrize("new, cores, tasks", [
    (0, 16, 1), (40, 2, 1), (600, 2, 2), (2000, 2, 4),  # one task per 512 records
    (600, 16, 5), (1000, 16, 8), (2000, 16, 16),  # idle cores: tasks of >= 128 records
    (10_000, 16, 20), (100, 64, 1),
])
def test_fetch_and_prepare_tasks_per_night(new, cores, tasks):
    assert curate_job._tasks_for(new, cores) == tasks


@pytest.mark.parametrize("configured, cores, tasks, threads", [
    (None, 2, 2, 1), (None, 2, 4, 1), (None, 2, 196, 1),  # tasks fill the cores
    (None, 2, 1, 2), (None, 16, 2, 8), (None, 16, 3, 5),  # idle cores: theirs
    (None, 64, 1, 8),  # at most 8
    (3, 2, 2, 3), (1, 16, 1, 1),  # prepare.threads set: as set
])
def test_threads_per_fetch_and_prepare_task(configured, cores, tasks, threads):
    assert PrepareConfig(threads=configured).task_threads(cores, tasks) == threads


def _assert_tasks_counted(spark, cfg, new):
    """The fetch + prepare tasks counted for a listing compared on the driver are the
    partitions Spark gives its frame."""
    diff = Catalog.of(spark, cfg).manifest.diff(cfg, CurateState.of(tables.layout(cfg)))
    assert diff.in_driver and not diff.small
    assert diff.new_records == new
    cores = spark.sparkContext.defaultParallelism
    todo = curate_job._task_layout(diff.listed.where("NOT unchanged"), diff, cores)
    assert curate_job._fetch_prepare_tasks(diff, todo, cores) == todo.rdd.getNumPartitions()


@pytest.mark.parametrize("rows", [1, 3, 300, 1100])
def test_tasks_of_a_url_list_compared_here_are_counted_without_asking(spark, tmp_path, rows):
    lists = tmp_path / "lists"
    lists.mkdir()
    _jsonl(lists / "a.jsonl", [{"key": f"k{i}", "url": f"p{i}.jpg"} for i in range(rows)])
    cfg = make_config(tmp_path / "root", [
        {"name": "web", "kind": "table", "path": str(lists),
         "columns": {"key": "key", "url": "url"}}], driver={"prepare_rows": 0})
    _assert_tasks_counted(spark, cfg, rows)
