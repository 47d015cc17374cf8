"""VLM re-captioning: a tiny random Qwen2.5-VL built here, real photos, real Spark + Lance.

No model hub is ever reachable: the offline switches are set before anything imports
transformers (and Spark's Python workers inherit them), and every model is a local
folder built in the test by :mod:`etl.tiny_vlm`.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import lance  # noqa: E402
import pytest  # noqa: E402
from conftest import REPO, make_config  # noqa: E402
from PIL import Image  # noqa: E402

from etl import tables  # noqa: E402
from etl.config import DEFAULT_CAPTION_PROMPT, CaptionVersionConfig, ConfigError  # noqa: E402
from udfs.caption import (  # noqa: E402
    CaptionSpec,
    TransformersCaptioner,
    caption_flags,
    caption_images,
    load_image,
)
from udfs.caption_models import pixel_range_kwargs  # noqa: E402
from udfs.captioner import plan_batches  # noqa: E402

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "immunohistochemistry")


def _photo_jpeg(name: str, side: int = 96) -> bytes:
    import skimage.data

    img = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
    img.thumbnail((side, side))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=92)
    return buf.getvalue()


def shared_tiny_model(tmp_path_factory) -> str:
    """The smoke-test model, built once per test session into one folder that every
    caption test module's `tiny_model` fixture returns."""
    from etl.tiny_vlm import ensure_tiny_vlm

    return str(ensure_tiny_vlm(tmp_path_factory.getbasetemp() / "caption-models"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return shared_tiny_model(tmp_path_factory)


def _spec(model: str, **kw) -> CaptionSpec:
    base = dict(name="test", model=model, max_new_tokens=12, batch_size=4,
                min_pixels=28 * 28, max_pixels=56 * 56 * 2)
    settings = CaptionVersionConfig(**{**base, **kw})
    return CaptionSpec(settings=settings, model_path=model, local_files_only=True)


# ------------------------------------------------------------------ pure functions


def test_caption_checks_flag_empty_truncated_loops_and_script():
    ok = "A tabby cat lies on a wooden table next to a cup of coffee, lit from the left."
    assert caption_flags(ok, hit_limit=False, language="en") == []
    assert caption_flags("  \n", hit_limit=False, language="en") == ["empty"]
    assert caption_flags(ok, hit_limit=True, language="en") == ["truncated"]
    loop = "A cat on a table, a red car, a red car, a red car, a red car"
    assert caption_flags(loop, hit_limit=True, language="en") == ["truncated", "repetition"]
    assert "repetition" in caption_flags("ababababababababab", hit_limit=False, language=None)
    # "very very" is English, not a loop.
    assert caption_flags("a very very tall tower", hit_limit=False, language="en") == []
    zh = "一只猫躺在木桌上，旁边有一杯咖啡和一把勺子，光线从左边照进来。"
    assert caption_flags(zh, hit_limit=False, language="en") == ["language_mismatch"]
    assert caption_flags(zh, hit_limit=False, language="zh") == []
    assert caption_flags(zh, hit_limit=False, language=None) == []


def test_load_image_resizes_into_the_pixel_range_and_names_bad_bytes():
    big = load_image(_photo_jpeg("astronaut", side=512), 28 * 28, 100 * 100)
    assert big.mode == "RGB" and big.width * big.height <= 100 * 100 * 1.03
    assert abs(big.width / big.height - 1.0) < 0.02  # the aspect ratio is kept
    small = load_image(_photo_jpeg("chelsea", side=20), 64 * 64, 100 * 100)
    assert small.width * small.height >= 64 * 64 * 0.97
    with pytest.raises(ValueError, match="missing image bytes"):
        load_image(b"", 1, 10)
    with pytest.raises(ValueError, match="undecodable image: UnidentifiedImageError"):
        load_image(b"definitely not a jpeg", 1, 10)


def _raw_caption(version: dict, **extra) -> dict:
    return {"caption": {"versions": {"v1": {"model": "m", **version}}, **extra}}


@pytest.mark.parametrize(
    ("caption", "field"),
    [
        (_raw_caption({"batch_size": 0}), "caption.versions.v1.batch_size"),
        (_raw_caption({"backend": "onnx"}), "caption.versions.v1.backend"),
        (_raw_caption({"backend": "vllm"}), "caption.versions.v1.device"),
        (_raw_caption({"min_pixels": 5000, "max_pixels": 100}), "caption.versions.v1.max_pixels"),
        (_raw_caption({"dtype": "int8"}), "caption.versions.v1.dtype"),
        (_raw_caption({"temperatur": 0.7}), "caption.versions.v1"),
        (_raw_caption({}, default="v2"), "caption.default"),
        ({"caption": {"versions": {"Qwen-VL": {"model": "m"}}}}, "caption.versions.Qwen-VL"),
        ({"caption": {"versions": {"v1": {"prompt": "x"}}}}, "caption.versions.v1.model"),
        (_raw_caption({"kv_cache": "paged"}), "caption.versions.v1.kv_cache"),
        (_raw_caption({"compile": True, "device": "cuda"}), "caption.versions.v1.compile"),
        (_raw_caption({"compile": True, "kv_cache": "static"}), "caption.versions.v1.compile"),
        (_raw_caption({"cache_bucket": 0}), "caption.versions.v1.cache_bucket"),
        (_raw_caption({"vision_attention": "flex"}), "caption.versions.v1.vision_attention"),
        (_raw_caption({"backend": "vllm", "device": "cuda", "kv_cache": "static"}),
         "caption.versions.v1.backend"),
    ],
)
def test_bad_caption_config_names_the_field(tmp_path, caption, field):
    with pytest.raises(ConfigError, match=f"^{field.replace('.', '[.]')}"):
        make_config(tmp_path, **caption)


def test_default_config_has_a_smoke_version_on_cpu():
    from etl.config import load_config

    v = load_config(None).caption.version(None)
    assert (v.name, v.model, v.device, v.backend) == ("smoke", "tiny-qwen2_5_vl", "cpu",
                                                      "transformers")


# ------------------------------------------------------------------ the model, no Spark


def test_caption_images_real_model_bad_rows_and_image_conditioning(tiny_model):
    images = [_photo_jpeg("astronaut"), b"\xff\xd8\xff garbage", None, _photo_jpeg("coffee")]
    spec = _spec(tiny_model)
    out = caption_images(spec, images)
    assert out.status == ["ok", "bad_image", "bad_image", "ok"]
    assert out.error[1].startswith("undecodable image") and out.error[2] == "missing image bytes"
    assert out.caption[1] is None and out.caption[2] is None
    assert all(isinstance(out.caption[i], str) for i in (0, 3))
    assert all(1 <= out.tokens[i] <= spec.settings.max_new_tokens for i in (0, 3))
    # A random model still conditions on the pixels: different photos, different text.
    assert out.caption[0] != out.caption[3]
    # Greedy decoding: the same input gives the same caption, alone or in a batch.
    alone = caption_images(spec, images[3:])
    assert alone.caption == [out.caption[3]]


def test_plan_batches_groups_by_size_within_count_and_token_budget():
    tokens = [4, 16, 6, 12, 16, 1]
    assert plan_batches(tokens, 2) == [[1, 4], [3, 2], [0, 5]]  # largest first
    assert plan_batches(tokens, 2, by_size=False) == [[0, 1], [2, 3], [4, 5]]
    # At most 3 images and 24 padded tokens (size x largest): 16+16 is 32, 12+6 is 24.
    assert plan_batches(tokens, 3, 24) == [[1], [4], [3, 2], [0, 5]]
    assert plan_batches([30, 2], 4, 24) == [[0], [1]]  # over the budget: alone
    assert plan_batches([], 4) == []


def test_pixel_range_reaches_the_processor_as_its_transformers_takes_it(tiny_model):
    from types import SimpleNamespace

    from transformers import AutoProcessor, CLIPImageProcessor

    proc = AutoProcessor.from_pretrained(tiny_model)
    img = Image.new("RGB", (200, 200), (90, 140, 200))

    def grid(**kw):
        out = proc(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[img],
                   return_tensors="pt", **kw)
        return out["image_grid_thw"].tolist()

    # The checkpoint's own range ends at 12,544 px: 200x200 shrinks to 112x112 (8x8
    # patches of 14). Within [784, 40000] it keeps 196x196 (200 rounded to 7 x 28), 14x14
    # patches -- whichever way this transformers takes the range (4.x: min/max_pixels;
    # 5.x: size).
    assert grid() == [[1, 8, 8]]
    assert grid(**pixel_range_kwargs(proc.image_processor, 784, 40000)) == [[1, 14, 14]]
    # transformers 5's Qwen2-VL image processor, as 5.25.0 has it, where this venv has
    # 4.x: no min_pixels attribute; the range is `size`, in pixels.
    v5 = SimpleNamespace(size=SimpleNamespace(shortest_edge=3136, longest_edge=12845056,
                                              height=None, width=None),
                         patch_size=14, merge_size=2)
    assert pixel_range_kwargs(v5, 784, 40000) == {
        "size": {"shortest_edge": 784, "longest_edge": 40000}}
    # Elsewhere shortest_edge is a side in pixels, not an area: nothing is passed.
    clip = CLIPImageProcessor()
    assert clip.size["shortest_edge"] == 224 and not hasattr(clip, "min_pixels")
    assert pixel_range_kwargs(clip, 784, 40000) == {}
    assert pixel_range_kwargs(None, 784, 40000) == {}


def _image_tokens(proc, data: bytes, spec: CaptionSpec) -> int:
    """Image tokens of one image, counted in the processor's own output."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    ids = proc(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[img],
               min_pixels=spec.settings.min_pixels, max_pixels=spec.settings.max_pixels,
               return_tensors="pt")["input_ids"][0]
    return int((ids == proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())


def test_size_grouped_batches_pad_less_and_rows_keep_their_order(tiny_model):
    # Small, large, small, large: table order pairs each small image with a large one.
    images = [_photo_jpeg(n, side) for n, side in
              (("astronaut", 40), ("chelsea", 128), ("coffee", 64), ("rocket", 112))]
    spec = _spec(tiny_model, batch_size=2, min_pixels=28 * 28, max_pixels=200 * 200)
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model)
    tokens = [_image_tokens(proc, b, spec) for b in images]
    assert len(set(tokens)) == 4, tokens

    grouped = caption_images(spec, images)
    in_order = caption_images(spec, images, by_size=False)
    assert grouped.status == in_order.status == ["ok"] * 4
    assert grouped.image_tokens == in_order.image_tokens == tokens
    # Expected padding: each batch pads its rows to its largest image.
    big, small = sorted(range(4), key=lambda i: -tokens[i])[:2], sorted(
        range(4), key=lambda i: -tokens[i])[2:]
    want_grouped = sum(max(tokens[i] for i in b) - tokens[i] for b in (big, small) for i in b)
    want_in_order = sum(max(tokens[i] for i in b) - tokens[i] for b in ([0, 1], [2, 3])
                        for i in b)
    assert sum(grouped.padding) == want_grouped < sum(in_order.padding) == want_in_order
    assert grouped.padding_share == pytest.approx(want_grouped / (want_grouped + sum(tokens)))
    assert grouped.batch[big[0]] == grouped.batch[big[1]] != grouped.batch[small[0]]
    # Row order is restored: each row has the caption its image gets alone.
    assert grouped.caption == [caption_images(spec, [b]).caption[0] for b in images]

    # A token budget as well as a count: no batch of two holds more padded tokens.
    budget = sorted(tokens)[-1] + sorted(tokens)[0]
    capped = caption_images(_spec(tiny_model, batch_size=4, min_pixels=28 * 28,
                                  max_pixels=200 * 200, batch_tokens=budget), images)
    batches: dict[int, list[int]] = {}
    for i, b in enumerate(capped.batch):
        batches.setdefault(b, []).append(tokens[i])
    assert all(len(b) == 1 or len(b) * max(b) <= budget for b in batches.values())
    assert len(batches) > 1 and capped.caption == grouped.caption


class _OomAboveOne(TransformersCaptioner):
    """The real tiny model, but a batch of more than one image runs out of GPU memory."""

    calls: list[int]

    def generate(self, images, spec):
        import torch

        self.calls.append(len(images))
        if len(images) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return super().generate(images, spec)


# Plain generate, and the fast path (static KV cache, the processor run ahead).
PATHS = pytest.mark.parametrize("path", [{}, {"kv_cache": "static", "prepare_ahead": True}],
                                ids=["plain", "fast"])


@PATHS
def test_out_of_memory_halves_the_batch_until_it_fits(tiny_model, path):
    spec = _spec(tiny_model, batch_size=4, **path)
    cap = _OomAboveOne(spec, "cpu")
    cap.calls = []
    images = [_photo_jpeg(n) for n in PHOTOS[:5]]
    out = caption_images(spec, images, cap)
    assert out.status == ["ok"] * 5
    assert cap.calls == [4, 2, 1, 1, 1, 1, 1] and cap.batch_limit == 1
    # A captioner without the limit, on plain generate.
    reference = caption_images(_spec(tiny_model, batch_size=4), images)
    assert out.caption == reference.caption


class _FailsOnTinyImages(TransformersCaptioner):
    """Generation raises for one particular image (a 28x28 one): a row-level bug."""

    def generate(self, images, spec):
        if any(im.size == (28, 28) for im in images):
            raise RuntimeError("shape mismatch in the vision tower")
        return super().generate(images, spec)


@PATHS
def test_a_failing_row_is_isolated_and_the_others_are_captioned(tiny_model, path):
    spec = _spec(tiny_model, batch_size=4, min_pixels=28 * 28, **path)
    tiny = io.BytesIO()
    Image.new("RGB", (28, 28), (9, 9, 9)).save(tiny, format="PNG")
    images = [_photo_jpeg("astronaut"), tiny.getvalue(), _photo_jpeg("rocket")]
    out = caption_images(spec, images, _FailsOnTinyImages(spec, "cpu"))
    assert out.status == ["ok", "failed", "ok"]
    assert out.error[1] == "RuntimeError: shape mismatch in the vision tower"


def test_a_hub_id_is_refused_offline(tiny_model):
    from udfs.caption import get_captioner

    with pytest.raises(OSError):
        hub = CaptionVersionConfig(name="hub", model="Qwen/Qwen2.5-VL-3B-Instruct")
        get_captioner(CaptionSpec(settings=hub, model_path=hub.model), device="cpu")


# ------------------------------------------------------------------ Spark + Lance


def _curated(spark, path: str, corrupt_id: str) -> dict[str, bytes]:
    """A curated-shaped Lance table of real photos in 2 fragments, one image corrupt."""
    images = {f"id_{n}": _photo_jpeg(n) for n in PHOTOS}
    images[corrupt_id] = images[corrupt_id][: len(images[corrupt_id]) // 3]  # truncated
    rows = [
        (sid, "photos", data, 96, 96, 96, 96, f"original caption of {sid}", True)
        for sid, data in images.items()
    ]
    schema = ("sample_id string, source string, image binary, width int, height int, "
              "original_width int, original_height int, caption_original string, keep boolean")
    spark.createDataFrame(rows, schema).repartition(2).write.format("lance").mode(
        "overwrite").save(path)
    return images


def _files(path: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in Path(path, "data").glob("*.lance")}


def _rows(path: str, columns: list[str]) -> dict[str, dict]:
    t = lance.dataset(path).to_table(columns=["sample_id", *columns]).to_pylist()
    return {r.pop("sample_id"): r for r in t}


def test_cli_caption_errors_and_no_op(tmp_path, tiny_model, spark, capsys):
    """`lakeshard caption` (the CLI's `main`, in-process on the shared session): errors
    before any Spark work with exit code 2, then a run with nothing to do."""
    from etl.cli import main
    from etl.columns import caption_columns
    from etl.writers.lance_columns import write_columns

    conf = tmp_path / "c.yaml"
    conf.write_text(json.dumps({
        "storage": {"root": str(tmp_path / "root")},
        "spark": {"master": "local[1]", "jars_dir": str(REPO / ".jars")},
        "sources": [{"name": "s", "kind": "image_folder", "path": str(tmp_path)}],
        "caption": {"versions": {"a": {"model": tiny_model}}},
    }))
    cmd = ["--conf", str(conf), "caption"]
    assert main(cmd) == 2 and "run `lakeshard curate` first" in capsys.readouterr().err
    assert main([*cmd, "--version", "nope"]) == 2
    assert "caption.versions: no version named 'nope'" in capsys.readouterr().err

    # A table where every row already has version `a` (status ok): nothing to do, no
    # Spark job, no new table version.
    from etl.config import load_config
    from etl.jobs.caption import caption_spec

    cfg = load_config(conf)
    spec = caption_spec(cfg, cfg.caption.version("a"))
    path = tables.layout(cfg).curated
    _curated(spark, path, corrupt_id="id_camera")
    cols = caption_columns("a")
    values = {"caption_a": "x", "caption_a_status": "ok", "caption_a_model": tiny_model,
              "caption_a_prompt_sha256": spec.settings.prompt_sha256,
              "caption_a_params": spec.settings.params_json()}
    done = spark.createDataFrame(
        [(f"id_{n}", *values.values()) for n in PHOTOS],
        "sample_id string, " + ", ".join(f"{c} {cols[c]}" for c in values),
    )
    write_columns(spark, path, done)
    version = lance.dataset(path).version
    capsys.readouterr()
    assert main(cmd) == 0
    out = capsys.readouterr().out
    assert "rows to caption   : 0 of 6" in out and "nothing to do" in out
    assert "model loads" not in out and lance.dataset(path).version == version
    report = out.split("report            : ")[1].strip()
    assert json.loads(Path(report).read_text())["todo"] == 0


@pytest.mark.slow
def test_caption_job_adds_versions_without_rewriting_images_and_resumes(
    spark, tmp_path, tiny_model
):
    from etl.columns import caption_columns
    from etl.jobs.caption import caption
    from etl.writers.lance_columns import write_columns

    prompt_b = "Describe the colours."
    cfg = make_config(
        tmp_path,
        caption={"versions": {
            "a": {"model": tiny_model, "max_new_tokens": 16, "batch_size": 2,
                  "min_pixels": 784, "max_pixels": 6272},
            "b": {"model": tiny_model, "prompt": prompt_b, "max_new_tokens": 8,
                  "min_pixels": 784, "max_pixels": 6272, "where": "sample_id = 'id_coffee'"},
        }},
        exports={"default": {"captions": {"caption": "caption_a"}, "partitions": 1}},
    )
    path = tables.layout(cfg).curated
    images = _curated(spark, path, corrupt_id="id_camera")
    before = _files(path)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "2")  # several batches
    try:
        res = caption(spark, cfg, "a")
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")

    # Image data files: the same files, byte for byte; only new column files were added.
    after = _files(path)
    assert {k: after[k] for k in before} == before and len(after) > len(before)
    ds = lance.dataset(path)
    assert ds.count_rows() == len(images) and ds.version == res.version_after
    assert dict(zip(*ds.to_table(columns=["sample_id", "image"]).to_pydict().values(),
                    strict=True)) == images

    cols = list(caption_columns("a"))
    got = _rows(path, cols)
    assert res.todo == res.captioned == len(images)
    assert res.statuses == {"ok": len(images) - 1, "bad_image": 1}
    bad = got["id_camera"]
    assert bad["caption_a"] is None and bad["caption_a_status"] == "bad_image"
    assert bad["caption_a_error"].startswith("undecodable image")
    sha = hashlib.sha256(DEFAULT_CAPTION_PROMPT.encode()).hexdigest()
    for sid, row in got.items():
        assert row["caption_a_model"] == tiny_model and row["caption_a_prompt_sha256"] == sha
        params = json.loads(row["caption_a_params"])
        assert params["max_new_tokens"] == 16 and params["max_pixels"] == 6272
        assert row["caption_a_at"] is not None
        if sid != "id_camera":
            assert row["caption_a_status"] == "ok" and isinstance(row["caption_a"], str)
            assert 1 <= row["caption_a_tokens"] <= 16
    # The model loaded once per Python worker, not once per batch.
    assert res.workers and all(w["model_loads"] == 1 for w in res.workers.values())
    assert res.batches == sum(w["batches"] for w in res.workers.values()) > len(res.workers)
    assert res.image_tokens > 0 and 0 <= res.padding_share < 1

    # A rerun finds nothing to do and commits nothing.
    again = caption(spark, cfg, "a")
    assert (again.todo, again.captioned, again.version_after) == (0, 0, res.version_after)
    assert lance.dataset(path).version == res.version_after

    # A row whose attempt failed is captioned again, and only that row.
    failed = spark.createDataFrame([("id_rocket", "failed")],
                                   "sample_id string, caption_a_status string")
    write_columns(spark, path, failed)
    retry = caption(spark, cfg, "a")
    assert (retry.todo, retry.captioned, retry.statuses) == (1, 1, {"ok": 1})
    now = _rows(path, cols)
    assert now["id_rocket"]["caption_a"] == got["id_rocket"]["caption_a"]  # greedy: same
    assert now["id_rocket"]["caption_a_at"] > got["id_rocket"]["caption_a_at"]
    assert {k: v for k, v in now.items() if k != "id_rocket"} == {
        k: v for k, v in got.items() if k != "id_rocket"}
    # Same model in the caption pool's workers: at most one load per worker (none while
    # the workers Spark keeps idle for a minute are still alive).
    assert all(w["model_loads"] <= 1 for w in retry.workers.values())

    # A second version coexists with the first; its `where` picks the rows.
    res_b = caption(spark, cfg, "b")
    assert (res_b.todo, res_b.captioned) == (1, 1)
    both = _rows(path, ["caption_a", "caption_b", "caption_b_prompt_sha256"])
    assert both["id_coffee"]["caption_b_prompt_sha256"] == hashlib.sha256(
        prompt_b.encode()).hexdigest()
    assert isinstance(both["id_coffee"]["caption_b"], str)
    assert all(r["caption_b"] is None for k, r in both.items() if k != "id_coffee")
    assert {k: r["caption_a"] for k, r in both.items()} == {
        k: r["caption_a"] for k, r in now.items()}
    assert {k: after[k] for k in before} == {k: _files(path)[k] for k in before}

    # The export reads the version the config names (caption_a); "" where it failed.
    from mds_read import read_mds

    from etl.jobs.export import export

    exp = export(spark, cfg, "default")
    exported = {s["sample_id"]: s["caption"] for s in read_mds(exp.path)}
    assert exported == {k: r["caption_a"] or "" for k, r in now.items()}

    # Another model or prompt under the same name is refused before any work.
    changed = make_config(tmp_path, caption={"versions": {"a": {
        "model": tiny_model, "prompt": "Other prompt.", "max_new_tokens": 16,
        "batch_size": 2, "min_pixels": 784, "max_pixels": 6272}}})
    with pytest.raises(ConfigError, match="caption.versions.a: caption_a already holds"):
        caption(spark, changed, "a")


def test_cluster_templates_caption_on_cuda_in_bf16():
    # The GPUs themselves are scheduled by the platform's GPU cluster / caption step (the
    # deploy files; tests/test_platform_deploy.py checks they carry what this needs).
    from etl.config import load_config

    for name in ("databricks.yaml", "emr.yaml"):
        cfg = load_config(REPO / "conf" / name)
        v = cfg.caption.version(None)
        assert (v.device, v.dtype) == ("cuda", "bfloat16"), name


@pytest.mark.gpu
def test_tiny_model_captions_in_bf16_on_a_gpu(tiny_model):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from udfs.caption import get_captioner

    spec = _spec(tiny_model, device="cuda", dtype="auto")
    cap = get_captioner(spec, device="cuda:0")
    assert cap.model.dtype == torch.bfloat16
    out = caption_images(spec, [_photo_jpeg(n) for n in PHOTOS[:3]], cap)
    assert out.status == ["ok"] * 3
