"""The caption stage on local[2]: one model copy per task slot, and the GPU a task may use.

The table has 8 fragments, so the stage runs 8 tasks on the session's 2 task slots
(tests/conftest.py's `spark` is local[2]); each slot's Python worker must load the model
once and keep it, whatever ran in the worker pool before.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import shutil  # noqa: E402

import lance  # noqa: E402
import pyarrow as pa  # noqa: E402
import pytest  # noqa: E402
from conftest import make_config  # noqa: E402
from test_caption import PHOTOS, _photo_jpeg, shared_tiny_model  # noqa: E402

from etl import tables  # noqa: E402
from etl.config import ConfigError  # noqa: E402

FRAGMENTS = 8


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return shared_tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def photo_table(tmp_path_factory):
    """A curated-shaped Lance table of 16 real photos at mixed sizes, 2 rows per
    fragment (8 fragments); returns the config root and {sample_id: jpeg}."""
    root = tmp_path_factory.mktemp("pool")
    cfg = make_config(root)
    images = {
        f"id_{i:02d}": _photo_jpeg(PHOTOS[i % len(PHOTOS)], side=(40, 96, 64, 128)[i % 4])
        for i in range(2 * FRAGMENTS)
    }
    n = len(images)
    table = pa.table({
        "sample_id": list(images), "source": ["photos"] * n, "image": list(images.values()),
        "keep": [True] * n, "caption_original": [f"photo {k}" for k in images],
    })
    lance.write_dataset(table, tables.layout(cfg).curated, max_rows_per_file=2)
    assert len(lance.dataset(tables.layout(cfg).curated).get_fragments()) == FRAGMENTS
    return root, images


def _config(root, model: str, name: str, **version):
    settings = {"model": model, "max_new_tokens": 4, "batch_size": 2, "min_pixels": 784,
                "max_pixels": 56 * 56 * 4, **version}
    return make_config(root, caption={"versions": {name: settings}})


@pytest.mark.slow
def test_two_task_slots_load_the_model_twice(spark, photo_table, tiny_model, tmp_path):
    from etl.jobs.caption import caption, format_caption

    root, images = photo_table
    # A model folder no worker has seen: whatever this session's caption pool holds,
    # every worker that captions must load it.
    for run, partitions in (("default", None), ("shuffled", 8)):
        model = str(shutil.copytree(tiny_model, tmp_path / f"model-{run}"))
        cfg = _config(root, model, run, **({"partitions": partitions} if partitions else {}))
        res = caption(spark, cfg, run)
        assert res.statuses == {"ok": len(images)}, run
        assert res.tasks == FRAGMENTS, run  # one per fragment, or `partitions`
        assert res.model_loads == 2, (run, res.workers)
        assert len(res.workers) == 2 and len(res.executors) == 1, run
        assert all(w["model_loads"] == 1 and w["device"] == "cpu"
                   for w in res.workers.values()), run
        assert sum(w["tasks"] for w in res.workers.values()) == FRAGMENTS
        summary = format_caption(res)
        assert "model loads       : 2 in 2 worker(s) on 1 executor(s) (cpu), 8 task(s)" in (
            summary), summary
        assert "  per worker      : 1 (x2)" in summary
    # Every row was captioned once per version, and nothing else changed.
    ds = lance.dataset(tables.layout(cfg).curated)
    got = ds.to_table(columns=["sample_id", "image", "caption_default_status",
                               "caption_shuffled_status"]).to_pylist()
    assert {r["sample_id"]: r["image"] for r in got} == images
    assert all(r["caption_default_status"] == r["caption_shuffled_status"] == "ok" for r in got)


def test_device_cuda_needs_a_gpu_from_spark(spark, photo_table, tiny_model):
    """`device: cuda` is the GPU Spark assigns to the task: the driver refuses a session
    that schedules none, and a task that got none fails naming the settings -- never a
    guess at cuda:0 (no CUDA needed to test either)."""
    from etl.jobs.caption import caption, caption_spec
    from etl.writers.lance import FRAGMENT_ID, ROW_ADDRESS
    from udfs.caption import caption_mapper, output_schema

    root, _ = photo_table
    cfg = _config(root, tiny_model, name="gpu", device="cuda")
    path = tables.layout(cfg).curated
    version = lance.dataset(path).version
    with pytest.raises(ConfigError, match=r"^caption\.versions\.gpu\.device: .*"
                       r"spark\.task\.resource\.gpu\.amount"):
        caption(spark, cfg, "gpu")
    assert lance.dataset(path).version == version  # refused before any work

    # The caption task itself, in a session without GPU scheduling.
    from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

    spec = caption_spec(cfg, cfg.caption.version("gpu"))
    rows = (spark.read.format("lance").option("columns", "sample_id")
            .option("row_address", "true").option("fragment_id", "true").load(path))
    keys = ["sample_id", FRAGMENT_ID]
    mapper = caption_mapper(spec, path, version, keys=keys, row_address=ROW_ADDRESS)
    schema = from_arrow_schema(output_schema(to_arrow_schema(rows.select(*keys).schema)))
    with pytest.raises(Exception, match="Spark assigned this task no GPU") as err:
        rows.limit(1).mapInArrow(mapper, schema).collect()
    for setting in ("spark.task.resource.gpu.amount", "spark.executor.resource.gpu.amount",
                    "spark.executor.resource.gpu.discoveryScript",
                    "caption.versions.gpu.device"):
        assert setting in str(err.value)

    # Latents resolve their device the same way.
    def probe(batches):
        from etl.config import LatentEncoderConfig
        from udfs.latents import _device

        for batch in batches:
            _device(LatentEncoderConfig(name="t5", path="/models/t5", device="cuda"))
            yield batch

    with pytest.raises(Exception, match=r"latents\.encoders\.t5\.device is 'cuda'.*"
                       r"spark\.task\.resource\.gpu\.amount"):
        spark.range(1, numPartitions=1).mapInArrow(probe, "id long").collect()


def test_task_device_outside_spark():
    from udfs.worker import task_device

    assert task_device("cpu", "x.device") == "cpu"
    assert task_device("cuda:1", "x.device") == "cuda:1"  # the driver's machine, no Spark
    with pytest.raises(RuntimeError, match=r"x\.device is 'cuda'.*not a Spark task.*cuda:0"):
        task_device("cuda", "x.device")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        task_device("gpu", "x.device")


def test_caption_device_accepts_cuda_n_and_refuses_other_names(tmp_path):
    cfg = make_config(tmp_path, caption={"versions": {"v": {"model": "m", "device": "cuda:3"}}})
    assert cfg.caption.version("v").device == "cuda:3"
    with pytest.raises(ConfigError, match=r"^caption\.versions\.v\.device"):
        make_config(tmp_path, caption={"versions": {"v": {"model": "m", "device": "gpu0"}}})
    with pytest.raises(ConfigError, match=r"^caption\.versions\.v\.batch_tokens"):
        make_config(tmp_path, caption={"versions": {"v": {"model": "m", "batch_tokens": 0}}})
