"""One run at a time per storage root: a lock file with stale-lock recovery.

The lock is a small JSON file (pid, host, run id, start, heartbeat) created with
``O_CREAT | O_EXCL``, so two runs racing for it cannot both win. While a run holds it, a
thread rewrites the heartbeat every ``heartbeat_s``. A later run treats the lock as
stale -- a crashed run -- when its process is gone (same host) or its heartbeat is
older than ``stale_after_s`` (any host); it then takes the lock over and reports the
crashed run's id so the ledger can mark it. Otherwise it refuses, naming the holder.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from etl.errors import RunLockedError

__all__ = ["RunLockedError", "LockInfo", "RunLock"]


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``with RunLock(path, run_id):`` -- or ``acquire()`` / ``release()``."""

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

    # ------------------------------------------------------------------ state

    def read(self) -> LockInfo | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return LockInfo(**json.load(f))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            # Half-written by a run killed while creating it: as good as stale.
            st = os.stat(self.path)
            return LockInfo(pid=-1, host="?", run_id="?", started=st.st_mtime,
                            heartbeat=st.st_mtime)

    def is_stale(self, info: LockInfo, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if info.host == self.host and info.pid > 0:
            if not _pid_alive(info.pid):
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

    # ------------------------------------------------------------------ protocol

    def acquire(self) -> RunLock:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self.read()
                if info is None:
                    continue  # released between our open and read
                if not self.is_stale(info):
                    age = time.time() - info.heartbeat
                    raise RunLockedError(
                        f"another lakeshard run holds {self.path}: run {info.run_id}, pid "
                        f"{info.pid} on {info.host}, heartbeat {age:.0f} s ago. Wait for it "
                        f"to finish; if it is dead, its lock goes stale after "
                        f"{self.stale_after_s:.0f} s without a heartbeat (or at once on "
                        "its own host)."
                    ) from None
                # Move the stale lock aside atomically: of two runs recovering it at
                # once, only one rename succeeds; the other retries and finds ours.
                aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(self.path, aside)
                except FileNotFoundError:
                    continue
                os.remove(aside)
                self.recovered = info
                continue
            with os.fdopen(fd, "wb") as f:
                f.write(self._payload())
                f.flush()
                os.fsync(f.fileno())
            self._thread = threading.Thread(target=self._beat, name="lakeshard-lock",
                                            daemon=True)
            self._thread.start()
            return self
        raise RunLockedError(f"could not take the run lock {self.path} (contended)")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            info = self.read()
            if info is None or info.pid != self.pid or info.run_id != self.run_id:
                return  # taken over: never write someone else's lock
            tmp = f"{self.path}.{self.pid}.tmp"
            with open(tmp, "wb") as f:
                f.write(self._payload())
            os.replace(tmp, self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        info = self.read()
        if info is not None and info.pid == self.pid and info.run_id == self.run_id:
            os.remove(self.path)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
