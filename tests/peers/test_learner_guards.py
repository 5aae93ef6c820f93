"""What keeps a learner's policy sound: a step whose loss or gradient is not finite changes
nothing and is reported; a version with non-finite weights is never taken from a holder; a resumed
learner verifies its checkpoint's weights and falls back to an older one when the newest is
damaged; published.json is replaced whole."""

import json

import pytest
import torch

from swarm.checkpoint import latest_checkpoint, list_checkpoints, load_verified, save_checkpoint
from swarm.config import LossConfig
from swarm.fabric.weights.versions import VersionStore
from swarm.fabric.weights.delta import CorruptVersion, encode_snapshot, legacy_state_hash, non_finite_tensors, state_hash
from swarm.model.loading import load_policy
from swarm.rollouts import RolloutGroup
from swarm.tied_weights import unique_state
from swarm.training import LearnerCore, NonFiniteStep


def groups(tokenizer, temperature: float):
    ids = tokenizer.encode("\\boxed{4}", add_special_tokens=False)
    return [RolloutGroup(problem_id=f"p{i}", prompt_ids=tokenizer.encode("Compute 2+2.", add_special_tokens=False),
                         completion_ids=[ids, ids[:3]], sampler_logprobs=[[-1.0] * len(ids), [-1.0] * 3],
                         rewards=[1.0, 0.0], version=0, sampler_id="s", temperature=temperature) for i in range(2)]


def test_a_step_with_a_non_finite_loss_changes_nothing():
    model, tokenizer = load_policy("embedded")
    core = LearnerCore(model, tokenizer.pad_token_id, loss=LossConfig(name="grpo"))
    before = state_hash({k: v.detach().clone() for k, v in model.state_dict().items()})
    # logits divided by a subnormal temperature: the learner's log-probs, and so the loss, are NaN
    # (the intake refuses such groups; this is the guard behind it)
    with pytest.raises(NonFiniteStep, match="skipped") as caught:
        core.step(groups(tokenizer, 1e-40))
    assert caught.value.metrics["grad_norm"] != caught.value.metrics["grad_norm"] or caught.value.metrics["loss"] != caught.value.metrics["loss"]
    assert core.version == 0 and not core.optimizer.state  # no AdamW step was taken
    assert state_hash({k: v.detach() for k, v in model.state_dict().items()}) == before
    metrics = core.step(groups(tokenizer, 1.0))  # and the learner steps on the next sound batch
    assert core.version == 1 and metrics["learning_rate"] > 0


class OneSnapshot:
    """A holder over no network: serves one given snapshot payload (the fetch logic is the product's)."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def fetch(self, holder, want, want_hash, store):
        from swarm.fabric.weights.rebuilding_client import RebuildingClient

        client = RebuildingClient()
        client._payloads = lambda *_: [self.payload]
        return client.fetch(holder, want, want_hash, store)


def test_a_signed_version_with_non_finite_weights_is_never_taken():
    state = {"w": torch.tensor([1.0, float("nan")]), "b": torch.zeros(2)}
    assert non_finite_tensors(state) == ["w"]
    # finite weights whose sum overflows are finite; an infinity of either sign, or both, is not
    big = {"h": torch.full((8,), 60000.0, dtype=torch.float16), "f": torch.full((4,), 3e38),
           "i": torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16), "j": torch.tensor([float("inf"), float("-inf")]),
           "k": torch.ones(3, dtype=torch.int64)}
    assert non_finite_tensors(big) == ["i", "j"]
    store = VersionStore()
    with pytest.raises(CorruptVersion, match="non-finite weights"):
        OneSnapshot(encode_snapshot(state, 3)).fetch("holder", 3, state_hash(state), store)
    assert store.latest is None


def test_resume_verifies_the_checkpoint_and_falls_back_past_a_damaged_one(tmp_path):
    model, tokenizer = load_policy("embedded")
    core = LearnerCore(model, tokenizer.pad_token_id)
    for version in (2, 4):
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
        digest = state_hash(unique_state(model))  # as Learner.master_hash: the tied embedding once
        save_checkpoint(tmp_path, model, tokenizer, core.optimizer, version=version, digest=digest, config={})
    newest = latest_checkpoint(tmp_path)
    weights = newest.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the newest checkpoint's weights
    weights.write_bytes(bytes(data))
    warnings = []
    checkpoint, learner, _ = load_verified(tmp_path, lambda m, t: LearnerCore(m, t.pad_token_id), warn=warnings.append)
    assert checkpoint.version == 2 and len(warnings) == 1 and "version-000004" in warnings[0] and "hash" in warnings[0]
    assert state_hash(unique_state(learner.model)) == checkpoint.hash
    # a checkpoint written before weight format 4 (sha256 over every name, the tied one twice) still resumes
    legacy = json.loads((checkpoint.path / "state.json").read_text())
    legacy["hash"] = legacy_state_hash({k: v.detach() for k, v in learner.model.state_dict().items()})
    (checkpoint.path / "state.json").write_text(json.dumps(legacy))
    assert load_verified(tmp_path, lambda m, t: LearnerCore(m, t.pad_token_id), warn=warnings.append)[0].version == 2
    assert len(warnings) == 2  # the damaged newest one again, nothing else
    (list_checkpoints(tmp_path)[0].path / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(FileNotFoundError, match="all damaged"):
        load_verified(tmp_path, lambda m, t: LearnerCore(m, t.pad_token_id), warn=warnings.append)


def test_published_json_is_replaced_whole(tmp_path):
    from swarm.runlog import write_json_atomic

    path = write_json_atomic(tmp_path / "published.json", {"version": 3, "hash": "a" * 64})
    write_json_atomic(path, {"version": 4, "hash": "b" * 64})
    assert json.loads(path.read_text())["version"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["published.json"]  # no temporary file left behind
