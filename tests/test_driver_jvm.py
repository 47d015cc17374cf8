"""The driver JVM of a process that starts its own Spark (etl/runtime/jvm.py): the
class archive made once, published only when complete, then mapped; one dumper at a
time; the quick JIT flag."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from support import REPO

from etl.runtime.jvm import QUICK_JIT, archive_key, driver_jvm


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # exited and reaped: no such process (pids are not reused at once)


def test_options_without_an_archive_then_with_one(tmp_path):
    assert driver_jvm(False, True, str(tmp_path), [], "", may_dump=True).options == [QUICK_JIT]
    assert driver_jvm(False, False, str(tmp_path), [], "", may_dump=True).options == []

    # A query command's JVM does not write one (its classes are fewer).
    assert driver_jvm(True, True, str(tmp_path), [], "", may_dump=False).options == [
        QUICK_JIT]
    first = driver_jvm(True, True, str(tmp_path), [], "", may_dump=True)
    folder = tmp_path / "jvm"
    dumps = [o for o in first.options if o.startswith("-XX:ArchiveClassesAtExit=")]
    assert first.options[0] == QUICK_JIT and len(dumps) == 1
    assert dumps[0].endswith(f".{os.getpid()}.tmp") and first.lock.read_text() == str(
        os.getpid())
    # The lock is ours and we are alive: a second process neither dumps nor maps.
    assert driver_jvm(True, True, str(tmp_path), [], "", may_dump=True).options == [QUICK_JIT]

    # Published (what _publish does once the JVM exited): later runs map it.
    first.dump.write_bytes(b"archive")
    os.replace(first.dump, first.archive)
    first.lock.unlink()
    later = driver_jvm(True, True, str(tmp_path), [], "", may_dump=True)
    assert f"-XX:SharedArchiveFile={first.archive}" in later.options
    assert later.dump is None and not any(folder.glob("*.lock"))


def test_a_dead_runs_lock_and_dump_are_taken_over(tmp_path):
    key = archive_key([], f"{QUICK_JIT} ")
    folder = tmp_path / "jvm"
    folder.mkdir()
    (folder / f"spark-{key}.lock").write_text(str(_dead_pid()))
    (folder / f"spark-{key}.123.tmp").write_bytes(b"half")
    jvm = driver_jvm(True, True, str(tmp_path), [], "", may_dump=True)
    assert jvm.dump is not None and jvm.lock.read_text() == str(os.getpid())
    assert not (folder / f"spark-{key}.123.tmp").exists()


def test_the_key_follows_the_jars_and_the_options(tmp_path):
    jar = tmp_path / "extra.jar"
    jar.write_bytes(b"x")
    key = archive_key([str(jar)], "-Xmx4g")
    assert archive_key([str(jar)], "-Xmx4g") == key
    assert archive_key([str(jar)], "-Xmx64g") != key
    assert archive_key([], "-Xmx4g") != key
    jar.write_bytes(b"xy")
    assert archive_key([str(jar)], "-Xmx4g") != key


_START = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from support import make_config
    from etl.session import get_spark

    cfg = make_config({root!r})
    cfg = cfg.model_copy(update={{"storage": cfg.storage.model_copy(
        update={{"cache_dir": {cache!r}}})}})
    spark = get_spark(cfg, archive_classes=True)
    print("OPTIONS", spark.sparkContext.getConf().get("spark.driver.extraJavaOptions"))
    print("COUNT", spark.range(5).count())
""")


def test_two_runs_the_first_archives_the_second_maps_its_classes(tmp_path):
    cache = tmp_path / "cache"
    script = _START.format(tests=str(REPO / "tests"), root=str(tmp_path / "root"),
                           cache=str(cache))

    def run(env=None) -> str:
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                             text=True, timeout=600, env={**os.environ, **(env or {})})
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    first = run()
    assert "COUNT 5" in first and "-XX:ArchiveClassesAtExit=" in first and QUICK_JIT in first
    folder = cache / "jvm"
    archives = list(folder.glob("spark-*.jsa"))
    # Published whole once the JVM exited: no dump, no lock left behind.
    assert len(archives) == 1 and archives[0].stat().st_size > 1 << 20
    assert not list(folder.glob("*.tmp")) and not list(folder.glob("*.lock"))
    # The JVM's own log of where each class came from (an environment setting: not
    # part of the archive's key): Spark's classes from the archive on top of Java's.
    loaded = tmp_path / "classes.log"
    second = run({"JAVA_TOOL_OPTIONS": f"-Xlog:class+load=info:file={loaded}"})
    assert "COUNT 5" in second and f"-XX:SharedArchiveFile={archives[0]}" in second
    assert "ArchiveClassesAtExit" not in second
    # (Lambdas and generated classes are defined at run time, and the extra JARs' --
    # Delta's -- come through Spark's own class loader: neither can be archived.)
    spark_classes = [line for line in loaded.read_text().splitlines()
                     if " org.apache.spark." in line]
    mapped = [line for line in spark_classes if "shared objects file (top)" in line]
    from_jars = [line for line in spark_classes if "/pyspark/jars/" in line]
    assert len(mapped) > 3000 and len(from_jars) < 0.05 * len(mapped), from_jars[:5]
    archives[0].unlink()  # ~180 MB: not left in pytest's kept temp folders


def test_stamps_resolve_each_folder_once_and_say_what_stamp_says(tmp_path):
    """The archive key's file stamps, each folder resolved once, are the strings the
    one-path stamp gives: for files in a folder reached through a link, and for a file
    that is itself a link (resolved to its target, whose size it has)."""
    import os

    from etl.runtime.jvm import _stamp, _stamps

    real = tmp_path / "real"
    real.mkdir()
    (real / "a.jar").write_bytes(b"a" * 3)
    (real / "b.jar").write_bytes(b"b" * 5)
    (tmp_path / "elsewhere.jar").write_bytes(b"c" * 7)
    os.symlink(tmp_path / "elsewhere.jar", real / "c.jar")
    os.symlink(real, tmp_path / "via")
    paths = [str(tmp_path / "via" / n) for n in ("a.jar", "b.jar", "c.jar")]
    assert _stamps(paths) == [_stamp(p) for p in paths]
    assert _stamps(paths)[0].startswith(f"{os.path.realpath(real)}/a.jar:3:")
    assert _stamps(paths)[2].startswith(f"{os.path.realpath(tmp_path)}/elsewhere.jar:7:")
