"""Object-store paths for exports: ``s3://bucket/prefix`` (AWS S3 or any S3-compatible
store -- MinIO, Cloudflare R2, GCS's XML interoperability endpoint -- selected with the
``S3_ENDPOINT_URL`` environment variable, the same one Mosaic Streaming's uploader and
downloader use). Credentials come from the usual boto3 chain (instance profile, env).

Only the few operations an export needs: small JSON objects (markers, indexes,
manifests), existence checks, listing and deleting under a prefix.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlparse

__all__ = ["REMOTE_SCHEMES", "is_remote", "S3Store"]

# Object stores an export can be written to (checked by etl.pipeline.preflight).
REMOTE_SCHEMES = ("s3",)


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


class S3Store:
    def __init__(self, url: str) -> None:
        import boto3

        parsed = urlparse(url)
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL")
        )

    def url(self, *parts: str) -> str:
        return "s3://" + "/".join([self.bucket, self.prefix, *[p.strip("/") for p in parts if p]])

    def _key(self, rel: str) -> str:
        return "/".join(p for p in (self.prefix, rel.strip("/")) if p)

    def exists(self, rel: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(rel))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def get_json(self, rel: str) -> Any | None:
        if not self.exists(rel):
            return None
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(rel))["Body"].read()
        return json.loads(body)

    def put_json(self, rel: str, obj: Any) -> None:
        body = json.dumps(obj, sort_keys=True).encode()
        self.client.put_object(Bucket=self.bucket, Key=self._key(rel), Body=body)

    def list(self, rel: str = "") -> list[str]:
        """Keys under `rel`, relative to this store's prefix."""
        base = self._key(rel)
        base = base + "/" if base else ""
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base
        ):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                out.append(key[len(self.prefix) + 1:] if self.prefix else key)
        return out

    def delete(self, rels: list[str]) -> None:
        for i in range(0, len(rels), 1000):
            chunk = [{"Key": self._key(r)} for r in rels[i:i + 1000]]
            if chunk:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk})
