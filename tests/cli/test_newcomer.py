"""What a newcomer meets first (issue 47): error messages that say what is wrong and what to do,
and the TRL-style options and commands a TRL user looks for. Each runs the real `swarm` command."""

import json
import os
import subprocess
import sys

SWARM = [sys.executable, "-m", "swarm.cli"]


def run(*args, timeout=300, env=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([*SWARM, *args], capture_output=True, text=True, timeout=timeout, env=env)


def write_sums(path, rows=12):
    path.write_text("\n".join(json.dumps({"question": f"Compute {i}+1.", "answer": str(i + 1)}) for i in range(rows)) + "\n")
    return path


# -- error messages


def test_an_empty_or_broken_jsonl_file_says_what_is_wrong_and_where(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = run("eval", "--task", str(empty), "--no-greedy")
    assert out.returncode == 2, out.stderr
    assert f"dataset file {empty} is empty: it holds no rows" in out.stderr

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "1"}\n{"question": "b", answer: 2}\n')
    out = run("eval", "--task", str(broken), "--no-greedy")
    assert out.returncode == 2, out.stderr
    assert f"dataset file {broken}, line 2: not valid JSON" in out.stderr
    assert "Generating train split" not in out.stderr  # datasets' progress text stays out of the output


def test_datasets_progress_text_stays_off_stderr(tmp_path):
    sums = write_sums(tmp_path / "sums.jsonl")
    out = run("eval", "--task", str(sums), "--split", "all", "--eval-problems", "2", "--eval-samples", "1", "--no-greedy",
              "--max-completion-length", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert "examples/s" not in out.stderr and "Generating" not in out.stderr, out.stderr
