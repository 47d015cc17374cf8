"""Config parsing and validation: every error names its field."""

from __future__ import annotations

import pytest

from etl import tables
from etl.config import ConfigError, load_config, parse_config
from etl.pipeline.preflight import check_config


def _raw(tmp_path, **over):
    raw = {
        "storage": {"root": str(tmp_path / "out")},
        "sources": [{"name": "pics", "kind": "image_folder", "path": str(tmp_path)}],
    }
    raw.update(over)
    return raw


def test_embedded_default_parses_with_a_sample_source_of_each_kind():
    cfg = load_config(None)
    kinds = {s.kind for s in cfg.sources}
    assert kinds == {"image_folder", "table", "webdataset", "delta", "lance"}
    assert all(s.sample for s in cfg.sources)
    assert cfg.prepare.jpeg_quality == 92
    assert list(cfg.exports) == ["default"]


def test_output_layout_under_root(tmp_path):
    cfg = parse_config(_raw(tmp_path))
    root = str(tmp_path / "out")
    paths = tables.layout(cfg)
    assert paths.curated == f"{root}/lance/default/curated.lance"
    assert paths.rejects == f"{root}/delta/rejects"
    assert paths.manifest == f"{root}/delta/manifest"
    assert paths.export_dir("x") == f"{root}/mds/x"
    assert paths.reports_dir == f"{root}/reports"


def test_relative_root_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = parse_config(_raw(tmp_path, storage={"root": "rel"}))
    assert cfg.storage.root == str(tmp_path / "rel")


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda r: r.update(bogus=1), "config: unknown key 'bogus'"),
        (lambda r: r["storage"].update(rooot="x"), "storage: unknown key 'rooot'"),
        (lambda r: r["storage"].pop("root"), "storage.root: required"),
        (
            lambda r: r["sources"][0].update(kind="ftp"),
            "sources[0] (pics).kind: unknown kind 'ftp'",
        ),
        (lambda r: r["sources"][0].pop("path"), "sources[0] (pics).path: required"),
        (lambda r: r["sources"][0].update(colour=1), "sources[0] (pics): unknown key 'colour'"),
        (lambda r: r["sources"].append(dict(r["sources"][0])), "sources[1].name: duplicate"),
        (lambda r: r.update(prepare={"jpeg_quality": 101}), "prepare.jpeg_quality: must be <= 100"),
        (lambda r: r.update(prepare={"threads": 0}), "prepare.threads: must be >= 1"),
        (lambda r: r.update(prepare={"threads": "2"}), "prepare.threads: expected an integer"),
        (lambda r: r.update(caption={"versions": {"a": {"model": "m", "backend": "vllm"}}}),
         "caption.versions.a.device: the vllm backend needs device: cuda"),
        (lambda r: r.update(dedup={"threshold": 6, "bands": 6}), "dedup.bands: must be greater"),
        (lambda r: r.update(exports={"a": {"compression": "lz9"}}), "exports.a.compression"),
        (lambda r: r.update(sources=[]), "sources: expected a non-empty list"),
    ],
)
def test_bad_config_names_the_field(tmp_path, mutate, needle):
    raw = _raw(tmp_path)
    mutate(raw)
    with pytest.raises(ConfigError) as err:
        check_config(parse_config(raw))
    assert needle in str(err.value)


def test_table_source_requires_key_and_image_mapping(tmp_path):
    raw = _raw(tmp_path)
    raw["sources"] = [
        {"name": "t", "kind": "table", "path": str(tmp_path), "columns": {"image": "jpg"}}
    ]
    with pytest.raises(ConfigError, match=r"sources\[0\] \(t\)\.columns\.key: required"):
        check_config(parse_config(raw))
    raw["sources"][0]["columns"] = {"image": "jpg", "key": "id", "colour": "c"}
    with pytest.raises(ConfigError, match=r"'colour' is not a field a table source can map"):
        check_config(parse_config(raw))


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cluster_templates_parse_and_share_the_local_keys():
    from pathlib import Path

    import yaml

    conf_dir = Path(__file__).resolve().parents[1] / "conf"
    local = yaml.safe_load((conf_dir / "local.yaml").read_text())
    for name in ("databricks.yaml", "emr.yaml"):
        raw = yaml.safe_load((conf_dir / name).read_text())
        assert set(raw) == set(local), name
        cfg = check_config(parse_config(raw))
        assert cfg.spark.jars_dir is None and cfg.exports


def test_driver_bounds_are_one_section_and_the_old_names_still_work(tmp_path):
    """The driver/Spark bounds live in ``driver:``; ``prepare.driver_rows`` and
    ``dedup.driver_max_rows`` of earlier releases are read as two of them, and a bound
    set under both names is an error naming the old one."""
    base = {"storage": {"root": str(tmp_path)},
            "sources": [{"name": "s", "kind": "image_folder", "path": str(tmp_path)}]}
    cfg = parse_config(base)
    assert (cfg.driver.prepare_rows, cfg.driver.plan_rows, cfg.driver.ids,
            cfg.driver.scan_rows) == (256, 50_000, 100_000, 2_000_000)
    old = parse_config({**base, "prepare": {"driver_rows": 3, "jpeg_quality": 90},
                        "dedup": {"driver_max_rows": 7}})
    assert (old.driver.prepare_rows, old.driver.plan_rows) == (3, 7)
    assert old.prepare.jpeg_quality == 90
    assert parse_config({**base, "driver": {"ids": 0}}).driver.ids == 0
    with pytest.raises(ConfigError, match=r"^dedup\.driver_max_rows: is driver\.plan_rows"):
        parse_config({**base, "dedup": {"driver_max_rows": 7}, "driver": {"plan_rows": 8}})
    with pytest.raises(ConfigError, match=r"driver\.prepare_rows: must be <= 4096"):
        parse_config({**base, "driver": {"prepare_rows": 5000}})
    with pytest.raises(ConfigError, match=r"driver: unknown key 'rows'"):
        parse_config({**base, "driver": {"rows": 1}})
