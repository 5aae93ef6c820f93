"""What a peer is set up from: its configuration (defaults < config file < command line), learner
checkpoints, peer bans, and the sampler's latency simulation."""

import json
import random
import subprocess
import sys

import pytest
import torch

from peers.learner_setup import check_run_dir
from swarm.checkpoint import latest_checkpoint, list_checkpoints, load_optimizer_state, save_checkpoint
from swarm.config import LearnerConfig, SamplerConfig, read_config_file, resolve, write_config
from swarm.fabric.rollouts.bans import PeerBans
from swarm.fabric.weights.follower import usable_version
from swarm.staleness import SecondsDelay
from swarm.training import staleness_histogram

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"
KEY = "W293bmVyOnNzaC1yc2EgQUFBQV0="


@pytest.mark.parametrize("suffix, text", [
    (".toml", f'run_id = "r1"\npeers = ["{PEER}"]\nlr = 0.5\n[learner]\nlr = 2e-5\nsteps = 7\n[sampler]\ngroup_size = 3\n'),
    (".yaml", f"run_id: r1\npeers: ['{PEER}']\nlr: 0.5\nlearner:\n  lr: 2.0e-5\n  steps: 7\nsampler:\n  group_size: 3\n"),
    (".json", json.dumps({"run_id": "r1", "peers": [PEER], "lr": 0.5, "learner": {"lr": 2e-5, "steps": 7}, "sampler": {"group_size": 3}})),
])
def test_config_file_sections_and_command_line_precedence(tmp_path, suffix, text):
    path = tmp_path / f"swarm{suffix}"
    path.write_text(text)
    learner = resolve("learner", path, {"steps": 9})
    assert (learner.run_id, learner.peers, learner.learning_rate, learner.steps) == ("r1", [PEER], 2e-5, 9)  # [learner] over top level, CLI over file
    assert learner.groups_per_step == LearnerConfig.model_fields["groups_per_step"].default
    with pytest.raises(ValueError, match="unknown setting"):
        read_config_file(path, "sampler")  # the top-level lr is not a sampler setting


def test_written_config_reads_back_identically(tmp_path):
    config = LearnerConfig(peers=[PEER], lr=3e-5, run_dir=tmp_path / "run", loss="grpo")
    path = write_config(config, tmp_path / "run" / "config.yaml")
    assert resolve("learner", path, {}) == config


@pytest.mark.parametrize("values, message", [
    ({}, "no --peers given"),
    ({"peers": ["not-an-address"]}, "is not a multiaddr"),
    ({"peers": [PEER], "loss": "ppo"}, "Input should be 'gepo', 'grpo'"),
    ({"peers": [PEER], "lr": 0}, "greater than 0"),
])
def test_bad_learner_settings_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        LearnerConfig(**values)


def test_sampler_needs_a_valid_learner_key_and_delay():
    with pytest.raises(ValueError, match="no --learner-key given"):
        SamplerConfig(peers=[PEER])
    with pytest.raises(ValueError, match="bad pickup delay"):
        SamplerConfig(peers=[PEER], learner_keys=[KEY], pickup_delay="gamma:3")
    assert SamplerConfig(peers=[PEER], learner_keys=[KEY], pickup_delay="lognormal:6,192").lag_steps == 0


def test_unparseable_config_file_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("lr = = 3")
    with pytest.raises(ValueError, match="bad.toml could not be parsed"):
        read_config_file(path, "learner")
    with pytest.raises(ValueError, match="use a .toml"):
        read_config_file(path.rename(tmp_path / "bad.ini"), "learner")


def tiny_policy():
    from swarm.model.loading import load_policy

    return load_policy("embedded")


def test_checkpoints_are_complete_loadable_and_pruned(tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny_policy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    for version in (2, 4, 6, 8):
        save_checkpoint(tmp_path, model, tokenizer, optimizer, version=version, digest=f"h{version}", config={"lr": 1e-3}, keep=2)
    (tmp_path / "checkpoints" / "version-000010").mkdir()  # a half-written one (no state.json): never used
    assert [c.version for c in list_checkpoints(tmp_path)] == [6, 8]
    last = latest_checkpoint(tmp_path)
    assert last.version == 8 and last.hash == "h8" and last.config == {"lr": 1e-3}
    reloaded = AutoModelForCausalLM.from_pretrained(last.path)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    fresh = torch.optim.AdamW(reloaded.parameters(), lr=1e-3)
    load_optimizer_state(last, fresh)
    assert fresh.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


def test_run_dir_is_not_reused_by_accident(tmp_path):
    config = LearnerConfig(peers=[PEER], run_dir=tmp_path)
    (tmp_path / "steps.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="pass --resume"):
        check_run_dir(config)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        check_run_dir(config.model_copy(update={"resume": True}))


def test_bans_follow_strikes_within_the_window_and_expire():
    now = [0.0]
    bans = PeerBans(strikes=3, window_s=10, ban_s=60, clock=lambda: now[0])
    assert not bans.strike("a") and not bans.strike("a")
    now[0] = 11.0  # the first two strikes age out of the window
    assert not bans.strike("a") and not bans.strike("a") and bans.strike("a")
    assert bans.remaining("a") == pytest.approx(60) and bans.remaining("b") == 0 and bans.banned() == ["a"]
    now[0] = 72.0
    assert bans.remaining("a") == 0 and bans.banned() == []


def test_pickup_delays_stay_within_their_bounds():
    rng = random.Random(0)
    draws = [SecondsDelay.parse("lognormal:6,192").draw(rng) for _ in range(2000)]
    assert min(draws) >= 6 and max(draws) <= 192
    assert 25 < sorted(draws)[1000] < 45  # median near the geometric mean of the bounds, ~34 s
    assert SecondsDelay.parse("fixed:3").draw(rng) == 3 and SecondsDelay.parse("none").draw(rng) == 0
    assert all(0 <= SecondsDelay.parse("uniform:2").draw(rng) <= 2 for _ in range(100))


def test_sampler_version_choice_honours_pickup_time_and_lag():
    ready = {0: 0.0, 1: 5.0, 2: 10.0, 3: 50.0}
    assert usable_version([0, 1, 2, 3], ready, 3, 0, now=12.0, have_one=True) == 2  # 3 is not due yet
    assert usable_version([0, 1, 2, 3], ready, 3, 2, now=60.0, have_one=True) == 1  # at least 2 behind
    assert usable_version([0], ready, 0, 3, now=60.0, have_one=False) == 0  # a first version even when too new
    assert usable_version([0], ready, 0, 3, now=60.0, have_one=True) is None  # keep what it has


def test_staleness_histogram_buckets():
    hist = staleness_histogram([0, 0, 1, 2, 3, 5, 40, 64, 100])
    assert hist == {"0": 2, "1": 1, "2-3": 2, "4-7": 1, "8-15": 0, "16-31": 0, "32-63": 1, "64+": 2}


def test_peers_sharing_an_identity_dir_get_their_own_keys(tmp_path):
    code = ("import sys, time; from swarm.fabric.membership.identity import claim_identity_slot;"
            "print(claim_identity_slot(sys.argv[1], 'sampler'), flush=True); time.sleep(30)")
    first = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "sampler"
        second = subprocess.run([sys.executable, "-c", code.replace("time.sleep(30)", "0"), str(tmp_path)],
                                capture_output=True, text=True, timeout=60)
        assert second.stdout.strip() == "sampler-1"  # the first is still running
    finally:
        first.kill()
        first.wait()
    again = subprocess.run([sys.executable, "-c", code.replace("time.sleep(30)", "0"), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert again.stdout.strip() == "sampler"  # a restarted peer gets its slot (and peer id) back


def test_the_loss_is_a_table_in_a_config_file_and_the_command_line_overrides_one_field(tmp_path):
    path = tmp_path / "swarm.toml"
    path.write_text(f'peers = ["{PEER}"]\n[learner]\nlearning_rate = 3e-5\nloss = {{ name = "gspo", epsilon_high = 0.01 }}\n')
    config = resolve("learner", path, {"loss": {"beta": 0.1}})
    assert (config.loss.name, config.loss.epsilon_high, config.loss.beta) == ("gspo", 0.01, 0.1)
    assert resolve("learner", path, {"loss": {"name": "grpo"}}).loss.name == "grpo"


def test_one_warm_up_schedule_by_version():
    from swarm.training import warmup_factor

    assert [warmup_factor(v, 4) for v in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def test_loss_tables_merge_field_by_field_across_the_file_and_the_command_line(tmp_path):
    path = tmp_path / "swarm.toml"
    path.write_text(f'peers = ["{PEER}"]\nloss = {{ name = "grpo", kl_coef = 0.2 }}\n[learner]\nloss = {{ eps_low = 0.3 }}\n')
    config = resolve("learner", path, {"loss": {"epsilon": 0.25}})
    # the [learner] table's loss adds to the top-level one; aliases inside the table are the fields'
    assert (config.loss.name, config.loss.beta, config.loss.epsilon) == ("grpo", 0.2, 0.25)
