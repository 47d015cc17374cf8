"""What a run shows: the console prints people the stage lines and the summary (text) or
one JSON object per event (json), errors included; every event lands in
events.jsonl, and the console leaves logging as it found it."""

from __future__ import annotations

import json
import logging


def test_console_text_json_and_the_events_file(tmp_path, capsys):
    from etl.runtime.progress import EventsFile, console, event, say

    log = logging.getLogger("etl.something")
    root_handlers = logging.getLogger().handlers[:]
    events = tmp_path / "events.jsonl"
    with EventsFile(str(events)):
        with console("text"):
            event("stage_start", stage="curate")
            say("curate: started")
            log.info("detail nobody asked for")
            log.warning("a warning people should see")
        err = capsys.readouterr().err
        assert err.splitlines() == ["[lakeshard] curate: started",
                                    "WARNING etl.something: a warning people should see"]
        with console("json"):
            event("stage_end", stage="curate", seconds=1.5)
            say("curate: done")  # a line for people: not in JSON mode
            log.info("an info record")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert [(e["event"], e.get("stage"), e.get("message")) for e in lines] == [
            ("stage_end", "curate", None), ("log", None, "an info record")]
        assert lines[1]["level"] == "INFO" and lines[1]["logger"] == "etl.something"
        with console("text", verbose=True):
            event("progress", stage="curate", tasks_done=1)
        assert '"event": "progress"' in capsys.readouterr().err
    event("after", stage="none")  # the file is closed: not recorded
    assert [json.loads(line)["event"] for line in events.read_text().splitlines()] == [
        "stage_start", "stage_end", "progress"]
    assert logging.getLogger().handlers == root_handlers  # the console restored logging


def test_json_console_errors_are_json_too(tmp_path, capsys):
    from etl.cli import main

    conf = tmp_path / "c.yaml"
    conf.write_text(json.dumps({"storage": {"root": str(tmp_path)}, "sources": [
        {"name": "s", "kind": "image_folder", "path": str(tmp_path)}],
        "run": {"budgets": {"examples": 0}}}))
    assert main(["--log-format", "json", "--conf", str(conf), "curate"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    err = json.loads(line)
    assert err["event"] == "error" and err["exit_code"] == 2
    assert "run.budgets.examples: must be >= 1" in err["message"]
