"""The ``transformers`` caption backend: ``AutoProcessor`` + ``AutoModelForImageTextToText``.

Left-padded batched ``generate`` (Qwen2.5-VL, Qwen3-VL through the chat template;
task-prompt models such as Florence-2 with ``prompt_format: plain``); each row reports
its image tokens and the padding its batch added. Like :mod:`udfs.caption_models`, this
module imports only the standard library at module level.

The generation path is configured per caption version, and under greedy decoding every
path gives the same tokens as plain ``generate`` (tested on CPU):

* ``kv_cache: static`` -- a KV cache allocated once per batch shape, its length (prompt
  + ``max_new_tokens``) rounded up to ``cache_bucket``, reset and reused by the next
  batch of that shape instead of a cache that grows (and is re-concatenated) every step;
* ``compile: true`` (static cache, CUDA) -- transformers compiles the decode step
  (``torch.compile``, CUDA graphs): one launch per step instead of hundreds of kernels
  dispatched from Python; a fixed cache shape is what keeps it from recompiling;
* ``prepare_ahead: true`` -- :meth:`TransformersCaptioner.prepare_ahead` runs the
  processor (resize, normalise, patches, chat template) for the next batch in the
  background thread that decoded it, while the current batch generates;
* ``vision_attention`` -- the vision tower's attention implementation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from udfs.caption_models import (
    Captioner,
    CaptionSpec,
    Generated,
    chat_prompt,
    offline_if_local,
    pixel_range_kwargs,
    token_factor,
    torch_dtype,
)

__all__ = ["TransformersCaptioner", "PreparedBatch"]


@dataclass
class PreparedBatch:
    """A batch after the processor, on the CPU: what ``generate`` needs, and its counts."""

    inputs: Any  # the processor's BatchFeature (CPU tensors)
    image_tokens: list[int]
    padding: list[int]


def _setting(spec: CaptionSpec, name: str, default):
    # Settings are duck-typed (the bare bench has its own): a missing one is the default.
    return getattr(spec.settings, name, default)


# Batch sizes whose static KV cache is kept between batches (see TransformersCaptioner).
_KEPT_CACHES = 2


def _static_length(prompt: int, new_tokens: int, bucket: int) -> int:
    """The static cache's length for a prompt: room for every new token, rounded up."""
    return -(-(prompt + new_tokens) // bucket) * bucket


class TransformersCaptioner(Captioner):
    """``AutoProcessor`` + ``AutoModelForImageTextToText``; left-padded batched ``generate``."""

    def __init__(self, spec: CaptionSpec, device: str):
        super().__init__(spec, device)
        offline_if_local(spec)
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(
                f"caption device is {device} but this machine has no usable GPU "
                f"(torch {torch.__version__}, CUDA available: False)"
            )
        kw = {"local_files_only": spec.local_files_only,
              "trust_remote_code": spec.settings.trust_remote_code}
        self.processor = AutoProcessor.from_pretrained(spec.model_path, **kw)
        tok = getattr(self.processor, "tokenizer", None)
        if tok is not None:
            tok.padding_side = "left"  # decoder-only generation needs left padding
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
        vision = _setting(spec, "vision_attention", None)
        if vision is not None:
            # Per sub-model: the vision tower gets `vision`, the rest transformers' default.
            kw["attn_implementation"] = {"vision_config": vision}
        self.model = AutoModelForImageTextToText.from_pretrained(
            spec.model_path, dtype=torch_dtype(spec, device), **kw
        ).to(device).eval()
        ip = getattr(self.processor, "image_processor", None)
        self._image_processor = ip
        self._factor = token_factor(ip)
        self._image_token_id = getattr(self.model.config, "image_token_id", None)
        eos = self.model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tok is not None and tok.eos_token_id is not None:
            self._eos.add(tok.eos_token_id)
        # A fast tokenizer is not safe to use from two threads at once (the processor
        # sets its padding): the background thread's processor and this thread's
        # decoding take turns.
        self._tokenizer_lock = threading.Lock()
        # Batches prepared by prepare_ahead, the newest last (the decode thread may
        # finish the next one before generate() takes this one): (spec, images, batch).
        self._ahead: list[tuple[CaptionSpec, list, PreparedBatch]] = []
        self._ahead_lock = threading.Lock()
        # The static KV caches kept between batches, per batch size: (length, cache), the
        # most recently used last. Two sizes: a window's full batches and its last, short
        # one (or a batch a bad image left short) each keep theirs instead of
        # reallocating (and, compiled, recapturing) at every window.
        self._caches: OrderedDict[int, tuple[int, Any]] = OrderedDict()

    # ------------------------------------------------------------------ CPU side

    def _pixel_kwargs(self, spec: CaptionSpec) -> dict:
        # Qwen-style processors resize to a pixel range themselves: give them ours.
        return pixel_range_kwargs(self._image_processor, spec.settings.min_pixels,
                                  spec.settings.max_pixels)

    def prepare(self, images: list, spec: CaptionSpec) -> PreparedBatch:
        """The processor's work for a batch (CPU only: it may run in another thread)."""
        with self._tokenizer_lock:
            prompt = chat_prompt(self.processor, spec.settings)
            inputs = self.processor(
                text=[prompt] * len(images), images=images, padding=True,
                return_tensors="pt", **self._pixel_kwargs(spec),
            )
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        padding = (mask == 0).sum(1).tolist() if mask is not None else [0] * len(images)
        if self._image_token_id is not None:
            image_tokens = (ids == self._image_token_id).sum(1).tolist()
        else:
            image_tokens = [self.image_tokens(*im.size, spec) for im in images]
        return PreparedBatch(inputs, [int(n) for n in image_tokens], [int(n) for n in padding])

    def prepare_ahead(self, images: list, spec: CaptionSpec) -> None:
        """Prepare the batch that :meth:`generate` will get next (these very image
        objects, in this order) when the version asks for it; an error is left for
        ``generate`` to raise, on its row."""
        if not _setting(spec, "prepare_ahead", False):
            return
        try:
            batch = self.prepare(images, spec)
        except Exception:  # noqa: BLE001 - generate() prepares again and reports it
            return
        with self._ahead_lock:
            self._ahead = [*self._ahead[-1:], (spec, list(images), batch)]

    def _prepared(self, images: list, spec: CaptionSpec) -> PreparedBatch:
        """The batch prepare_ahead made for these images, or the processor's work now."""
        with self._ahead_lock:
            for k, (s, imgs, batch) in enumerate(self._ahead):
                if s is spec and len(imgs) == len(images) and all(
                        a is b for a, b in zip(imgs, images, strict=True)):
                    self._ahead = self._ahead[k + 1:]
                    return batch
        return self.prepare(images, spec)

    # ------------------------------------------------------------------ generation

    def _static_cache(self, batch: int, prompt: int, spec: CaptionSpec):
        """The static KV cache for this batch: the one kept for this batch size, reset,
        if it has room; otherwise a new one (replacing it, or the least recently used
        size's when :data:`_KEPT_CACHES` are kept, released first)."""
        from transformers import StaticCache

        need = prompt + spec.settings.max_new_tokens
        kept = self._caches.get(batch)
        if kept is not None and kept[0] >= need:
            self._caches.move_to_end(batch)
            kept[1].reset()
            return kept[1]
        self._caches.pop(batch, None)
        while len(self._caches) >= _KEPT_CACHES:
            self._caches.popitem(last=False)
        length = _static_length(prompt, spec.settings.max_new_tokens,
                                _setting(spec, "cache_bucket", 256))
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        self._caches[batch] = (length, cache)
        return cache

    def _generation_kwargs(self, spec: CaptionSpec, ids) -> dict:
        import torch

        s = spec.settings
        gen: dict = {"max_new_tokens": s.max_new_tokens, "do_sample": s.do_sample}
        if s.do_sample:
            gen.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
            torch.manual_seed(s.seed)
        if s.repetition_penalty != 1.0:
            gen["repetition_penalty"] = s.repetition_penalty
        if _setting(spec, "kv_cache", "dynamic") == "static":
            gen["past_key_values"] = self._static_cache(ids.shape[0], ids.shape[1], spec)
            # transformers compiles the decode step of a static cache on CUDA by itself:
            # only when the version asks for it.
            gen["disable_compile"] = not _setting(spec, "compile", False)
        return gen

    def _run(self, inputs, gen: dict):
        """``model.generate`` (the bench overrides this to time the steps)."""
        return self.model.generate(**inputs, **gen)

    def generate(self, images: list, spec: CaptionSpec) -> list[Generated]:
        import torch

        batch = self._prepared(images, spec)
        inputs = batch.inputs.to(self.device)
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        ids = inputs["input_ids"]
        # Inside inference mode: the kept static cache holds inference tensors, and its
        # reset writes to them.
        with torch.inference_mode():
            out = self._run(inputs, self._generation_kwargs(spec, ids))
        if getattr(self.model.config, "is_encoder_decoder", False):
            new = out[:, 1:].cpu()  # Florence-2 style: only the decoder start precedes
        else:
            new = out[:, ids.shape[1]:].cpu()  # after the left-padded prompt
        with self._tokenizer_lock:
            return self._results(new.tolist(), batch, spec)

    def _results(self, rows: list[list[int]], batch: PreparedBatch, spec: CaptionSpec
                 ) -> list[Generated]:
        s = spec.settings
        pad = getattr(self.processor.tokenizer, "pad_token_id", None)
        results = []
        for row, n_img, n_pad in zip(rows, batch.image_tokens, batch.padding, strict=True):
            # Trailing pads after an early end-of-sequence are not generated tokens.
            ended = next((i for i, t in enumerate(row) if t in self._eos), None)
            used = row[: ended + 1] if ended is not None else row
            if ended is None and pad is not None and pad not in self._eos:
                while used and used[-1] == pad:
                    used = used[:-1]
            text = self.processor.tokenizer.decode(used, skip_special_tokens=True)
            hit = ended is None and len(row) >= s.max_new_tokens
            results.append(Generated(text.strip(), len(used), hit, n_img, n_pad))
        return results

    def release_memory(self) -> None:
        self._caches.clear()  # static caches sized for batches that did not fit
        with self._ahead_lock:
            self._ahead = []
        super().release_memory()
