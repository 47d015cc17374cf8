"""The notebooks in notebooks/, executed headlessly (nbclient, the venv's kernel) on a
small curated table, so they cannot rot."""

from __future__ import annotations

import os

import nbformat
import pytest
import yaml
from conftest import REPO, make_config
from lakehouse_data import ROWS, write_curated
from nbclient import NotebookClient

from etl import tables
from etl.schema import REJECTS_SCHEMA


@pytest.fixture(scope="module")
def conf_file(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("notebooks")
    raw = {
        "storage": {"root": str(root / "data")},
        "spark": {
            "master": "local[2]",
            "jars_dir": str(REPO / ".jars"),
            "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false",
                     "spark.driver.memory": "1g"},
        },
        "sources": [{"name": "dummy", "kind": "image_folder", "path": str(root)}],
    }
    path = root / "conf.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = make_config(root / "data")
    write_curated(spark, tables.layout(cfg).curated, ROWS[:16], parts=2)
    write_curated(spark, tables.layout(cfg).curated, ROWS, parts=2)
    rejects = [("a" * 32, "photos", "bad", None, "prepare", "truncated", None, "run-1")]
    spark.createDataFrame(rejects, REJECTS_SCHEMA).write.format("delta").save(
        tables.layout(cfg).rejects
    )
    return path


def _execute(name: str, conf_file) -> nbformat.NotebookNode:
    nb = nbformat.read(REPO / "notebooks" / name, as_version=4)
    env_before = os.environ.get("LAKESHARD_CONF")
    os.environ["LAKESHARD_CONF"] = str(conf_file)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
    )
    try:
        NotebookClient(nb, kernel_name="python3", timeout=600,
                       resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("LAKESHARD_CONF", None)
        else:
            os.environ["LAKESHARD_CONF"] = env_before
    return nb


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") or o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.slow
def test_exploration_notebook_executes(conf_file):
    nb = _execute("explore_curated.ipynb", conf_file)
    text = _text(nb)
    assert f"{len(ROWS)} rows" in text  # the table it opened is ours, latest version
    grid = next(c for c in nb.cells if "shown = len(rows)" in c.source)
    result = [o for o in grid.outputs if o["output_type"] == "execute_result"]
    assert result[0]["data"]["text/plain"] == "12"
    assert _images(nb) >= 2  # the grid and the distributions were drawn


@pytest.mark.slow
def test_sql_notebook_executes(conf_file):
    nb = _execute("sql_recipes.ipynb", conf_file)
    text = _text(nb)
    # The time-travel cell: version 1 had 16 rows, the latest has all of them.
    assert "rows_then|rows_now" in text.replace(" ", "")
    assert f"|16|{len(ROWS)}|" in text.replace(" ", "")
    assert "truncated" in text and _images(nb) >= 1
