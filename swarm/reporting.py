"""Metrics where ML people look: `--report-to tensorboard` and `--report-to wandb` mirror a peer's
JSONL records, under the same names, into TensorBoard event files and a Weights & Biases run.

The JSONL files (swarm/runlog.py) stay the source of truth and are always written; a `Reporter`
receives each record after it was written:

- `steps.jsonl` records (learner, in-process trainer) at their `step`;
- the sampler's `progress` events at their count (0, 1, 2, ...), wall time from the record.

Numeric values only (bool as 0/1); a dict one level down (`dropped`, `refused`, ...) is flattened as
`dropped/stale`. A sink that fails mid-run is logged once and dropped: training goes on.

wandb runs offline (files under RUN_DIR/wandb, `wandb sync` uploads them later) unless
`WANDB_API_KEY` is set or `WANDB_MODE` says otherwise, so no account is needed.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any, Iterable

logger = logging.getLogger(__name__)

REPORT_SINKS = ("none", "jsonl", "tensorboard", "wandb")
# sink -> (module that must be importable, pip extra that installs it)
REQUIRES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
TENSORBOARD_DIR = "tensorboard"
SKIPPED = frozenset({"time", "step"})  # the x axis, not a curve


def check_report_to(sinks: Iterable[str]) -> list[str]:
    """The sinks, checked: known names, `none` alone, and the package each needs installed (a
    one-line error naming the pip extra, at start-up rather than at the first step)."""
    sinks = list(dict.fromkeys(sinks))
    for sink in sinks:
        if sink not in REPORT_SINKS:
            raise ValueError(f"--report-to {sink!r} is not a sink; choose from: {', '.join(REPORT_SINKS)}")
    if "none" in sinks and len(sinks) > 1:
        raise ValueError("--report-to none means no sink besides the JSONL files; drop it or the others")
    for sink in sinks:
        if sink in REQUIRES:
            module, extra = REQUIRES[sink]
            if importlib.util.find_spec(module) is None:
                raise ValueError(f"--report-to {sink} needs the {module!r} package: pip install 'gepo-swarm[{extra}]'")
    return sinks


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric values under their JSONL names; nested dicts one level, as `outer/inner`."""
    found: dict[str, float] = {}
    for key, value in record.items():
        if key in SKIPPED:
            continue
        if isinstance(value, dict):
            for inner, v in value.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    found[f"{key}/{inner}"] = float(v)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            found[key] = float(value)
    return found


class _TensorBoard:
    def __init__(self, run_dir: Path, config: dict | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))

    def log(self, values: dict[str, float], step: int, wall_time: float | None) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step, walltime=wall_time)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, config: dict | None) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "gepo-swarm"), name=Path(run_dir).name,
                              dir=os.environ.get("WANDB_DIR", str(run_dir)), config=config or {}, mode=mode,
                              reinit="finish_previous")

    def log(self, values: dict[str, float], step: int, wall_time: float | None) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": _TensorBoard, "wandb": _Wandb}


PRIVATE_CONFIG = ("certificate",)  # config fields that stay out of TensorBoard and wandb


class Reporter:
    """Mirrors records into the chosen sinks (`jsonl` and `none` add none: the JSONL is written anyway).
    Thread-safe; `close()` flushes and finishes every sink."""

    def __init__(self, run_dir: Path, sinks: Iterable[str], *, config: dict | None = None) -> None:
        self._sinks = {}
        # a run's config goes to the sinks as their run config: never its credentials
        config = {k: v for k, v in (config or {}).items() if k not in PRIVATE_CONFIG}
        for name in check_report_to(sinks):
            if name in SINKS:
                try:
                    self._sinks[name] = SINKS[name](Path(run_dir), config)
                except Exception as exc:  # e.g. wandb online without a login: the run goes on without it
                    logger.warning("--report-to %s could not start (%s: %s); the JSONL goes on without it",
                                   name, type(exc).__name__, exc)
        self._lock = threading.Lock()
        self._progress = 0

    @property
    def sinks(self) -> list[str]:
        return list(self._sinks)

    def step(self, record: dict[str, Any]) -> None:
        """A `steps.jsonl` record, at its step."""
        self._log(scalars(record), int(record.get("step", 0)), record.get("time"))

    def event(self, record: dict[str, Any]) -> None:
        """An `events.jsonl` record: the sampler's `progress` events are reported, at their count."""
        if record.get("event") != "progress" or not self._sinks:
            return
        with self._lock:
            index, self._progress = self._progress, self._progress + 1
        self._log(scalars({k: v for k, v in record.items() if k != "event"}), index, record.get("time"))

    def _log(self, values: dict[str, float], step: int, wall_time: float | None) -> None:
        with self._lock:
            for name, sink in list(self._sinks.items()):
                try:
                    sink.log(values, step, wall_time)
                except Exception as exc:  # a reporting sink must never stop training
                    logger.warning("--report-to %s failed (%s: %s); it is dropped, the JSONL goes on",
                                   name, type(exc).__name__, exc)
                    del self._sinks[name]

    def close(self) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for name, sink in sinks.items():
            try:
                sink.close()
            except Exception as exc:
                logger.warning("--report-to %s failed to close (%s: %s)", name, type(exc).__name__, exc)
