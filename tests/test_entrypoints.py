"""Entry points: the console scripts and `etl/entrypoints/*.py` (what spark-submit and
the platforms' wheel tasks call) all reach the CLI's `main`, with their arguments.
The deploy files (deploy/*.json) and the entry points' exit statuses:
tests/test_platform_deploy.py, with the platforms' own client libraries."""

from __future__ import annotations

from importlib import import_module

import pytest
import yaml
from support import REPO, console_scripts


def _resolve(target: str):
    module, _, func = target.partition(":")
    return getattr(import_module(module), func)


def test_console_scripts_and_entrypoint_files_point_at_main():
    scripts = console_scripts()
    for name in ("lakeshard", "lakeshard-run", "lakeshard-curate", "lakeshard-export"):
        assert callable(_resolve(scripts[name])), name
    for path in sorted((REPO / "etl" / "entrypoints").glob("[a-z]*.py")):
        mod = import_module(f"etl.entrypoints.{path.stem}")
        assert callable(mod.main) and 'if __name__ == "__main__"' in path.read_text()


def test_entrypoint_passes_its_arguments_to_the_subcommand(tmp_path, capsys):
    from etl.entrypoints import run as run_entry

    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"storage": {"root": str(tmp_path)}, "run": {"stages": ["x"]},
                                    "sources": [{"name": "a", "kind": "image_folder",
                                                 "path": str(tmp_path)}]}))
    with pytest.raises(SystemExit) as exit_:  # the config reached `run`, and the
        run_entry.main(["--conf", str(conf)])  # entry point exits with its status
    assert exit_.value.code == 2
    assert "run.stages[0]: unknown stage 'x'" in capsys.readouterr().err
