"""Weight versions: deltas reconstruct published bf16 weights bit for bit, chains of deltas,
snapshots for late joiners, and corrupt or misapplied payloads are detected."""

import pytest
import torch

from swarm.fabric.weight_delta import CorruptVersion, apply_payload, encode_delta, encode_snapshot, payload_header, state_hash


def published(model) -> dict:
    """What a learner publishes: its fp32 master weights cast to the samplers' dtype."""
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


def train_versions(n: int, lr: float = 1e-5):  # RL learning rates for LLMs: 1e-6..1e-5
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    versions = [published(model)]
    for _ in range(n):
        loss = model(torch.randn(16, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        versions.append(published(model))
    return versions


def test_chain_of_deltas_reconstructs_every_version_bit_for_bit():
    versions = train_versions(10)
    payloads = [encode_delta(versions[i], versions[i + 1], base_version=i, version=i + 1) for i in range(10)]
    snapshot = encode_snapshot(versions[0], 0)
    version, state = apply_payload(snapshot)
    assert version == 0
    for i, payload in enumerate(payloads):
        version, state = apply_payload(payload, state)
        assert version == i + 1
        assert state_hash(state) == state_hash(versions[i + 1])
        assert all(torch.equal(state[k].view(torch.int16), versions[i + 1][k].view(torch.int16)) for k in state)
    # at an RL-like learning rate a bf16 version differs in few elements: the delta is much smaller
    assert max(len(p) for p in payloads) < 0.3 * len(snapshot)


def test_a_late_joiner_starts_from_a_snapshot_of_any_version():
    versions = train_versions(3)
    version, state = apply_payload(encode_snapshot(versions[3], 3))
    assert version == 3 and state_hash(state) == state_hash(versions[3])


def test_unchanged_and_fully_changed_tensors():
    a = {"w": torch.zeros(100, dtype=torch.bfloat16), "x": torch.ones(4)}
    b = {"w": torch.arange(100, dtype=torch.bfloat16), "x": torch.ones(4)}
    _, state = apply_payload(encode_delta(a, b, base_version=0, version=1), a)
    assert torch.equal(state["w"], b["w"]) and torch.equal(state["x"], b["x"])


def test_tampered_payload_is_detected():
    versions = train_versions(2)
    payload = bytearray(encode_delta(versions[0], versions[1], base_version=0, version=1))
    payload[len(payload) // 2] ^= 0xFF
    with pytest.raises(CorruptVersion):
        apply_payload(bytes(payload), versions[0])
    with pytest.raises(CorruptVersion, match="does not decode"):
        apply_payload(b"not a payload")


def test_delta_applied_to_the_wrong_base_is_refused():
    versions = train_versions(3)
    delta = encode_delta(versions[1], versions[2], base_version=1, version=2)
    assert payload_header(delta)["base"] == 1
    with pytest.raises(CorruptVersion, match="does not apply to this base"):
        apply_payload(delta, versions[0])
    with pytest.raises(CorruptVersion, match="no base was given"):
        apply_payload(delta)


def test_mismatched_versions_cannot_be_delta_encoded():
    with pytest.raises(ValueError, match="tensor names differ"):
        encode_delta({"a": torch.zeros(2)}, {"b": torch.zeros(2)}, base_version=0, version=1)
    with pytest.raises(ValueError, match="send a snapshot"):
        encode_delta({"a": torch.zeros(2)}, {"a": torch.zeros(3)}, base_version=0, version=1)
