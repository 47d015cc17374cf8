"""The driver JVM of a process that starts its own Spark: a nightly `lakeshard run`
(``local[*]``, or the client driver of a standalone cluster) pays the JVM's start every
night -- loading and verifying Spark's, Scala's and Delta's classes, and compiling the
planner's code while it runs -- for what is, on a quiet night, a few seconds of work.
Two settings for such a process:

* **Class data sharing** (``spark.driver_jvm.class_archive``). The first run archives
  the classes the driver loaded (a dynamic AppCDS archive, ``-XX:ArchiveClassesAtExit``),
  once per Java, class path and Java options (:func:`archive_key`) and by a pipeline
  run (not a query command, whose classes are fewer), into the machine's cache
  (``<cache>/jvm/``; 180 MB for a run of curate, dedup and export); later runs map it
  at start (``-XX:SharedArchiveFile``) instead of loading and verifying each class. One
  process dumps at a time (a lock file); the archive is published (renamed into place)
  only once its JVM exited cleanly, so a killed run leaves none half-written. A JVM
  that finds the archive does not match (another Java, other JARs) runs without it.
* **Quick JIT** (``spark.driver_jvm.quick_jit``): ``-XX:TieredStopAtLevel=1``, the
  client compiler only. A short run's JVM code (planning, small scans, MERGEs) is
  compiled sooner and more cheaply; lakeshard's per-row work runs in Python workers.

Neither applies where the JVM was started before lakeshard's code runs (spark-submit,
Databricks, EMR steps, a notebook's session): the platform owns those JVMs' options.
Measured in docs/performance.md ("Cold nights").
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from etl.runtime.lock import pid_alive

log = logging.getLogger(__name__)

__all__ = ["DriverJvm", "archive_key", "driver_jvm", "starts_own_jvm"]

QUICK_JIT = "-XX:TieredStopAtLevel=1"
# A dump lock older than this is a run that died holding it.
_STALE_LOCK_S = 6 * 3600
# How long a run waits at exit for its JVM to write the archive.
_DUMP_WAIT_S = 300
# Archives of other keys (another pyspark, other JARs) not used for this long: removed
# when a new one is made.
_UNUSED_ARCHIVE_S = 30 * 86400


def starts_own_jvm() -> bool:
    """Whether building a SparkSession now launches the driver JVM from this process
    (no JVM yet, and not a Python driver that spark-submit started behind a JVM)."""
    from pyspark import SparkContext

    return (SparkContext._active_spark_context is None
            and "PYSPARK_GATEWAY_PORT" not in os.environ)


def _java() -> Path | None:
    java_home = os.environ.get("JAVA_HOME")
    found = Path(java_home, "bin", "java") if java_home else shutil.which("java")
    return Path(found).resolve() if found and Path(found).exists() else None


def _stamp(path: str | Path) -> str:
    st = os.stat(path)
    return f"{os.path.realpath(path)}:{st.st_size}:{int(st.st_mtime)}"


def _stamps(paths: list[str]) -> list[str]:
    """:func:`_stamp` of each of `paths`, the same strings, with each folder resolved
    once: ``realpath`` walks every component of a path (0.3 s for pyspark's ~300 JARs,
    before the JVM starts), and a file that is not a link is its resolved folder's."""
    folders: dict[str, str] = {}
    out = []
    for path in paths:
        folder, name = os.path.split(path)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            out.append(_stamp(path))
            continue
        if folder not in folders:
            folders[folder] = os.path.realpath(folder)
        out.append(f"{os.path.join(folders[folder], name)}:{st.st_size}:{int(st.st_mtime)}")
    return out


def archive_key(jars: list[str], java_options: str) -> str:
    """What a class archive is valid for: the Java binary, pyspark's JARs and the
    extra ones (paths, sizes, times), and the other Java options (with the heap size:
    above 32 GB the JVM's object layout, and so the archive, differs)."""
    import pyspark

    java = _java()
    spark_jars = sorted(glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars",
                                               "*.jar")))
    parts = [_stamp(java) if java else "java?", pyspark.__version__, java_options,
             *_stamps(spark_jars), *_stamps([j for j in jars if os.path.exists(j)])]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@dataclass
class DriverJvm:
    """The Java options of the driver about to start, and the archive it may dump."""
    options: list[str]
    dump: Path | None = None  # the temporary archive this JVM writes at exit
    archive: Path | None = None  # where the dump is published
    lock: Path | None = None

    @property
    def java_options(self) -> str:
        return " ".join(self.options)

    def publish_at_exit(self, spark) -> None:
        """When this JVM dumps an archive: at interpreter exit, stop Spark, let the JVM
        exit, wait for its dump and publish it (a JVM that failed publishes nothing)."""
        if self.dump is None:
            return
        proc = getattr(spark.sparkContext._gateway, "proc", None)
        atexit.register(self._publish, spark, proc)

    def _publish(self, spark, proc) -> None:
        try:
            if proc is not None:
                spark.stop()
                if proc.stdin is not None:
                    proc.stdin.close()  # the gateway exits when its stdin closes
                try:
                    rc = proc.wait(timeout=_DUMP_WAIT_S)
                except subprocess.TimeoutExpired:  # still dumping: published by no one
                    rc = None
                if rc == 0 and self.dump.exists() and self.dump.stat().st_size > 0:
                    os.replace(self.dump, self.archive)
                    log.info("driver JVM: class archive written to %s", self.archive)
        finally:
            if self.dump.exists():
                self.dump.unlink()
            if self.lock is not None and self.lock.exists():
                self.lock.unlink()


def _take_lock(lock: Path) -> bool:
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if not _stale(lock):
                return False
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _stale(lock: Path) -> bool:
    try:
        pid = int(lock.read_text() or 0)
        age = time.time() - lock.stat().st_mtime
    except (OSError, ValueError):
        return True
    return pid <= 0 or age > _STALE_LOCK_S or not pid_alive(pid)


def _prune(folder: Path, key: str) -> None:
    """Dumps of this key a killed run left, and other keys' archives long unused."""
    for left in folder.glob(f"spark-{key}.*.tmp"):
        left.unlink(missing_ok=True)
    for other in folder.glob("spark-*.jsa"):
        try:
            if time.time() - other.stat().st_mtime > _UNUSED_ARCHIVE_S:
                other.unlink()
        except OSError:
            pass


def driver_jvm(class_archive: bool, quick_jit: bool, cache_dir: str, jars: list[str],
               configured: str, *, may_dump: bool) -> DriverJvm:
    """lakeshard's options for a driver JVM this process starts (see the module's text;
    the configured ones follow them, and so win). `jars`: the extra JARs; `configured`:
    the Java options and heap size configured (both part of the archive's key);
    `may_dump`: this process runs the pipeline, whose classes are the ones to archive
    (a query command's or a probe's would make a thin archive, kept for good)."""
    options = [QUICK_JIT] if quick_jit else []
    if not class_archive:
        return DriverJvm(options)
    folder = Path(cache_dir, "jvm")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("driver JVM: no class archive (cannot create %s: %s)", folder, exc)
        return DriverJvm(options)
    key = archive_key(jars, " ".join([*options, configured]))
    archive = folder / f"spark-{key}.jsa"
    quiet = "-Xlog:cds=off,cds+dynamic=off"  # a mismatch runs without it, silently
    if archive.exists():
        os.utime(archive)  # last used now (see _prune)
        return DriverJvm([*options, f"-XX:SharedArchiveFile={archive}", quiet])
    lock = folder / f"spark-{key}.lock"
    if not may_dump or not _take_lock(lock):
        return DriverJvm(options)  # another run is writing it
    _prune(folder, key)
    dump = folder / f"spark-{key}.{os.getpid()}.tmp"
    return DriverJvm([*options, f"-XX:ArchiveClassesAtExit={dump}", quiet], dump, archive,
                     lock)
