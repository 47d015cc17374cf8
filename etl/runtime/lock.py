"""One run at a time per storage root: a lock with stale-lock recovery, on a local (or
mounted) file system or on S3.

The lock is a small JSON document (pid, host, run id, start, heartbeat) that only one
run can create: on a file system with ``O_CREAT | O_EXCL``; on S3 with a conditional
write (``PutObject`` with ``If-None-Match: *``, which S3 answers with 412 for all but
the first of two racing writers). While a run holds it, a thread rewrites the heartbeat
every ``heartbeat_s`` (on S3 only if the object is still the one it wrote:
``If-Match: <ETag>``). A later run treats the lock as stale -- a crashed run -- when its
process is gone (same host) or its heartbeat is older than ``stale_after_s`` (any host);
it then takes the lock over -- locally by renaming the stale file aside (one rename
wins), on S3 by overwriting it ``If-Match`` the stale ETag (one write wins) -- and
reports the crashed run's id so the ledger can mark it. Otherwise it refuses, naming the
holder.

Before trusting S3, a run checks once per process that the store honours
``If-None-Match`` (a store that ignored it would let two runs both "win"); one that does
not is refused with a message pointing at ``run.lock_path``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlparse

from etl.errors import ConfigError, RunLockedError

__all__ = ["RunLockedError", "LockInfo", "RunLock", "pid_alive"]

log = logging.getLogger(__name__)

_S3_SCHEMES = ("s3", "s3a")


@dataclass(frozen=True)
class LockInfo:
    pid: int
    host: str
    run_id: str
    started: float
    heartbeat: float
    # The holder's process start time (Linux clock ticks since boot), so that a reused
    # pid is not mistaken for the holder; None where /proc is not available.
    pid_start: int | None = None


def _proc_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22, counted after the parenthesised command name (which may hold spaces).
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (one we may not signal does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parse(body: bytes, modified: float) -> LockInfo:
    try:
        return LockInfo(**json.loads(body))
    except (ValueError, TypeError):
        # Half-written by a run killed while creating it: as good as stale.
        return LockInfo(pid=-1, host="?", run_id="?", started=modified, heartbeat=modified)


# ------------------------------------------------------------------------ backends
# create(body) -> token | None (None: it exists); read() -> (LockInfo, token) | None;
# take_over(token, body) -> token | None (None: someone else moved first);
# beat(token, body) -> token | None (None: no longer ours); remove(token).


class _FileBackend:
    def __init__(self, path: str) -> None:
        self.path = path

    def create(self, body: bytes) -> str | None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        return "file"

    def read(self) -> tuple[LockInfo, str] | None:
        try:
            with open(self.path, "rb") as f:
                body = f.read()
            return _parse(body, os.stat(self.path).st_mtime), "file"
        except FileNotFoundError:
            return None

    def take_over(self, token: str, body: bytes) -> str | None:
        # Move the stale lock aside atomically: of two runs recovering it at once, only
        # one rename succeeds; then create it anew (a third run may still win that).
        aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return None
        os.remove(aside)
        return self.create(body)

    def beat(self, token: str, body: bytes) -> str | None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, self.path)
        return token

    def remove(self, token: str) -> None:
        os.remove(self.path)


class _S3Backend:
    """The lock as one S3 object, every change conditional on what the run last saw."""

    _checked: set[tuple[str | None, str]] = set()  # (endpoint, bucket) known to honour 412

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.url = url
        self.bucket, self.key = parsed.netloc, parsed.path.strip("/")
        self.client = _s3_client()

    @staticmethod
    def _code(exc) -> str:
        return str(exc.response.get("Error", {}).get("Code", ""))

    def _put(self, body: bytes, **cond) -> str | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body,
                                          ContentType="application/json", **cond)["ETag"]
        except ClientError as exc:
            if self._code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict",
                                   "409", "NoSuchKey", "404"):
                return None
            raise

    def check_conditional_writes(self) -> None:
        """Refuse a store that ignores If-None-Match (two runs could both win)."""
        where = (self.client.meta.endpoint_url, self.bucket)
        if where in self._checked:
            return
        from botocore.exceptions import ClientError

        probe = f"{self.key}.probe-{uuid.uuid4().hex[:12]}"
        put = dict(Bucket=self.bucket, Key=probe, Body=b"{}", IfNoneMatch="*")
        self.client.put_object(**put)
        try:
            self.client.put_object(**put)
            honoured = False
        except ClientError as exc:
            honoured = self._code(exc) in ("PreconditionFailed", "412",
                                           "ConditionalRequestConflict", "409")
            if not honoured and self._code(exc) not in ("NotImplemented", "501",
                                                        "InvalidArgument", "400"):
                raise
        finally:
            self.client.delete_object(Bucket=self.bucket, Key=probe)
        if not honoured:
            raise ConfigError(
                f"run.lock_path: the object store behind {self.url} ignores conditional "
                "writes (If-None-Match), so two runs could both take the lock there. Set "
                "run.lock_path to a POSIX path every driver sees, or `run.lock: false` when "
                "the scheduler alone prevents overlapping runs"
            )
        self._checked.add(where)

    def create(self, body: bytes) -> str | None:
        return self._put(body, IfNoneMatch="*")

    def read(self) -> tuple[LockInfo, str] | None:
        from botocore.exceptions import ClientError

        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as exc:
            if self._code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return _parse(obj["Body"].read(), obj["LastModified"].timestamp()), obj["ETag"]

    def take_over(self, token: str, body: bytes) -> str | None:
        return self._put(body, IfMatch=token)

    def beat(self, token: str, body: bytes) -> str | None:
        return self._put(body, IfMatch=token)

    def remove(self, token: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=token)
        except ClientError as exc:
            if self._code(exc) not in ("PreconditionFailed", "412", "NoSuchKey", "404"):
                raise


def _s3_client():
    """boto3 on the process's S3 settings (etl.storage.use_storage put them in the
    environment), standard retries."""
    import boto3
    from botocore.config import Config

    from etl.config.runtime import S3_RETRIES, S3Config

    s = S3Config().resolve(os.environ)
    retries = {
        "mode": os.environ.get("AWS_RETRY_MODE") or S3_RETRIES["mode"],
        "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or S3_RETRIES["max_attempts"]),
    }
    config = Config(retries=retries, connect_timeout=10, read_timeout=30,
                    s3={"addressing_style": "path" if s.path_style else "auto"})
    return boto3.session.Session().client("s3", endpoint_url=s.endpoint,
                                          region_name=s.region, config=config)


class RunLock:
    """``with RunLock(path, run_id):`` -- or ``acquire()`` / ``release()``. `path` is a
    local/mounted file or an ``s3://bucket/key``."""

    def __init__(self, path: str, run_id: str, *, stale_after_s: float = 600,
                 heartbeat_s: float = 30):
        self.path = path
        self.run_id = run_id
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.host = socket.gethostname()
        self.pid = os.getpid()
        # The run whose stale lock this one took over (it crashed), if any.
        self.recovered: LockInfo | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.time()
        self._token: str | None = None
        scheme = urlparse(path).scheme if "://" in path else ""
        self._backend = _S3Backend(path) if scheme in _S3_SCHEMES else _FileBackend(path)

    # ------------------------------------------------------------------ state

    def read(self) -> LockInfo | None:
        state = self._backend.read()
        return None if state is None else state[0]

    def is_stale(self, info: LockInfo, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if info.host == self.host and info.pid > 0:
            if not pid_alive(info.pid):
                return True
            if info.pid_start is not None and _proc_start(info.pid) not in (None,
                                                                           info.pid_start):
                return True  # the pid now belongs to another process
        return now - info.heartbeat > self.stale_after_s

    def _payload(self) -> bytes:
        return json.dumps({
            "pid": self.pid, "host": self.host, "run_id": self.run_id,
            "started": self._started, "heartbeat": time.time(),
            "pid_start": _proc_start(self.pid),
        }).encode()

    def _mine(self, info: LockInfo | None) -> bool:
        return info is not None and info.pid == self.pid and info.run_id == self.run_id

    # ------------------------------------------------------------------ protocol

    def acquire(self) -> RunLock:
        if isinstance(self._backend, _S3Backend):
            self._backend.check_conditional_writes()
        for _ in range(5):
            token = self._backend.create(self._payload())
            if token is None:
                state = self._backend.read()
                if state is None:
                    continue  # released between our create and read
                info, seen = state
                if not self.is_stale(info):
                    age = time.time() - info.heartbeat
                    raise RunLockedError(
                        f"another lakeshard run holds {self.path}: run {info.run_id}, pid "
                        f"{info.pid} on {info.host}, heartbeat {age:.0f} s ago. Wait for it "
                        f"to finish; if it is dead, its lock goes stale after "
                        f"{self.stale_after_s:.0f} s without a heartbeat (or at once on "
                        "its own host)."
                    ) from None
                token = self._backend.take_over(seen, self._payload())
                if token is None:
                    continue  # another run moved first: look again
                self.recovered = info
            self._token = token
            self._thread = threading.Thread(target=self._beat, name="lakeshard-lock",
                                            daemon=True)
            self._thread.start()
            return self
        raise RunLockedError(f"could not take the run lock {self.path} (contended)")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self._mine(self.read()):
                    log.error("run lock %s was taken over by another run", self.path)
                    return  # never write someone else's lock
                token = self._backend.beat(self._token, self._payload())
            except Exception as exc:  # noqa: BLE001 -- a store outage: try again next beat
                log.warning("run lock %s: heartbeat not written (%s); retrying in %s s",
                            self.path, exc, self.heartbeat_s)
                continue
            if token is None:
                log.error("run lock %s was taken over by another run", self.path)
                return
            self._token = token

    def release(self) -> None:
        """Remove the lock if it is still this run's. A store that does not answer is
        logged, not raised: the lock then goes stale (at once for a run on this host)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._mine(self.read()):
                self._backend.remove(self._token)
        except Exception as exc:  # noqa: BLE001 -- never mask the run's own error
            log.warning("run lock %s not removed (%s): the next run takes it over as stale",
                        self.path, exc)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
