"""What a newcomer meets first (issue 47): error messages that say what is wrong and what to do,
and the TRL-style options and commands a TRL user looks for. Each runs the real `swarm` command."""

import json
import os
import subprocess
import sys

import pytest

from swarm.config import CONFIGS, resolve
from swarm.config.learner_keys import encode_learner_key

SWARM = [sys.executable, "-m", "swarm.cli"]
PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"
KEY = encode_learner_key(b"[owner:not-a-real-key]")


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


def test_an_unreadable_owner_key_is_never_advised_away(tmp_path):
    garbled = tmp_path / "owner.sign.key"
    garbled.write_bytes(b"not a key")
    out = run("authorize", "--owner-key-file", str(garbled), "--learner-key", "x", "--run-id", "r")
    assert out.returncode == 2, out.stderr
    text = " ".join(out.stderr.split())
    assert f"the run owner's key {garbled} is not a DER RSA private key" in text and "restore it from your backup" in text
    assert "move it away" not in text and "make a new one" not in text
    assert garbled.read_bytes() == b"not a key"  # left as it was

    if os.geteuid() != 0:  # root reads any file
        locked = tmp_path / "locked.sign.key"
        locked.write_bytes(b"x")
        locked.chmod(0)
        out = run("authorize", "--owner-key-file", str(locked), "--learner-key", "x", "--run-id", "r")
        assert out.returncode == 2 and "cannot be read by this user: check its permissions" in " ".join(out.stderr.split())


def test_an_option_of_another_role_names_that_role():
    out = run("learner", "--num-generations", "4")
    assert out.returncode == 2
    assert "--num-generations is a sampler option: pass it to `swarm sampler`" in " ".join(out.stderr.split())
    assert "--max-new-tokens" not in out.stderr  # click's guess, which misled
    out = run("sampler", "--temperature", "0.5")
    assert out.returncode == 2
    assert ("--temperature is a setting of the whole run, which the learner announces with every version and samplers "
            "follow: pass it to `swarm learner`") in " ".join(out.stderr.split())


def test_an_unknown_config_key_gets_a_did_you_mean_not_every_name(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[learner]\nlerning_rate = 1e-5\nnum_generations = 4\n')
    out = run("learner", "--config", str(config), "--peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX")
    assert out.returncode == 2
    text = " ".join(out.stderr.split())
    assert "'lerning_rate' is not a learner setting (did you mean learning_rate" in text  # (or lora_learning_rate)
    assert "num_generations is a sampler setting: put it in the [sampler] table" in text
    assert "adam_beta1" not in text  # no list of every name


# -- what a TRL user looks for


@pytest.mark.parametrize("role", ["learner", "sampler", "bootstrap", "demo", "eval"])
def test_swarm_config_prints_every_setting_and_reads_back_as_the_defaults(tmp_path, role):
    out = run("config", role, timeout=60)
    assert out.returncode == 0, out.stderr
    path = tmp_path / f"{role}.toml"
    path.write_text(out.stdout)
    model = CONFIGS[role]
    for name, field in model.model_fields.items():  # every setting is there, described
        assert f"\n{name} = " in out.stdout or f"\n# {name} = " in out.stdout or f"[{role}.{name}]" in out.stdout, name
        if field.description:
            assert " ".join(field.description.split()[:3]) in " ".join(out.stdout.replace("# ", "").split()), name
    required = {"learner": {"peers": [PEER]}, "sampler": {"peers": [PEER], "learner_keys": [KEY]}}.get(role, {})
    assert resolve(role, path, required) == model(**required)
    if required:  # what the file leaves for the user to fill in is said in the error
        with pytest.raises(ValueError, match="no --"):
            resolve(role, path, {})


def test_settings_from_environment_variables_sit_between_the_file_and_the_command_line(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'peers = ["{PEER}"]\n[learner]\nsteps = 7\nlearning_rate = 2e-5\nadam_beta1 = 0.8\n')
    environ = {"GEPO_SWARM_STEPS": "9", "GEPO_SWARM_LEARNING_RATE": "3e-5", "GEPO_SWARM_LOSS__BETA": "0.02",
               "GEPO_SWARM_NUM_GENERATIONS": "4",  # a sampler's setting: the learner leaves it
               "GEPO_SWARM_CACHE": "/tmp/elsewhere"}  # not a setting
    learner = resolve("learner", config, {"steps": 11}, environ=environ)
    # command line > environment > file > defaults
    assert (learner.steps, learner.learning_rate, learner.adam_beta1, learner.loss.beta) == (11, 3e-5, 0.8, 0.02)
    assert learner.max_grad_norm == CONFIGS["learner"].model_fields["max_grad_norm"].default
    env_peers = resolve("sampler", None, {}, environ={"GEPO_SWARM_PEERS": json.dumps([PEER]), "GEPO_SWARM_LEARNER_KEYS": KEY,
                                                       "GEPO_SWARM_NUM_GENERATIONS": "4"})
    assert (env_peers.peers, env_peers.learner_keys, env_peers.num_generations) == ([PEER], [KEY], 4)
    with pytest.raises(ValueError, match="GEPO_SWARM_LERNING_RATE is not a setting \\(did you mean GEPO_SWARM_LEARNING_RATE"):
        resolve("learner", config, {}, environ={"GEPO_SWARM_LERNING_RATE": "1"})


def test_the_swarm_command_reads_environment_variables():
    out = run("eval", "--eval-samples", "1", "--json", "--help", env={"GEPO_SWARM_EVAL_SAMPLES": "x"})
    assert out.returncode == 0  # --help reads no settings
    out = run("eval", "--json", env={"GEPO_SWARM_EVAL_SAMPLES": "many"}, timeout=120)
    assert out.returncode == 2 and "--eval-samples" in out.stderr and "integer" in out.stderr, out.stderr
    out = run("eval", "--eval-samples", "1", "--eval-problems", "1", "--no-greedy", "--max-completion-length", "2", "--json",
              env={"GEPO_SWARM_EVAL_SAMPLES": "many"}, timeout=120)  # the command line wins
    assert out.returncode == 0, out.stderr


def test_eval_reports_pass_at_k_and_shows_completions_with_their_rewards():
    out = run("eval", "--eval-problems", "3", "--eval-samples", "4", "--pass-at-k", "2", "--pass-at-k", "4", "--show", "3",
              "--no-greedy", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    at_k = {int(k): v for k, v in result["pass_at_k"].items()}
    assert set(at_k) == {2, 4} and result["pass_at_1"] <= at_k[2] <= at_k[4] <= 1.0
    assert len(result["shown"]) == 3 and all(s["reward"] in (0.0, 1.0) and s["prompt"] for s in result["shown"])

    out = run("eval", "--eval-problems", "2", "--eval-samples", "2", "--show", "2", "--no-greedy")
    assert out.returncode == 0, out.stderr
    assert "--- completion 1 of 2: arith-" in out.stdout and "--- completion 2 of 2" in out.stdout and "reward " in out.stdout

    out = run("eval", "--eval-samples", "2", "--pass-at-k", "4")
    assert out.returncode == 2 and "--pass-at-k 4 needs 1 <= k <= --eval-samples (2)" in " ".join(out.stderr.split())


def test_reward_funcs_and_weights_on_the_command_line():
    out = run("learner", "--peers", PEER, "--reward-funcs", "accuracy", "--reward-funcs", "fromat")
    assert out.returncode == 2 and "unknown reward 'fromat'" in out.stderr
    out = run("sampler", "--peers", PEER, "--learner-key", KEY, "--reward-funcs", "accuracy", "--reward-funcs", "format",
              "--reward-weights", "0.5")
    assert out.returncode == 2 and "--reward-weights: 1 weight(s) for 2 --reward-funcs" in " ".join(out.stderr.split())
