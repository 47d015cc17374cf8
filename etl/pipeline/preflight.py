"""Everything that can fail before Spark starts, with a message that names the field.

:func:`check_config` checks the parsed config against the registries (source kinds,
stage names in ``run.stages`` and ``run.budgets``, writable export targets) -- the part
of validation that config itself must not import. The stages' own checks (registered
with each stage: :mod:`etl.pipeline.checks`, the jobs' ``check``) look at the inputs:
sample sources built, paths and columns there, export names known.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

from etl.config import Config
from etl.errors import ConfigError
from etl.pipeline.stages import COMMANDS, STAGES
from etl.sources import SOURCE_KINDS
from etl.writers.remote import REMOTE_SCHEMES

__all__ = ["check_config", "check_run_id"]

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def check_config(cfg: Config) -> Config:
    """Registry checks on a parsed config; returns it unchanged."""
    for i, src in enumerate(cfg.sources):
        where = f"sources[{i}] ({src.name})"
        if src.kind not in SOURCE_KINDS:
            raise ConfigError(
                f"{where}.kind: unknown kind {src.kind!r} "
                f"(known: {', '.join(sorted(SOURCE_KINDS))})"
            )
        SOURCE_KINDS[src.kind].validate_config(src, where)
    for i, name in enumerate(cfg.run.stages or ()):
        if name not in STAGES.names():
            raise ConfigError(
                f"run.stages[{i}]: unknown stage {name!r} "
                f"(registered: {', '.join(STAGES.names())})"
            )
    known = (*STAGES.names(), *COMMANDS.names())
    for name in cfg.run.budgets.failed_rate:
        if name not in known:
            raise ConfigError(
                f"run.budgets.failed_rate.{name}: unknown stage {name!r} "
                f"(registered: {', '.join(known)})"
            )
    for exp in cfg.exports.values():
        if exp.path and "://" in exp.path:
            scheme = urlparse(exp.path).scheme
            if scheme not in REMOTE_SCHEMES:
                raise ConfigError(
                    f"exports.{exp.name}.path: {scheme}:// output is not supported; use "
                    "s3:// (for Google Cloud Storage, its S3-interoperable endpoint: "
                    "S3_ENDPOINT_URL=https://storage.googleapis.com with HMAC keys) or a "
                    "local/mounted path"
                )
    return cfg


def check_run_id(run_id: str | None) -> None:
    if run_id is not None and not _RUN_ID_RE.fullmatch(run_id):
        raise ConfigError(f"--run-id: {run_id!r} is not a valid run id (letters, digits, "
                          "'.', '_', '-'; it names the report folder)")
