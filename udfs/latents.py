"""Text latents: a text encoder's last hidden states and attention mask per caption.

:func:`encode_texts` is plain Python on a list of captions; :func:`latents_mapper`
wraps it as a ``mapInArrow`` function for Spark. The model is loaded once per Python
worker (the cache lives in this importable module, so every task of a reused worker
hits it) and fed in batches of ``batch_size`` captions gathered across Arrow batches.

Stored form, per caption and encoder (little-endian, row-major):

* latent: ``max_tokens * hidden_size`` values of ``dtype`` as raw bytes
  (float16/float32 as numpy writes them; bfloat16 as its 16-bit patterns, i.e. uint16);
* attention mask: ``max_tokens`` uint8 (1 = a real token, 0 = padding);
* tokens: the caption's token count before truncation (special tokens included), so
  ``tokens > max_tokens`` means the caption was truncated.

A null caption is encoded as ``""``: the export turns it into ``""`` too, and an
unconditional sample then gets exactly the latents an online encoder would compute.

Per-row failures are data: a batch that raises is retried caption by caption, and a
caption that still fails, or whose latents are not finite in the stored dtype (float16
overflows at 65504), gets no latents and an ``error`` (``encoder_error: …`` or
``non_finite``). Devices come from config (``cpu``, ``cuda`` = the GPU Spark assigned
to the task, ``cuda:N``), never from probing the machine that builds the plan; the job
runs the mapper in a Python worker pool of its own
(:func:`udfs.worker.python_worker_pool`), so the encoder loads once per task slot.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from etl.config import LatentEncoderConfig

__all__ = [
    "EncodedTexts",
    "STORAGE_BYTES",
    "MDS_DTYPE",
    "ERROR_REASONS",
    "resolve_model_path",
    "model_hidden_size",
    "load_encoder",
    "encode_texts",
    "encode_rows",
    "latents_mapper",
    "output_columns",
]

log = logging.getLogger(__name__)

# Bytes per stored value, and the numpy dtype the MDS `ndarray` encoding declares.
STORAGE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
MDS_DTYPE = {"float16": "float16", "bfloat16": "uint16", "float32": "float32"}
ERROR_REASONS = ("encoder_error", "non_finite")


@dataclass(frozen=True)
class EncodedTexts:
    latents: np.ndarray  # [n, max_tokens, hidden], float16 / uint16 (bfloat16) / float32
    masks: np.ndarray  # [n, max_tokens] uint8
    tokens: np.ndarray  # [n] int32, before truncation
    finite: np.ndarray  # [n] bool


def resolve_model_path(path: str) -> str:
    """A local folder, or ``pkg:<package>/<sub/folder>`` inside an installed package."""
    if path.startswith("pkg:"):
        import importlib.util

        package, _, sub = path[4:].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"encoder path {path!r}: package {package!r} not installed")
        path = os.path.join(list(spec.submodule_search_locations)[0], sub)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"encoder path {path!r} has no config.json (expected a Hugging Face model folder)"
        )
    return path


def _offline() -> None:
    # Models are loaded by path; never let a missing file turn into a hub download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def model_hidden_size(path: str) -> int:
    """The hidden size from the model's config.json (no weights loaded)."""
    _offline()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(path), local_files_only=True)
    return int(config.hidden_size)


_MODELS: dict[tuple, tuple] = {}


def torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _device(spec: LatentEncoderConfig) -> str:
    """cpu; cuda:N as configured; cuda: the GPU Spark assigned to this task (a task
    without one fails naming the Spark settings to add, never a guess)."""
    from udfs.worker import task_device

    device = task_device(spec.device, f"latents.encoders.{spec.name}.device")
    if device == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"latents encoder {spec.name!r}: device {spec.device!r} is configured but this "
            "machine has no usable CUDA device (set device: cpu, or run on GPU executors)"
        )
    return device


def load_encoder(spec: LatentEncoderConfig):
    """(tokenizer, model, device), loaded once per worker for (path, dtype, device)."""
    device = _device(spec)
    key = (spec.path, spec.compute_dtype, device)
    if key in _MODELS:
        return _MODELS[key]
    _offline()
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    path = resolve_model_path(spec.path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:  # decoder-only models often have none
        if tokenizer.eos_token is None:
            raise ValueError(f"encoder {spec.name!r}: tokenizer has neither pad nor eos token")
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(
        path, local_files_only=True, dtype=torch_dtype(spec.compute_dtype)
    )
    if config.is_encoder_decoder:  # T5 & co.: only the encoder stack conditions
        model = model.get_encoder()
    model = model.to(device).eval()
    _MODELS[key] = (tokenizer, model, device)
    log.info("latents: loaded %s (%s) on %s", spec.name, path, device)
    from udfs.worker import settle_imports

    settle_imports()  # torch/transformers + the model: keep per-task GC cheap
    return _MODELS[key]


def encode_texts(spec: LatentEncoderConfig, texts: list[str]) -> EncodedTexts:
    """Encode one batch: latents padded/truncated to ``max_tokens``, masks, counts."""
    import torch

    tokenizer, model, device = load_encoder(spec)
    n, t = len(texts), spec.max_tokens
    counts = tokenizer(texts, truncation=False, verbose=False)["input_ids"]
    tokens = np.array([len(ids) for ids in counts], np.int32)
    enc = tokenizer(
        texts,
        padding="max_length" if spec.padding == "max_length" else "longest",
        truncation=True,
        max_length=t,
        return_tensors="pt",
    )
    with torch.inference_mode():
        hidden = model(
            input_ids=enc["input_ids"].to(device),
            attention_mask=enc["attention_mask"].to(device),
        ).last_hidden_state
    width = hidden.shape[1]
    stored = hidden.to(torch_dtype(spec.dtype))
    finite = torch.isfinite(stored).reshape(n, -1).all(dim=1).cpu().numpy()
    if spec.dtype == "bfloat16":
        values = stored.view(torch.int16).cpu().numpy().view(np.uint16)
    else:
        values = stored.cpu().numpy()
    mask = enc["attention_mask"].cpu().numpy().astype(np.uint8)
    if width < t:  # padding: zeros (the batch's longest caption is shorter than t)
        full = np.zeros((n, t, values.shape[2]), values.dtype)
        full_mask = np.zeros((n, t), np.uint8)
        if tokenizer.padding_side == "left":
            full[:, t - width :], full_mask[:, t - width :] = values, mask
        else:
            full[:, :width], full_mask[:, :width] = values, mask
        values, mask = full, full_mask
    return EncodedTexts(np.ascontiguousarray(values), mask, tokens, finite)


def encode_rows(spec: LatentEncoderConfig, texts: list[str]) -> tuple[EncodedTexts | None, list]:
    """Encode a batch; if it raises, retry caption by caption.

    Returns (encoded batch or None, per-row error or None). When the batch failed, the
    returned arrays hold zeros on failed rows."""
    try:
        enc = encode_texts(spec, texts)
        return enc, [None if ok else "non_finite" for ok in enc.finite]
    except Exception as exc:  # a batch-level failure: isolate the bad caption(s)
        log.warning("latents: batch of %d failed (%s); retrying one by one", len(texts), exc)
    parts, errors = [], []
    for text in texts:
        try:
            one = encode_texts(spec, [text])
            parts.append(one)
            errors.append(None if one.finite[0] else "non_finite")
        except Exception as exc:
            parts.append(None)
            errors.append(f"encoder_error: {type(exc).__name__}: {exc}"[:300])
    good = [p for p in parts if p is not None]
    if not good:
        return None, errors
    proto = good[0]

    def pick(attr, i):
        p = parts[i]
        return getattr(p, attr)[0] if p is not None else np.zeros_like(getattr(proto, attr)[0])

    enc = EncodedTexts(
        latents=np.stack([pick("latents", i) for i in range(len(texts))]),
        masks=np.stack([pick("masks", i) for i in range(len(texts))]),
        tokens=np.array([pick("tokens", i) for i in range(len(texts))], np.int32),
        finite=np.array([e is None for e in errors]),
    )
    return enc, errors


def output_columns(captions: list[str], columns_for) -> list[tuple[str, pa.DataType]]:
    """Output (name, type) per caption: latent, mask, tokens, error (see module doc)."""
    out = []
    for cap in captions:
        names = columns_for(cap)
        out += [
            (names.latent, pa.binary()),
            (names.mask, pa.binary()),
            (names.tokens, pa.int32()),
            (names.error, pa.string()),
        ]
    return out


def _binary_rows(matrix: np.ndarray, valid: np.ndarray) -> pa.Array:
    """Each row of `matrix` as one binary value (null where not valid), zero-copy-ish."""
    n = matrix.shape[0]
    row_bytes = matrix[0].nbytes if n else 0
    offsets = (np.arange(n + 1, dtype=np.int64) * row_bytes).astype(np.int32)
    arr = pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(matrix.tobytes())]
    )
    if valid.all():
        return arr
    return pc.if_else(pa.array(valid), arr, pa.scalar(None, pa.binary()))


def latents_mapper(spec: LatentEncoderConfig, captions: list[str], keys: list[str], columns_for):
    """A ``mapInArrow`` function: rows (keys + caption columns) -> keys + per caption
    latent, attention mask, token count and error (names from ``columns_for(caption)``)."""
    out_fields = output_columns(captions, columns_for)

    def process(table: pa.Table) -> pa.RecordBatch:
        arrays = [table.column(k).combine_chunks() for k in keys]
        names = list(keys)
        n = table.num_rows
        for cap, (lat_name, _), (mask_name, _), (tok_name, _), (err_name, _) in zip(
            captions, out_fields[0::4], out_fields[1::4], out_fields[2::4], out_fields[3::4],
            strict=True,
        ):
            texts = ["" if v is None else str(v) for v in table.column(cap).to_pylist()]
            enc, errors = encode_rows(spec, texts)
            valid = np.array([e is None for e in errors])
            if enc is None:
                lat = pa.nulls(n, pa.binary())
                mask = pa.nulls(n, pa.binary())
                tok = pa.nulls(n, pa.int32())
            else:
                if enc.latents.shape[0] != n:
                    raise RuntimeError(f"encoder returned {enc.latents.shape[0]} rows for {n}")
                lat = _binary_rows(enc.latents, valid)
                mask = _binary_rows(enc.masks, valid)
                tok = pa.array(enc.tokens, pa.int32())
            arrays += [lat, mask, tok, pa.array(errors, pa.string())]
            names += [lat_name, mask_name, tok_name, err_name]
        return pa.RecordBatch.from_arrays(arrays, names=names)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        pending: list[pa.RecordBatch] = []
        count = 0
        for batch in batches:  # gather Arrow batches into model batches of batch_size
            if batch.num_rows == 0:
                continue
            pending.append(batch)
            count += batch.num_rows
            while count >= spec.batch_size:
                table = pa.Table.from_batches(pending)
                yield process(table.slice(0, spec.batch_size))
                rest = table.slice(spec.batch_size)
                pending, count = rest.to_batches(), rest.num_rows
        if count:
            yield process(pa.Table.from_batches(pending))

    return run
