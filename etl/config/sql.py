"""The ``sql:`` section: the SQL endpoint (``lakeshard sql-server``) and where
``lakeshard sql`` sends its queries (docs/sql.md, "A laptop" and "Security")."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from etl.config.base import Section

__all__ = ["SqlConfig"]


class SqlConfig(Section):
    """``sql.host``/``sql.port``: where ``lakeshard sql-server`` listens (a non-loopback
    host only when named here: it exposes every table under the root to that network);
    ``sql.endpoint``: ``host:port`` of a running endpoint that ``lakeshard sql`` sends
    its statement to (its warm path) instead of starting Spark."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 10000
    endpoint: str | None = None

    @field_validator("endpoint")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, sep, port = value.rpartition(":")
        if not (host and sep and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{value!r} is not host:port (e.g. 127.0.0.1:10000)")
        return value
