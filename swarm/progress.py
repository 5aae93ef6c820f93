"""Progress of the long steps: evaluation, checkpoint writes, version downloads, the staleness study.

A rich bar when the output is a terminal; plain lines when it is not (a log file, a pipe), at
most one every LINE_EVERY_S seconds per step and none for a step shorter than that:

    eval, 4 samples per problem: 120/200 problems, 12 s
    eval, 4 samples per problem: 200/200 problems, done in 19 s

The library never prints on its own: a long step reports to a `Progress` it is given (the CLI or
a peer makes one, `progress_for`) and reports nothing when given None. Tasks may be advanced from
several threads (a chunked fetch's workers).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, TextIO

LINE_EVERY_S = 5.0  # plain lines: at most one per step this often, the first after as long (short steps stay quiet)


def amount(completed: float, total: float | None, unit: str) -> str:
    """"120/200 problems", "40.0/120.0 MB" (unit "bytes"), "7 runs" (no total)."""
    if unit == "bytes":
        return f"{completed / 1e6:.1f} MB" if total is None else f"{completed / 1e6:.1f}/{total / 1e6:.1f} MB"
    done = f"{completed:g}" if total is None else f"{completed:g}/{total:g}"
    return f"{done} {unit}".rstrip()


class ProgressTask:
    """One long step: `advance(n)`, `update(completed=, total=, note=)`; `close()` (or leaving a
    `with` block) ends it. Made by `Progress.task`."""

    def __init__(self, sink: "Progress", label: str, total: float | None, *, unit: str, delay_s: float, keep: bool) -> None:
        self.sink, self.label, self.total, self.unit, self.delay_s, self.keep = sink, label, total, unit, delay_s, keep
        self.completed: float = 0
        self.note = ""
        self.started = sink.clock()
        self.closed = False
        self.lines = 0  # plain lines printed for it
        self.last_line = self.started

    @property
    def elapsed(self) -> float:
        return self.sink.clock() - self.started

    def advance(self, n: float = 1) -> None:
        with self.sink.lock:
            self.completed += n
        self.sink.changed(self)

    def update(self, *, completed: float | None = None, total: float | None = None, note: str | None = None) -> None:
        with self.sink.lock:
            if completed is not None:
                self.completed = completed
            if total is not None:
                self.total = total
            if note is not None:
                self.note = note
        self.sink.changed(self)

    def line(self, *, final: bool = False) -> str:
        when = f"done in {self.elapsed:.0f} s" if final else f"{self.elapsed:.0f} s"
        return f"{self.label}: {amount(self.completed, self.total, self.unit)}, {when}" + (f" ({self.note})" if self.note else "")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sink.closed(self)

    def __enter__(self) -> "ProgressTask":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Progress:
    """Where long steps report how far they are. `task(...)` starts one; `echo(line)` prints a line
    that does not break a bar on screen."""

    terminal = False

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.RLock()

    def task(self, label: str, total: float | None = None, *, unit: str = "", delay_s: float = 0.0,
             keep: bool = False) -> ProgressTask:
        """A step of `total` `unit`s (None: unknown; unit "bytes" shows MB), shown only once it has
        run `delay_s` seconds; `keep`: its bar stays on screen once it ends."""
        task = ProgressTask(self, label, total, unit=unit, delay_s=delay_s, keep=keep)
        self.changed(task)
        return task

    def echo(self, line: str) -> None:
        raise NotImplementedError

    def changed(self, task: ProgressTask) -> None:
        raise NotImplementedError

    def closed(self, task: ProgressTask) -> None:
        raise NotImplementedError


class LineProgress(Progress):
    """Plain lines through `echo` (a log file, a pipe, a peer's output)."""

    def __init__(self, echo: Callable[[str], None], *, every_s: float = LINE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock=clock)
        self._echo, self.every_s = echo, every_s

    def echo(self, line: str) -> None:
        self._echo(line)

    def changed(self, task: ProgressTask) -> None:
        now = self.clock()
        with self.lock:
            if (task.closed or now - task.started < max(task.delay_s, self.every_s) or now - task.last_line < self.every_s
                    or (task.total is not None and task.completed >= task.total)):  # the closing line says that
                return
            task.last_line, task.lines = now, task.lines + 1
            line = task.line()
        self._echo(line)

    def closed(self, task: ProgressTask) -> None:
        if task.lines:  # a step long enough to have been reported says when it ends
            self._echo(task.line(final=True))


class RichProgress(Progress):
    """A rich progress display, live while any task is open (one display per console: tasks share it)."""

    terminal = True

    def __init__(self, console=None, *, stream: TextIO | None = None, transient: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress as Bar, TextColumn, TimeElapsedColumn

        super().__init__(clock=clock)
        self.console = console or Console(file=stream or sys.stderr)
        self.bar = Bar(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[amount]}"),
                       TimeElapsedColumn(), TextColumn("{task.fields[note]}"), console=self.console, transient=transient)
        self._ids: dict[ProgressTask, int] = {}  # tasks on screen -> their rich task id

    def echo(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False)  # above the bar while it is live

    def changed(self, task: ProgressTask) -> None:
        with self.lock:
            if task.closed:
                return
            fields = {"amount": amount(task.completed, task.total, task.unit), "note": task.note}
            if task in self._ids:
                self.bar.update(self._ids[task], completed=task.completed, total=task.total, **fields)
                return
            if self.clock() - task.started < task.delay_s:
                return
            if not any(not t.closed for t in self._ids):
                self.bar.start()
            self._ids[task] = self.bar.add_task(task.label, total=task.total, completed=task.completed, **fields)

    def closed(self, task: ProgressTask) -> None:
        with self.lock:
            if task not in self._ids:
                return
            if task.keep:
                self.bar.update(self._ids[task], completed=task.completed, total=task.total or task.completed,
                                amount=amount(task.completed, task.total, task.unit), note=task.note)
            else:
                self.bar.remove_task(self._ids.pop(task))
            if not any(not t.closed for t in self._ids):  # nothing open: the display ends (kept bars stay printed)
                self.bar.stop()
                for done in list(self._ids):
                    self.bar.remove_task(self._ids.pop(done))


def progress_for(stream: TextIO | None = None, *, echo: Callable[[str], None] | None = None,
                 transient: bool = True) -> Progress:
    """A rich bar on `stream` (default stderr) when it is a terminal, else plain lines through
    `echo` (default: written to `stream`)."""
    stream = stream or sys.stderr
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return RichProgress(stream=stream, transient=transient)
    return LineProgress(echo or (lambda line: print(line, file=stream, flush=True)))
