"""Object-store access outside Spark: ``s3://bucket/prefix`` (``s3a://`` is the same
object) on AWS S3 or any S3-compatible store (MinIO, Ceph, Cloudflare R2, GCS's XML
interoperability endpoint).

Every client is configured one way: the standard AWS environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
``AWS_REGION``), overridden by ``storage.s3`` -- :func:`etl.storage.use_storage` writes
the resolved, non-secret settings back into the environment, so boto3 (:class:`S3Store`,
the MDS writer's uploader), pylance and pyarrow (:func:`filesystem`) all read the same
endpoint, region, addressing style and retry settings. Credentials come from the usual
chain (environment, profile, instance profile, web identity) and are never copied
anywhere.

Here: :class:`S3Store` -- the few operations an export and the run lock need (small JSON
objects, existence checks, listing and deleting under a prefix) --, :func:`filesystem`
(a pyarrow filesystem for a local path or an ``s3://`` URL), and :func:`write_file` /
:func:`read_file` / :func:`upload_dir` for reports and markers under the root.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlparse

from etl.config.runtime import S3_RETRIES, S3_SCHEMES, S3Config, S3Settings, is_url

__all__ = [
    "REMOTE_SCHEMES",
    "is_remote",
    "s3_settings",
    "boto3_client",
    "S3Store",
    "filesystem",
    "subtree",
    "write_file",
    "read_file",
    "upload_dir",
]

# Object stores an export can be written to (checked by etl.pipeline.preflight).
REMOTE_SCHEMES = ("s3",)


def is_remote(path: str) -> bool:
    return is_url(path)


def s3_settings() -> S3Settings:
    """The S3 settings of this process: the environment, as :func:`etl.storage.use_storage`
    left it (``storage.s3`` already applied)."""
    return S3Config().resolve(os.environ)


def boto3_client(settings: S3Settings | None = None):
    """A boto3 S3 client on `settings` (default: :func:`s3_settings`), with standard-mode
    retries (throttling, 5xx, connection errors; AWS_RETRY_MODE / AWS_MAX_ATTEMPTS win)."""
    import boto3
    from botocore.config import Config

    s = settings or s3_settings()
    retries = {
        "mode": os.environ.get("AWS_RETRY_MODE") or S3_RETRIES["mode"],
        "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or S3_RETRIES["max_attempts"]),
    }
    config = Config(
        retries=retries,
        connect_timeout=10,
        read_timeout=60,
        s3={"addressing_style": "path" if s.path_style else "auto"},
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=s.endpoint, region_name=s.region, config=config
    )


def _split(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    if parsed.scheme not in S3_SCHEMES or not parsed.netloc:
        raise ValueError(f"{url!r} is not an s3://bucket/prefix URL")
    return parsed.netloc, parsed.path.strip("/")


class S3Store:
    """Small objects under one ``s3://bucket/prefix`` (``s3a://`` accepted)."""

    def __init__(self, url: str, client=None) -> None:
        self.bucket, self.prefix = _split(url)
        self.client = client or boto3_client()

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

    def get_bytes(self, rel: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(rel))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return obj["Body"].read()

    def get_json(self, rel: str) -> Any | None:
        body = self.get_bytes(rel)
        return None if body is None else json.loads(body)

    def put_bytes(self, rel: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(rel), Body=body)

    def put_file(self, rel: str, path: str) -> None:
        """Upload the local file `path` (boto3's managed transfer, streamed from the
        file: multipart above its threshold)."""
        self.client.upload_file(path, self.bucket, self._key(rel))

    def put_json(self, rel: str, obj: Any) -> None:
        self.put_bytes(rel, json.dumps(obj, sort_keys=True).encode())

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


def filesystem(path: str):
    """``(pyarrow filesystem, path inside it)`` for a local path or an ``s3://`` URL, the
    S3 one on this process's settings (standard retries: throttling, 5xx, network)."""
    import pyarrow.fs as pafs

    if not is_url(path):
        return pafs.LocalFileSystem(), os.path.abspath(path.removeprefix("file://"))
    bucket, key = _split(path)
    s = s3_settings()
    kwargs: dict[str, Any] = {
        "region": s.region,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(
            max_attempts=int(os.environ.get("AWS_MAX_ATTEMPTS") or S3_RETRIES["max_attempts"])
        ),
    }
    if s.endpoint:
        parsed = urlparse(s.endpoint)
        kwargs["endpoint_override"] = parsed.netloc + parsed.path.rstrip("/")
        kwargs["scheme"] = parsed.scheme
        kwargs["force_virtual_addressing"] = not s.path_style
    return pafs.S3FileSystem(**kwargs), f"{bucket}/{key}".rstrip("/")


def subtree(path: str):
    """A pyarrow filesystem rooted at `path` (local or ``s3://``), for delta-rs's
    ``to_pyarrow_table`` / ``to_pyarrow_dataset(filesystem=...)``: delta-rs's own
    Python filesystem wrapper can abort the interpreter at exit ("terminate called
    without an active exception", delta-io/delta-rs#2184) in a process that did not
    start Spark; pyarrow's own filesystems do not."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(path)
    return pafs.SubTreeFileSystem(inner, fs)


def write_file(path: str, data: bytes) -> None:
    """Write `data` to `path` (local or ``s3://``), creating local parent folders. An
    ``s3://`` object goes through boto3 (standard retries on throttling and 5xx): the AWS
    C++ SDK under pyarrow gave up on a throttled GetObject mid-stream in the tests."""
    if is_url(path):
        S3Store(path).put_bytes("", data)
        return
    fs, inner = filesystem(path)
    fs.create_dir(os.path.dirname(inner), recursive=True)
    with fs.open_output_stream(inner) as f:
        f.write(data)


def read_file(path: str) -> bytes | None:
    """The bytes at `path` (local or ``s3://``, as :func:`write_file`), None when there is
    no such file."""
    import pyarrow.fs as pafs

    if is_url(path):
        return S3Store(path).get_bytes("")
    fs, inner = filesystem(path)
    if fs.get_file_info(inner).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(inner) as f:
        return f.read()


def upload_dir(local_dir: str, dest: str) -> None:
    """Copy the local folder `local_dir` to `dest` (a local path or ``s3://`` URL)."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(dest)
    pafs.copy_files(local_dir, inner, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)
