"""The transformers backend's fast generation path gives plain ``generate``'s tokens.

A static KV cache (allocated per batch shape, reused, its length rounded up to
``cache_bucket``) and the processor run ahead in the decode thread change where the time
goes, never the captions: under greedy decoding every row gets, token for token, what
transformers' own ``generate`` with its dynamic cache gives -- the reference, computed
by transformers, not by the code under test. Checked on the tiny smoke-test model and on
the bench's 50 M-parameter ``mid`` model (the real Qwen2.5-VL architecture, realistic
widths); ``compile`` needs a GPU and is checked by ``bench/gpu_caption.sh``.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import sys  # noqa: E402
import threading  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from test_caption import _photo_jpeg, _spec, shared_tiny_model  # noqa: E402

from udfs.caption import CaptionSpec, TransformersCaptioner, caption_images  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FAST = {"kv_cache": "static", "prepare_ahead": True}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return shared_tiny_model(tmp_path_factory)


class _Recording(TransformersCaptioner):
    """The real backend, recording each generate call's new token ids, the KV cache it
    was given, and the thread that ran the processor for it."""

    def __init__(self, spec, device):
        super().__init__(spec, device)
        self.rows: list[list[int]] = []
        self.caches: list = []  # the objects (kept alive: ids are not reused)
        self.prompts: list[int] = []
        self.processor_threads: list[str] = []

    def prepare(self, images, spec):
        self.processor_threads.append(threading.current_thread().name)
        return super().prepare(images, spec)

    def _run(self, inputs, gen):
        out = super()._run(inputs, gen)
        self.rows += out[:, inputs["input_ids"].shape[1]:].tolist()
        self.prompts.append(inputs["input_ids"].shape[1])
        self.caches.append(gen.get("past_key_values"))
        return out


def _photos() -> list[bytes]:
    sizes = (("astronaut", 40), ("chelsea", 128), ("coffee", 64), ("rocket", 112),
             ("camera", 96), ("immunohistochemistry", 72))
    return [_photo_jpeg(name, side) for name, side in sizes]


def _caption(cap: _Recording, spec: CaptionSpec, images: list[bytes], **settings):
    cap.rows, cap.caches, cap.prompts, cap.processor_threads = [], [], [], []
    fast = replace(spec, settings=spec.settings.model_copy(update=settings))
    return caption_images(fast, images, cap)


def test_static_cache_and_prepared_batches_give_plain_generates_tokens(tiny_model):
    images = [*_photos(), b"\xff\xd8\xff not a jpeg"]
    spec = _spec(tiny_model, batch_size=2, max_new_tokens=10, max_pixels=200 * 200)
    cap = _Recording(spec, "cpu")
    plain = _caption(cap, spec, images)
    plain_rows = cap.rows
    assert cap.caches == [None] * 3 and set(cap.processor_threads) == {"MainThread"}
    assert plain.status == ["ok"] * 6 + ["bad_image"]

    fast = _caption(cap, spec, images, **FAST)
    assert cap.rows == plain_rows  # token for token
    for name in ("caption", "status", "error", "flags", "tokens", "image_tokens", "padding"):
        assert getattr(fast, name) == getattr(plain, name), name
    # Three batches of two, largest first: one cache, allocated once, reset and reused.
    assert len(cap.caches) == 3 and cap.caches[0] is not None
    assert all(c is cap.caches[0] for c in cap.caches)
    # Every batch's processor ran in the decode thread, ahead, once.
    assert len(cap.processor_threads) == 3
    assert all(t.startswith("caption-decode") for t in cap.processor_threads)

    # A kept cache with room is reused whatever its length; after it is released, one
    # rounded to 16 instead of 256 (the largest batch first: the others fit in it).
    cap.release_memory()
    assert not cap._caches
    _caption(cap, spec, images, kv_cache="static", cache_bucket=16)
    assert cap.rows == plain_rows
    need = max(cap.prompts) + 10  # the longest prompt and its new tokens
    length = cap._caches[2][0]
    assert cap.prompts[0] == max(cap.prompts) and length % 16 == 0
    assert need <= length < need + 16


def test_a_static_cache_follows_the_batch_size(tiny_model):
    """Five images in batches of 2: the last batch of one gets a cache of its own, and
    both are kept, so a second window of five allocates none."""
    images = _photos()[:5]
    spec = _spec(tiny_model, batch_size=2, max_new_tokens=6, max_pixels=200 * 200)
    cap = _Recording(spec, "cpu")
    _caption(cap, spec, images)
    plain_rows = cap.rows
    _caption(cap, spec, images, kv_cache="static")
    assert cap.rows == plain_rows
    first = cap.caches
    assert len(first) == 3 and first[0] is first[1] is not first[2]
    _caption(cap, spec, images, kv_cache="static")
    assert cap.rows == plain_rows
    assert all(a is b for a, b in zip(cap.caches, first, strict=True))
    assert sorted(cap._caches) == [1, 2]


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> str:
    """The bench's 50 M-parameter Qwen2.5-VL (random weights, fixed-length captions)."""
    sys.path.insert(0, str(REPO / "bench"))
    import caption_throughput

    out = tmp_path_factory.getbasetemp() / "caption-models" / "mid"
    return str(caption_throughput.build_checkpoint("mid", out, "cpu", "float32", 56 * 56 * 4))


def test_mid_model_fast_path_gives_plain_generates_tokens(mid_model):
    images = _photos()[:4]
    spec = _spec(mid_model, batch_size=2, max_new_tokens=8, max_pixels=56 * 56 * 2)
    cap = _Recording(spec, "cpu")
    plain = _caption(cap, spec, images)
    plain_rows = cap.rows
    assert len(plain_rows) == 4 and all(len(r) == 8 for r in plain_rows)  # fixed length
    assert len({tuple(r) for r in plain_rows}) > 1  # the rows are not all one sequence
    fast = _caption(cap, spec, images, **FAST)
    assert cap.rows == plain_rows
    assert fast.caption == plain.caption and fast.tokens == plain.tokens == [8] * 4
