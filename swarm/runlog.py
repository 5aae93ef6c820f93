"""What a peer leaves in its run directory for tools to read (tools never parse printed text):

- `ready.json`   written once the peer has joined: its role, peer id, the addresses others join
                 through and, for a learner, the `--learner-key` token. Written atomically, so a
                 reader sees all of it or nothing.
- `steps.jsonl`  the learner's and the in-process trainer's record of every optimizer step (one
                 schema, `StepLog`).
- `events.jsonl` everything else a peer reports as it runs: versions fetched, groups sent and
                 refused, throughput, status (`EventLog`). Every record has `time` and `event`.

`read_jsonl` reads any of them while they are being written (a last line cut short is skipped).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

READY_FILE = "ready.json"
STEPS_FILE = "steps.jsonl"
EVENTS_FILE = "events.jsonl"


class JsonlLog:
    """Appends one JSON object per line and flushes it, so readers see whole records at once.
    Thread-safe (a sampler's follower thread and its main loop share one log); closing twice, or
    writing after closing, does nothing. `on_write` (a `swarm.reporting.Reporter`'s) gets each record
    once it is written."""

    def __init__(self, path: Path, *, on_write: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._lock = threading.Lock()
        self._on_write = on_write

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()
        if self._on_write is not None:
            self._on_write(record)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StepLog(JsonlLog):
    """`steps.jsonl`: one record per optimizer step: the metrics of `training.LearnerCore.step`
    (step, version, learning_rate, reward, accuracy, staleness, the loss's metrics, ...) plus
    `time`; the swarm learner adds its inbox counters, the in-process trainer its prompt digest."""

    def __init__(self, run_dir: Path, **kwargs: Any) -> None:
        super().__init__(Path(run_dir) / STEPS_FILE, **kwargs)

    def step(self, metrics: dict[str, Any], **extra: Any) -> dict[str, Any]:
        record = {**metrics, **extra, "time": time.time()}
        self.write(record)
        return record


class EventLog(JsonlLog):
    """`events.jsonl`: `event(kind, **fields)` appends {"time", "event": kind, **fields}."""

    def __init__(self, run_dir: Path, **kwargs: Any) -> None:
        super().__init__(Path(run_dir) / EVENTS_FILE, **kwargs)

    def event(self, kind: str, **fields: Any) -> None:
        self.write({"time": time.time(), "event": kind, **fields})


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write `data` as JSON so that a reader, or a restart after a crash, sees the old file or the
    new one whole: a temporary file, flushed to disk, renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(data, indent=2))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def write_ready(run_dir: Path, **info: Any) -> Path:
    """`ready.json` with `info` plus the process id and the time, written atomically."""
    return write_json_atomic(Path(run_dir) / READY_FILE, {**info, "pid": os.getpid(), "time": time.time()})


def read_ready(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / READY_FILE).read_text())
    except (OSError, ValueError):
        return None


def wait_ready(run_dir: Path, *, timeout_s: float, alive: Callable[[], bool] = lambda: True, pid: int | None = None,
               poll_s: float = 0.2) -> dict[str, Any] | None:
    """The peer's ready file once it exists (written by process `pid`, when given: a restarted
    peer's run directory still holds its predecessor's); None when `alive()` turns False first or
    time runs out."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = read_ready(run_dir)
        if found is not None and (pid is None or found.get("pid") == pid):
            return found
        if not alive():
            return None
        time.sleep(poll_s)
    return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSONL file (missing file: none; a line cut short: skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            pass  # a line being written, or cut short by a kill
    return records
