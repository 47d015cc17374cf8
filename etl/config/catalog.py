"""The `catalog:` section: where a run registers its tables by name, so analysts find
them in the SQL tools of their platform (docs/sql.md).

* ``none`` (default): nothing is registered; tables are found by path.
* ``hive``: a Hive metastore -- Spark's embedded one (Derby, under
  ``<root>/_catalog/``) or a standalone one at ``metastore_uri`` (``thrift://``).
* ``unity``: Unity Catalog on Databricks, tables ``<catalog>.<database>.<table>``.
* ``glue``: the AWS Glue Data Catalog as EMR's Hive metastore.

Checks that span sections (an embedded metastore needs a local root, Unity needs a
cloud URL root) are in :mod:`etl.config.root`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, model_validator

from etl.config.base import FieldError, Section

__all__ = ["CatalogConfig", "CATALOG_KINDS", "GLUE_FACTORY_KEY", "GLUE_FACTORY"]

CATALOG_KINDS = ("none", "hive", "unity", "glue")
# The Hive client factory that makes EMR's Hive metastore the Glue Data Catalog (what
# EMR's `spark-hive-site` classification sets; docs/sql.md, "EMR").
GLUE_FACTORY_KEY = "spark.hadoop.hive.metastore.client.factory.class"
GLUE_FACTORY = "com.amazonaws.glue.catalog.metastore.AWSGlueDataCatalogHiveClientFactory"

# Lower case: Hive and Glue fold names to it (Athena needs it), and Unity shows them so.
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,127}$")
_METASTORE_URI = re.compile(r"^thrift://[A-Za-z0-9.\-]+:[0-9]{1,5}$")


def _identifier(value: str) -> str:
    if not _IDENTIFIER.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a catalog identifier every engine reads unquoted (lower-case "
            "letters, digits and '_', starting with a letter or '_', at most 128)")
    return value


def _thrift_uri(value: str) -> str:
    if not _METASTORE_URI.fullmatch(value):
        raise ValueError(f"{value!r} is not a metastore URI (thrift://host:port)")
    return value


Identifier = Annotated[str, AfterValidator(_identifier)]


class CatalogConfig(Section):
    """Where and whether a run registers its tables (and publishes curated_meta)."""

    kind: Literal["none", "hive", "unity", "glue"] = "none"
    # The Hive/Glue database, or the Unity schema, holding the tables.
    database: Identifier = "lakeshard"
    # The Unity catalog (``unity`` only): tables are <catalog>.<database>.<table>.
    catalog: Identifier | None = None
    # A standalone Hive metastore (``hive`` only); unset: Spark's embedded one.
    metastore_uri: Annotated[str, AfterValidator(_thrift_uri)] | None = None
    # Keep the Delta table `curated_meta` (the curated columns without image bytes and
    # vectors) in step with the Lance table, for SQL engines that cannot read Lance.
    publish_curated_meta: bool = False
    # Each registered table's comment starts with this.
    comment_prefix: str = "lakeshard"

    @model_validator(mode="after")
    def _kind_fields(self) -> CatalogConfig:
        if self.kind == "unity" and self.catalog is None:
            raise FieldError("catalog", "kind unity needs the Unity catalog to register "
                             "into (tables are <catalog>.<database>.<table>)")
        if self.kind != "unity" and self.catalog is not None:
            raise FieldError("catalog", f"only kind unity has a catalog above the "
                             f"database; kind {self.kind} uses `database` alone")
        if self.metastore_uri is not None and self.kind != "hive":
            raise FieldError("metastore_uri", f"only kind hive takes a metastore URI (kind "
                             f"{self.kind} uses the platform's own metastore)")
        if "'" in self.comment_prefix or "\\" in self.comment_prefix:
            raise FieldError("comment_prefix", "must not hold quotes or backslashes")
        return self

    @property
    def enabled(self) -> bool:
        """Whether runs register tables at all."""
        return self.kind != "none"

    @property
    def embedded(self) -> bool:
        """Whether this is Spark's embedded (Derby) Hive metastore under the root."""
        return self.kind == "hive" and self.metastore_uri is None

    @property
    def namespace(self) -> str:
        """The qualified database the tables go in (``cat.schema`` for Unity)."""
        return f"{self.catalog}.{self.database}" if self.kind == "unity" else self.database

    def qualified(self, table: str) -> str:
        """A table's qualified name in this catalog."""
        return f"{self.namespace}.{table}"
