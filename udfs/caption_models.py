"""The caption models: settings, the spec an executor gets, and the backends.

A backend (:class:`Captioner`) is a loaded model whose ``generate`` captions a batch of
decoded images; :mod:`udfs.captioner` plans the batches, handles errors and keeps one
loaded backend per worker. Like it, this module imports only the standard library at
module level: torch, transformers and vLLM load where a backend is built.

* ``transformers``: :mod:`udfs.caption_transformers` (left-padded batched
  ``generate``, with its static-cache / compiled / prepared-ahead fast path).
* ``vllm``: vLLM's offline ``LLM.generate`` with the image as multi-modal input.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BACKENDS",
    "CaptionSettings",
    "CaptionSpec",
    "Generated",
    "Captioner",
    "VLLMCaptioner",
    "is_oom",
    "pixel_range_kwargs",
    "chat_prompt",
    "offline_if_local",
    "token_factor",
    "torch_dtype",
    "release_gpu_memory",
]

BACKENDS = ("transformers", "vllm")


class CaptionSettings(Protocol):
    """What generation reads from a caption version (``etl.config.CaptionVersionConfig``
    in lakeshard; any object with these attributes elsewhere, e.g. the bare bench)."""

    name: str
    backend: str
    prompt: str
    prompt_format: str
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int
    batch_size: int
    batch_tokens: int | None
    min_pixels: int
    max_pixels: int
    device: str
    dtype: str
    language: str | None
    trust_remote_code: bool
    gpu_memory_utilization: float | None
    # The transformers backend's generation path (read with defaults where missing:
    # dynamic, False, 256, False, None).
    kv_cache: str
    compile: bool
    cache_bucket: int
    prepare_ahead: bool
    vision_attention: str | None


@dataclass(frozen=True)
class CaptionSpec:
    """Everything an executor needs to caption: the configured version (generation
    settings, exactly as parsed) and where its model was resolved to."""

    settings: CaptionSettings
    # A local folder (also the built smoke-test model) or a hub id.
    model_path: str
    # True when model_path is a local folder: no hub look-up at all.
    local_files_only: bool = False
    # The share of a GPU each task holds (spark.task.resource.gpu.amount): how much of
    # its memory one vLLM engine may take.
    gpu_share: float = 1.0

    def cache_key(self, device: str) -> str:
        """What the loaded model depends on: versions differing only in prompt or
        generation settings share one loaded model per worker."""
        s = self.settings
        key = {"model": self.model_path, "backend": s.backend, "dtype": s.dtype,
               "trust_remote_code": s.trust_remote_code,
               "local_files_only": self.local_files_only, "device": device}
        vision = getattr(s, "vision_attention", None)
        if vision is not None:  # the model is loaded with it
            key["vision_attention"] = vision
        if s.backend == "vllm":  # vLLM bakes these into the engine
            key.update(min_pixels=s.min_pixels, max_pixels=s.max_pixels,
                       gpu_memory=_vllm_memory_share(self))
        return json.dumps(key)


@dataclass(frozen=True)
class Generated:
    text: str
    tokens: int
    hit_limit: bool  # stopped at max_new_tokens without an end-of-sequence token
    image_tokens: int = 0  # the image's tokens in the prompt
    padding: int = 0  # pad tokens added to this row's prompt to match its batch


# ----------------------------------------------------------------------- backends


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                  ) -> tuple[int, int]:
    """Qwen2-VL's resize rule (multiples of `factor` within the pixel range)."""
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def is_oom(exc: BaseException) -> bool:
    """A CUDA (or other accelerator) out-of-memory error."""
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return "out of memory" in str(exc).lower()


def release_gpu_memory() -> None:
    """Return the CUDA caching allocator's free blocks (after OOM or a model swap)."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def _vllm_memory_share(spec: CaptionSpec) -> float:
    configured = getattr(spec.settings, "gpu_memory_utilization", None)
    return configured if configured else round(0.9 * spec.gpu_share, 3)


def chat_prompt(processor, settings: CaptionSettings) -> str:
    if settings.prompt_format == "plain":
        return settings.prompt
    messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": settings.prompt}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class Captioner:
    """A loaded model; :meth:`generate` captions a batch of PIL images for a spec."""

    # Image tokens per pixel when the processor's rule is unknown (28 x 28 per token).
    _PIXELS_PER_TOKEN = 28 * 28
    # Qwen-style processors: sides resized to multiples of patch x merge pixels, one token
    # per factor x factor square (set by a backend whose processor says so).
    _factor: int | None = None

    def __init__(self, spec: CaptionSpec, device: str):
        self.device = device
        # Set after a CUDA out-of-memory error: the batch size that still fits, for the
        # rest of this worker's life.
        self.batch_limit: int | None = None

    def batch_size(self, spec: CaptionSpec) -> int:
        return min(spec.settings.batch_size, self.batch_limit or spec.settings.batch_size)

    def max_batch(self, spec: CaptionSpec, window: int) -> int:
        """Images per generate() call for a window of `window` images."""
        return self.batch_size(spec)

    def token_budget(self, spec: CaptionSpec) -> int | None:
        return getattr(spec.settings, "batch_tokens", None)

    def image_tokens(self, width: int, height: int, spec: CaptionSpec) -> int:
        """The image tokens an image of this (already resized) size becomes."""
        if self._factor is None:
            return max(1, (width * height) // self._PIXELS_PER_TOKEN)
        s = spec.settings
        h, w = _smart_resize(height, width, self._factor, s.min_pixels, s.max_pixels)
        return (h // self._factor) * (w // self._factor)

    def prepare_ahead(self, images: list, spec: CaptionSpec) -> None:
        """Called from the decode thread with the next batch's images (the objects
        :meth:`generate` will get): a backend may do its CPU work for them now. None
        here."""

    def generate(self, images: list, spec: CaptionSpec) -> list[Generated]:  # pragma: no cover
        raise NotImplementedError

    def release_memory(self) -> None:
        release_gpu_memory()


def token_factor(image_processor) -> int | None:
    """patch x merge of a Qwen-style image processor, None for any other."""
    patch = getattr(image_processor, "patch_size", None)
    merge = getattr(image_processor, "merge_size", None)
    return patch * merge if isinstance(patch, int) and isinstance(merge, int) else None


def pixel_range_kwargs(image_processor, min_pixels: int, max_pixels: int) -> dict:
    """The processor-call arguments that make a Qwen-style image processor resize into
    ``[min_pixels, max_pixels]``; none for any other processor.

    transformers 4.x takes ``min_pixels`` / ``max_pixels`` (the processor has them as
    attributes). transformers 5 keeps the range in ``size`` (``shortest_edge`` and
    ``longest_edge``, both in pixels for these processors) and warns that the old
    arguments go away, so it gets ``size`` -- only where the processor is Qwen-style
    (patch and merge sizes), since elsewhere ``shortest_edge`` is a side in pixels, not
    an area."""
    if image_processor is None:
        return {}
    if hasattr(image_processor, "min_pixels"):
        return {"min_pixels": min_pixels, "max_pixels": max_pixels}
    size = getattr(image_processor, "size", None)
    edges = [size.get(k) if isinstance(size, dict) else getattr(size, k, None)
             for k in ("shortest_edge", "longest_edge")]
    if token_factor(image_processor) is None or None in edges:
        return {}
    return {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}


def offline_if_local(spec: CaptionSpec) -> None:
    if spec.local_files_only:
        # Before transformers / huggingface_hub are imported in this worker.
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"


def torch_dtype(spec: CaptionSpec, device: str):
    import torch

    name = spec.settings.dtype
    if name == "auto":
        name = "bfloat16" if device.startswith("cuda") else "float32"
    return getattr(torch, name)


class VLLMCaptioner(Captioner):
    """vLLM offline inference: ``LLM.generate`` with the image as multi-modal input.

    A window's images go to vLLM in one call (its scheduler batches continuously; there
    is no padding to count). Optional: ``pip install 'lakeshard[vllm]'`` on the
    executors (it brings its own torch build; install it on GPU images only)."""

    def __init__(self, spec: CaptionSpec, device: str):
        super().__init__(spec, device)
        offline_if_local(spec)
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(
                "caption backend 'vllm' needs the vllm package on the executors: "
                "pip install 'lakeshard[vllm]'"
            ) from exc
        from transformers import AutoProcessor

        if device.startswith("cuda:"):
            # vLLM places itself on the visible devices: show it only the task's GPU.
            os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        s = spec.settings
        self.llm = LLM(
            model=spec.model_path,
            dtype=s.dtype,
            trust_remote_code=s.trust_remote_code,
            seed=s.seed,
            limit_mm_per_prompt={"image": 1},
            mm_processor_kwargs={"min_pixels": s.min_pixels, "max_pixels": s.max_pixels},
            gpu_memory_utilization=_vllm_memory_share(spec),
        )
        self.processor = AutoProcessor.from_pretrained(
            spec.model_path, local_files_only=spec.local_files_only,
            trust_remote_code=s.trust_remote_code,
        )
        ip = getattr(self.processor, "image_processor", None)
        self._factor = token_factor(ip)

    def max_batch(self, spec: CaptionSpec, window: int) -> int:
        return min(window, self.batch_limit or window)

    def token_budget(self, spec: CaptionSpec) -> int | None:
        return None  # vLLM's scheduler bounds its own batches

    def generate(self, images: list, spec: CaptionSpec) -> list[Generated]:
        from vllm import SamplingParams

        s = spec.settings
        prompt = chat_prompt(self.processor, s)
        params = SamplingParams(
            max_tokens=s.max_new_tokens,
            temperature=s.temperature if s.do_sample else 0.0,
            top_p=s.top_p if s.do_sample else 1.0,
            top_k=(s.top_k or -1) if s.do_sample else -1,
            repetition_penalty=s.repetition_penalty,
            seed=s.seed,
        )
        outs = self.llm.generate(
            [{"prompt": prompt, "multi_modal_data": {"image": im}} for im in images],
            params, use_tqdm=False,
        )
        image_tokens = [self.image_tokens(*im.size, spec) for im in images]
        results = []
        for k, o in enumerate(outs):  # vLLM returns outputs in prompt order
            c = o.outputs[0]
            n_img = image_tokens[k] if k < len(image_tokens) else 0
            results.append(Generated(c.text.strip(), len(c.token_ids),
                                     c.finish_reason == "length", n_img, 0))
        return results


