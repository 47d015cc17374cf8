"""The vLLM caption backend up to the engine boundary.

vLLM needs a CUDA GPU and is not installed here, so a fake ``vllm`` module with the
API surface lakeshard uses (``LLM(**engine_args)``, ``LLM.generate(prompts, params,
use_tqdm=...)`` with ``{"prompt", "multi_modal_data": {"image"}}`` inputs, and
``RequestOutput.outputs[0].text / token_ids / finish_reason``, ``SamplingParams``) is
put in ``sys.modules``. Everything else is real: the tiny Qwen2.5-VL's processor and chat
template, real photos, lakeshard's decode, batching and per-row error handling.
"""

from __future__ import annotations

import io
import os
import sys
import types
from dataclasses import dataclass, field

import pytest
from PIL import Image
from test_caption import _photo_jpeg, shared_tiny_model

from etl.config import CaptionVersionConfig, ConfigError
from udfs.captioner import CaptionSpec, VLLMCaptioner, caption_images, get_captioner

PROMPT = "Describe the image."
# The tiny model's chat template (etl/tiny_vlm.py), written out by hand.
CHAT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>" + PROMPT
        + "<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return shared_tiny_model(tmp_path_factory)


@dataclass
class _Completion:
    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class _RequestOutput:
    outputs: list[_Completion]


@dataclass
class _Engine:
    """What the fake engine saw, and how it misbehaves."""

    args: dict = field(default_factory=dict)
    calls: list[tuple[list[dict], object, bool]] = field(default_factory=list)
    oom_above: int | None = None  # a generate() of more prompts runs out of memory
    fail_width: int | None = None  # a prompt whose image has this width raises
    drop_one: bool = False  # returns one output too few (an engine bug)


def _fake_vllm(engine: _Engine) -> types.ModuleType:
    vllm = types.ModuleType("vllm")

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class LLM:
        def __init__(self, **kw):
            engine.args = kw

        def generate(self, prompts, params, use_tqdm=True):
            engine.calls.append((prompts, params, use_tqdm))
            if engine.oom_above is not None and len(prompts) > engine.oom_above:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            sizes = [p["multi_modal_data"]["image"].size for p in prompts]
            if engine.fail_width is not None and any(w == engine.fail_width for w, _ in sizes):
                raise ValueError("prompt too long for the model's context")
            outs = [
                # A caption that says which image it was made from; 3 tokens; a 96-px
                # wide image "runs out" of max_tokens.
                _RequestOutput([_Completion(f" {w}x{h} ", [7, 8, 9],
                                            "length" if w == 96 else "stop")])
                for w, h in sizes
            ]
            return outs[:-1] if engine.drop_one else outs

    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    return vllm


@pytest.fixture
def engine(monkeypatch):
    state = _Engine()
    monkeypatch.setitem(sys.modules, "vllm", _fake_vllm(state))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return state


def _spec(model: str, **kw) -> CaptionSpec:
    settings = CaptionVersionConfig(**{
        "name": "v", "model": model, "backend": "vllm", "device": "cuda", "prompt": PROMPT,
        "max_new_tokens": 40, "batch_size": 2, "min_pixels": 28 * 28,
        "max_pixels": 200 * 200, "repetition_penalty": 1.05, "seed": 7, **kw})
    return CaptionSpec(settings=settings, model_path=model, local_files_only=True,
                       gpu_share=0.5)


def _size(data: bytes) -> tuple[int, int]:
    return Image.open(io.BytesIO(data)).size


def test_engine_arguments_prompts_images_and_output_rows(engine, tiny_model):
    spec = _spec(tiny_model)
    cap = VLLMCaptioner(spec, "cuda:3")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"  # the task's GPU only
    assert engine.args == {
        "model": tiny_model, "dtype": "auto", "trust_remote_code": False, "seed": 7,
        "limit_mm_per_prompt": {"image": 1},
        "mm_processor_kwargs": {"min_pixels": 28 * 28, "max_pixels": 200 * 200},
        # Two tasks share a GPU (spark.task.resource.gpu.amount 0.5): two engines fit.
        "gpu_memory_utilization": 0.45,
    }
    images = [_photo_jpeg("astronaut", 96), b"not an image", _photo_jpeg("chelsea", 128),
              None, _photo_jpeg("rocket", 64), _photo_jpeg("coffee", 40)]
    out = caption_images(spec, images, cap)

    # One generate() for the window's decodable images (vLLM batches them itself),
    # whatever batch_size says; greedy sampling as configured.
    assert len(engine.calls) == 1
    prompts, params, use_tqdm = engine.calls[0]
    assert use_tqdm is False and len(prompts) == 4
    assert params.kw == {"max_tokens": 40, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                         "repetition_penalty": 1.05, "seed": 7}
    assert all(p["prompt"] == CHAT for p in prompts)
    sent = [p["multi_modal_data"]["image"] for p in prompts]
    assert all(im.mode == "RGB" for im in sent)
    good = [b for b in images if b and b != b"not an image"]
    # Every decodable photo went in once, at its size (all within the pixel range).
    assert sorted(im.size for im in sent) == sorted(_size(b) for b in good)

    # Outputs map back to their rows; bad rows never reach the engine.
    assert out.status == ["ok", "bad_image", "ok", "bad_image", "ok", "ok"]
    for i, data in enumerate(images):
        if out.status[i] == "ok":
            w, h = _size(data)
            assert out.caption[i] == f"{w}x{h}" and out.tokens[i] == 3
            assert out.flags[i] == ("truncated" if w == 96 else "")
            assert out.padding[i] == 0 and out.image_tokens[i] >= 1
    assert out.error[3] == "missing image bytes"
    assert out.error[1].startswith("undecodable image")


def test_out_of_memory_halves_and_a_bad_prompt_fails_only_its_row(engine, tiny_model):
    spec = _spec(tiny_model)
    images = [_photo_jpeg(n, side) for n, side in
              (("astronaut", 96), ("chelsea", 128), ("rocket", 64), ("coffee", 40))]
    engine.oom_above = 2
    cap = VLLMCaptioner(spec, "cuda:0")
    out = caption_images(spec, images, cap)
    assert [len(c[0]) for c in engine.calls] == [4, 2, 2] and cap.batch_limit == 2
    assert out.status == ["ok"] * 4
    assert out.caption == ["{}x{}".format(*_size(b)) for b in images]

    engine.calls.clear()
    engine.oom_above, engine.fail_width = None, _size(images[2])[0]
    out = caption_images(spec, images, VLLMCaptioner(spec, "cuda:0"))
    assert out.status == ["ok", "ok", "failed", "ok"]
    assert out.error[2] == "ValueError: prompt too long for the model's context"
    assert [len(c[0]) for c in engine.calls] == [4, 1, 1, 1, 1]  # the window, then alone


def test_a_missing_output_is_a_bug_not_a_row_status(engine, tiny_model):
    spec = _spec(tiny_model)
    engine.drop_one = True
    with pytest.raises(RuntimeError, match="VLLMCaptioner.generate returned 1 outputs for 2"):
        caption_images(spec, [_photo_jpeg("astronaut"), _photo_jpeg("coffee")],
                       VLLMCaptioner(spec, "cuda:0"))


def test_the_worker_cache_keys_the_engine_by_its_memory_share(engine, tiny_model):
    half = get_captioner(_spec(tiny_model), device="cuda:0")
    assert get_captioner(_spec(tiny_model), device="cuda:0") is half
    whole = CaptionSpec(settings=_spec(tiny_model).settings, model_path=tiny_model,
                        local_files_only=True, gpu_share=1.0)
    assert get_captioner(whole, device="cuda:0") is not half
    assert engine.args["gpu_memory_utilization"] == 0.9
    pinned = _spec(tiny_model, gpu_memory_utilization=0.3)
    get_captioner(pinned, device="cuda:0")
    assert engine.args["gpu_memory_utilization"] == 0.3


def test_without_vllm_the_backend_names_the_extra(monkeypatch, tmp_path, tiny_model):
    from conftest import make_config

    from etl.jobs.caption import caption_spec

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'lakeshard\[vllm\]'"):
        VLLMCaptioner(_spec(tiny_model), "cuda:0")
    cfg = make_config(tmp_path, caption={"versions": {"v": {
        "model": tiny_model, "backend": "vllm", "device": "cuda"}}})
    with pytest.raises(ConfigError, match=r"^caption\.versions\.v\.backend: vllm is not "
                       r"installed; pip install 'lakeshard\[vllm\]'"):
        caption_spec(cfg, cfg.caption.version("v"))
