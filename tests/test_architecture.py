"""The structure the layer contracts (pyproject.toml, run by `make test`) cannot see."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def _import_graph() -> dict[str, set[str]]:
    import grimp

    graph = grimp.build_graph("etl", "udfs", cache_dir=None)
    return {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}


def test_no_import_cycles_in_etl_or_udfs():
    graph = _import_graph()
    # Tarjan's strongly connected components: any component of 2+ modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_parsing_config_imports_neither_spark_nor_any_other_layer():
    code = (
        "import sys; from etl.config import load_config; load_config(None); "
        "bad = sorted(m for m in sys.modules if m.startswith(('pyspark', 'udfs', 'lance', "
        "'etl.')) and not m.startswith(('etl.config', 'etl.errors'))); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout.strip()
    assert out == "[]"


def test_lakeshard_reads_lance_through_spark_only_by_lance_reader():
    """A pipeline run's session registers format ``lance`` on first use
    (`etl.writers.lance.lance_reader`): a plain ``format("lance")`` in lakeshard's own
    code would fail there on a night that had not read a Lance table before it."""
    import re

    plain = re.compile(r"""\.format\(\s*["']lance["']\s*\)|USING\s+lance\b""", re.I)
    offenders = []
    for path in sorted([*(REPO / "etl").rglob("*.py"), *(REPO / "udfs").rglob("*.py")]):
        if path == REPO / "etl" / "writers" / "lance.py":
            continue  # defines lance_reader; its docstrings show plain usage
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if plain.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
