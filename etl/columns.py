"""Names of the columns commands add to the curated table after curate: a caption
version's columns and a text encoder's latent columns. The caption job writes them, the
report and the export read them; one definition here keeps them agreeing."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

__all__ = [
    "caption_columns",
    "LATENT_META",
    "LatentColumns",
    "latent_columns",
    "table_latents",
]


def caption_columns(version: str) -> dict[str, str]:
    """The columns of caption version `version`: name -> Spark SQL type."""
    c = f"caption_{version}"
    return {
        c: "string",  # the caption; null unless status = 'ok'
        f"{c}_status": "string",  # ok | bad_image | failed (udfs.caption.STATUSES)
        f"{c}_error": "string",  # why, when not ok
        f"{c}_flags": "string",  # caption checks, comma-separated ('' = none)
        f"{c}_tokens": "int",  # generated tokens
        f"{c}_model": "string",  # model id or path, as configured
        f"{c}_prompt_sha256": "string",
        f"{c}_params": "string",  # generation parameters, JSON
        f"{c}_at": "timestamp",  # when this row was captioned (UTC)
    }


# Arrow field metadata key on a latent column: encoder, path, shape, dtype, padding.
LATENT_META = "lakeshard.latent"


@dataclass(frozen=True)
class LatentColumns:
    latent: str
    mask: str
    tokens: str
    error: str

    def all(self) -> tuple[str, str, str, str]:
        return (self.latent, self.mask, self.tokens, self.error)


def latent_columns(caption: str, encoder: str) -> LatentColumns:
    """The curated table's column names for (caption column, encoder)."""
    return LatentColumns(
        latent=f"latent_{caption}_{encoder}",
        mask=f"attention_mask_{caption}_{encoder}",
        tokens=f"latent_tokens_{caption}_{encoder}",
        error=f"latent_error_{caption}_{encoder}",
    )


def table_latents(schema: pa.Schema) -> list[dict]:
    """Latents present in a table: one dict per latent column, from field metadata."""
    out = []
    for f in schema:
        raw = (f.metadata or {}).get(LATENT_META.encode())
        if raw:
            out.append({**json.loads(raw), "column": f.name})
    return out
