"""`--report-to` (swarm/reporting.py): TensorBoard event files and an offline wandb run hold the
values of steps.jsonl under the same names; bad sinks are usage errors; a failing sink is dropped
while training goes on; `swarm plot RUN_DIR` draws a trainer's and a learner's curves."""

from __future__ import annotations

import glob
import json
import logging
import math
import struct
import time

import pytest

from swarm.runlog import read_jsonl

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """A tiny in-process trainer run reporting to jsonl and tensorboard."""
    from peers.trainer import run_trainer
    from swarm.config import TrainerConfig

    run_dir = tmp_path_factory.mktemp("trainer")
    config = TrainerConfig(steps=3, groups_per_step=2, num_generations=4, eval_every=3, eval_problems=2, eval_samples=1,
                           seed=5, report_to=["jsonl", "tensorboard"])
    run_trainer(config, run_dir=run_dir)
    return run_dir


@pytest.mark.timeout(300)
def test_tensorboard_event_files_hold_the_values_of_steps_jsonl(trainer_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = read_jsonl(trainer_run / "steps.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3]
    events = EventAccumulator(str(trainer_run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    names = ["reward_mean", "loss", "grad_norm", "kl_sampler_learner", "staleness_mean", "learning_rate", "staleness_hist/0"]
    assert set(names) <= tags
    assert "time" not in tags and "step" not in tags  # the axes, not curves
    for name in names:
        outer, _, inner = name.partition("/")
        written = [(r["step"], r[outer][inner] if inner else r[outer]) for r in steps]
        read = [(e.step, e.value) for e in events.Scalars(name)]
        assert [s for s, _ in read] == [s for s, _ in written], name
        for (_, got), (_, want) in zip(read, written):
            assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12), (name, got, want)  # float32 in the file


def _wandb_history(run_file: str) -> list[dict]:
    """The history rows of an offline wandb run: its .wandb file is a LevelDB-style log of protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = open(run_file, "rb").read(), 32768
    pos, partial, chunks = 7, b"", []  # a 7-byte file header, then records in 32 KiB blocks
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind in (2, 3):
            partial += chunk
        elif kind == 4:
            chunks.append(partial + chunk)
            partial = b""
    rows = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.timeout(120)
def test_wandb_runs_offline_without_an_account_and_holds_the_values(tmp_path, monkeypatch):
    from swarm.reporting import Reporter

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    records = [{"step": 1, "loss": 0.5, "reward_mean": 0.25, "dropped": {"stale": 2}, "banned": [], "time": 1.0},
               {"step": 2, "loss": 0.125, "reward_mean": 0.75, "dropped": {"stale": 3}, "time": 2.0}]
    reporter = Reporter(tmp_path / "run", ["jsonl", "wandb"], config={"loss": {"name": "gepo"}})
    assert reporter.sinks == ["wandb"]
    for record in records:
        reporter.step(record)
    reporter.close()
    # wandb's service process writes the run file on its own time: under load (a CI lane) the rows
    # may land a moment after finish() returns, so the file is read until both are there (30 s at most)
    deadline, rows = time.monotonic() + 30, []
    while True:
        runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
        rows = _wandb_history(runs[0]) if len(runs) == 1 else []
        if len(rows) >= len(records) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(runs) == 1
    assert [(r["_step"], r["loss"], r["reward_mean"], r["dropped/stale"]) for r in rows] == [(1, 0.5, 0.25, 2), (2, 0.125, 0.75, 3)]
    assert all("time" not in r for r in rows)


def test_a_failing_sink_is_dropped_once_and_the_rest_goes_on(tmp_path, monkeypatch, caplog):
    from swarm import reporting

    seen = []

    class Flaky:
        def __init__(self, run_dir, config):
            pass

        def log(self, values, step, wall_time):
            seen.append(step)
            raise OSError("disk full")

        def close(self):
            raise AssertionError("a dropped sink is not closed")

    monkeypatch.setitem(reporting.SINKS, "tensorboard", Flaky)
    reporter = reporting.Reporter(tmp_path, ["tensorboard"])
    with caplog.at_level(logging.WARNING, logger="swarm.reporting"):
        for step in (1, 2, 3):
            reporter.step({"step": step, "loss": 1.0})
    reporter.close()
    assert seen == [1]
    assert reporter.sinks == []
    assert len([r for r in caplog.records if "disk full" in r.getMessage()]) == 1


def test_sampler_progress_events_are_reported_at_their_count(tmp_path, monkeypatch):
    from swarm import reporting

    logged = []

    class Sink:
        def __init__(self, run_dir, config):
            pass

        def log(self, values, step, wall_time):
            logged.append((step, values, wall_time))

        def close(self):
            pass

    monkeypatch.setitem(reporting.SINKS, "wandb", Sink)
    reporter = reporting.Reporter(tmp_path, ["wandb"])
    reporter.event({"time": 5.0, "event": "version_fetched", "version": 3, "bytes": 100})
    reporter.event({"time": 6.0, "event": "progress", "version": 3, "behind": 1, "groups_per_s": 2.5,
                    "refused": {"stale": 4}})
    reporter.event({"time": 7.0, "event": "progress", "version": 4, "behind": 0, "groups_per_s": 3.0, "refused": {}})
    assert logged == [(0, {"version": 3.0, "behind": 1.0, "groups_per_s": 2.5, "refused/stale": 4.0}, 6.0),
                      (1, {"version": 4.0, "behind": 0.0, "groups_per_s": 3.0}, 7.0)]


def test_report_to_is_checked_at_start_up(monkeypatch):
    import importlib.util

    from pydantic import ValidationError

    from swarm.config import LearnerConfig, SamplerConfig, TrainerConfig

    assert TrainerConfig().report_to == ["jsonl"]
    with pytest.raises(ValidationError, match="'none', 'jsonl', 'tensorboard' or 'wandb'"):
        TrainerConfig(report_to=["tensorbored"])
    with pytest.raises(ValidationError, match="none means no sink"):
        TrainerConfig(report_to=["none", "wandb"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValidationError, match=r"pip install 'gepo-swarm\[wandb\]'"):
        TrainerConfig(report_to=["wandb"])
    assert TrainerConfig(report_to=["tensorboard", "jsonl"]).report_to == ["tensorboard", "jsonl"]
    for model in (LearnerConfig, SamplerConfig):
        assert "report_to" in model.model_fields


def test_cli_names_the_bad_sink_and_the_choices():
    from click.testing import CliRunner

    from swarm.cli import main

    result = CliRunner().invoke(main, ["sampler", "--report-to", "tb", "--peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX"])
    assert result.exit_code == 2
    assert "'tb'" in result.output and "tensorboard" in result.output and "wandb" in result.output


def test_swarm_plot_draws_a_trainer_run_and_a_learner_run(trainer_run, tmp_path):
    from click.testing import CliRunner

    from swarm.cli import main

    result = CliRunner().invoke(main, ["plot", str(trainer_run)])
    assert result.exit_code == 0, result.output
    assert (trainer_run / "curves.png").read_bytes().startswith(PNG)
    assert "3 steps" in result.output

    learner = tmp_path / "demo" / "learner"  # a swarm demo's directory: the learner's steps one level down
    learner.mkdir(parents=True)
    with open(learner / "steps.jsonl", "w") as f:
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "version": step, "reward_mean": step / 10, "loss": -step / 100, "groups": 4,
                                "staleness_mean": 1.5, "staleness_max": 3, "dropped": {"stale": 1}, "time": step}) + "\n")
        f.write('{"step": 6, "reward_')  # a record being written
    out = tmp_path / "learner.png"
    result = CliRunner().invoke(main, ["plot", str(tmp_path / "demo"), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(PNG) and "5 steps" in result.output


def test_swarm_plot_refuses_a_directory_without_steps(tmp_path):
    from click.testing import CliRunner

    from swarm.cli import main

    (tmp_path / "events.jsonl").write_text('{"time": 1, "event": "progress"}\n')
    result = CliRunner().invoke(main, ["plot", str(tmp_path)])
    assert result.exit_code == 2
    assert "holds no steps.jsonl" in result.output
    assert not (tmp_path / "curves.png").exists()


def _tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.timeout(400)
def test_learner_and_sampler_processes_report_to_tensorboard(tmp_path):
    """Real peers on loopback: the learner's event files hold its steps.jsonl, the sampler's its progress events."""
    import os
    import subprocess
    import sys

    from swarm.runlog import wait_ready

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = (tmp_path / "peers.log").open("w")
    procs = []

    def spawn(*args):
        procs.append(subprocess.Popen([sys.executable, "-m", "swarm.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                      env=env))
        return procs[-1]

    def ready(run_dir, proc):
        found = wait_ready(run_dir, timeout_s=120, alive=lambda: proc.poll() is None)
        assert found is not None, (tmp_path / "peers.log").read_text()[-3000:]
        return found

    try:
        boot = spawn("bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp_path / "boot.key"),
                     "--run-dir", str(tmp_path / "boot"))
        addr = ready(tmp_path / "boot", boot)["addresses"][0]
        learner = spawn("learner", "--peers", addr, "--steps", "3", "--groups-per-step", "2", "--run-dir",
                        str(tmp_path / "run"), "--identity-dir", str(tmp_path / "learner"), "--checkpoint-every", "0",
                        "--report-to", "jsonl", "--report-to", "tensorboard")
        ready(tmp_path / "run", learner)
        sampler = spawn("sampler", "--peers", addr, "--learner-key-file", str(tmp_path / "run" / "learner.key"),
                        "--prompts-per-round", "2", "--num-generations", "4", "--identity-dir", str(tmp_path / "sampler"),
                        "--run-dir", str(tmp_path / "sampler-run"), "--progress-every-s", "0.5",
                        "--report-to", "tensorboard")
        assert learner.wait(timeout=300) == 0, (tmp_path / "peers.log").read_text()[-3000:]
        # the learner announced the end of its run: the sampler leaves by itself (a SIGTERM now would
        # race its own clean exit)
        assert sampler.wait(timeout=120) == 0, (tmp_path / "peers.log").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        log.close()

    steps = read_jsonl(tmp_path / "run" / "steps.jsonl")
    scalars = _tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in scalars["reward_mean"]] == [r["step"] for r in steps] == [1, 2, 3]
    for (_, got), record in zip(scalars["reward_mean"], steps):
        assert math.isclose(got, record["reward_mean"], rel_tol=1e-6)
    assert "used_total" in scalars  # the learner's own counters too
    progress = [e for e in read_jsonl(tmp_path / "sampler-run" / "events.jsonl") if e["event"] == "progress"]
    sampled = _tensorboard_scalars(tmp_path / "sampler-run" / "tensorboard")
    assert progress and [v for _, v in sampled["groups_per_s"]] == pytest.approx([e["groups_per_s"] for e in progress])
