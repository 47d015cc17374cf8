"""The wheel: built from the checkout's files, it holds the package, the configs and the
entry points, and requires nothing a platform runtime already brings."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile

from support import REPO, console_scripts


def test_wheel_contains_the_package_configs_and_entry_points(tmp_path):
    src = tmp_path / "src"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((REPO / rel).read_bytes())
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    (whl,) = (tmp_path / "dist").glob("lakeshard-*-py3-none-any.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
        metadata = next(z.read(n).decode() for n in names
                        if n.endswith(".dist-info/METADATA"))
    # What a platform runtime brings is never a hard requirement: installing the wheel
    # there leaves its pyspark, Delta and GPU stack alone (docs/operations.md).
    assert "Requires-Python: <3.14,>=3.11" in metadata
    hard = {re.split(r"[<>=!~ ;\[]", line.split(": ", 1)[1])[0].lower()
            for line in metadata.splitlines()
            if line.startswith("Requires-Dist: ") and "extra ==" not in line}
    runtime = {"pyspark", "delta-spark", "torch", "torchvision", "transformers",
               "sentence-transformers", "matplotlib", "duckdb", "scikit-image", "vllm"}
    assert hard and not hard & runtime, hard & runtime
    assert {"pylance", "mosaicml-streaming", "deltalake"} <= hard
    assert {"pyspark", "delta-spark"} <= {
        re.split(r"[<>=!~ ;\[]", line.split(": ", 1)[1])[0].lower()
        for line in metadata.splitlines() if 'extra == "spark"' in line}
    assert {"conf/local.yaml", "conf/databricks.yaml", "conf/emr.yaml",
            "etl/entrypoints/run.py", "udfs/images.py"} <= names
    for script, target in console_scripts().items():
        assert f"{script} = {target}" in entry_points
