"""Weight format 5 (format 4's tests, formats 4 and 5 alike here): older and unknown formats refused by name, round trips at every float dtype and
in the edge cases (nothing changed, everything changed, empty tensors, integer buffers), a caller's
known base hash, and tied parameters published once and re-tied on load."""

from __future__ import annotations

import zlib

import msgpack
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from swarm.fabric.weights import delta as wd
from swarm.fabric.weights import wire_layout
from swarm.fabric.weights.delta import (
    CorruptVersion,
    UnsupportedFormat,
    apply_payload,
    encode_delta,
    encode_snapshot,
    state_hash,
)
from swarm.tied_weights import load_unique_state, tied_aliases, unique_state


def assert_bit_exact(state: dict, want: dict) -> None:
    assert set(state) == set(want)
    for name, t in want.items():
        assert state[name].dtype == t.dtype and state[name].shape == t.shape, name
        assert torch.equal(state[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


# -- older and unknown formats ------------------------------------------------------------------

def _format_3_delta() -> bytes:
    body = {"v": 3, "kind": "delta", "version": 1, "base": 0, "base_hash": "0" * 64, "hash": "0" * 64, "tensors": []}
    return b"Z" + zlib.compress(msgpack.packb(body, use_bin_type=True))


def test_a_format_3_delta_is_refused_saying_which_peer_to_update():
    base = {"w": torch.zeros(4)}
    with pytest.raises(UnsupportedFormat, match="weight format 3.*older GEPO Swarm.*update that peer"):
        apply_payload(_format_3_delta(), base)
    with pytest.raises(UnsupportedFormat):
        wd.payload_header(_format_3_delta())


@pytest.mark.parametrize("v, says", [(3, "format 3.*update that peer"), (4, "format 4.*update that peer"), (6, "update this peer"),
                                     ("5", "update this peer")])
def test_a_snapshot_of_another_format_is_refused(v, says):
    payload = encode_snapshot({"w": torch.ones(3)}, 1)
    body = msgpack.unpackb(payload[1:], raw=False)
    body["v"] = v
    with pytest.raises(UnsupportedFormat, match=says):
        apply_payload(b"R" + msgpack.packb(body, use_bin_type=True))
    assert isinstance(UnsupportedFormat("x"), CorruptVersion)  # every receiver refuses it as it refuses bad data


def test_a_delta_whose_stream_inflates_past_its_declared_size_is_refused():
    a = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    b = {"w": a["w"].clone()}
    b["w"][::7] = 1
    body = wd.delta_body(encode_delta(a, b, base_version=0, version=1))
    payload = msgpack.unpackb(wd.delta_payload(body)[1:], raw=False)
    payload["gaps"][0][0] -= 1  # its one segment claims one byte less than it holds
    with pytest.raises(CorruptVersion, match="more than its"):
        apply_payload(b"C" + msgpack.packb(payload, use_bin_type=True), a)
    payload["gaps"][0][0] = 2**62  # more than any bound: refused before inflating
    with pytest.raises(CorruptVersion, match="decompresses to more than"):
        apply_payload(b"C" + msgpack.packb(payload, use_bin_type=True), a)


# -- round trips ---------------------------------------------------------------------------------

def _moved(t: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """`t` with about `fraction` of its elements moved a few representable values (finite)."""
    out = t.clone()
    mask = torch.rand(t.shape, generator=gen) < fraction
    out[mask] = (t.float()[mask] * (1 + 0.02 * torch.randn(int(mask.sum()), generator=gen))).to(t.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fraction", [0.0, 0.04, 1.0])
def test_random_states_round_trip_at_every_float_dtype(dtype, fraction):
    gen = torch.Generator().manual_seed(7)
    base = {"embed": (torch.randn(300, 64, generator=gen) * 0.02).to(dtype), "norm": torch.ones(64, dtype=dtype),
            "empty": torch.empty(0, 8, dtype=dtype), "steps": torch.tensor([3, 1, 4], dtype=torch.int64),
            "mask": torch.tensor([True, False]), "ids": torch.arange(10, dtype=torch.int32)}
    new = {k: _moved(v, fraction, gen) if v.is_floating_point() else v.clone() for k, v in base.items()}
    if fraction == 1.0:
        new["embed"] = (torch.randn(300, 64, generator=gen) * 0.02).to(dtype)  # every element new
        new["steps"], new["mask"] = torch.tensor([5, 9, 2]), torch.tensor([False, True])
    payload = encode_delta(base, new, base_version=3, version=4)
    version, state = apply_payload(payload, base)
    assert version == 4
    assert_bit_exact(state, new)
    kinds = {e["n"]: e["k"] for e in wd.delta_body(payload)["tensors"]}
    if fraction == 0.0:
        assert set(kinds.values()) == {"same"}
    _, snap = apply_payload(encode_snapshot(new, 4))
    assert_bit_exact(snap, new)


def test_a_known_base_hash_is_taken_and_a_false_one_still_caught():
    gen = torch.Generator().manual_seed(1)
    base = {"w": (torch.randn(5000, generator=gen) * 0.02).to(torch.bfloat16)}
    new = {"w": _moved(base["w"], 0.05, gen)}
    digest = state_hash(base)
    payload = encode_delta(base, new, base_version=0, version=1, base_hash=digest)
    assert payload == encode_delta(base, new, base_version=0, version=1)
    _, state = apply_payload(payload, base, base_hash=digest)
    assert_bit_exact(state, new)
    other = {"w": _moved(base["w"], 0.05, gen)}  # a caller that vouches for the wrong base
    with pytest.raises(CorruptVersion, match="does not match its hash"):
        apply_payload(payload, other, base_hash=digest)


# -- tied parameters -----------------------------------------------------------------------------

def _tiny(tied: bool, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=tied)
    return Qwen3ForCausalLM(config).eval()


def test_a_tied_model_is_published_once_and_re_tied_on_load():
    learner = _tiny(tied=True, seed=0)
    assert tied_aliases(learner) == {"lm_head.weight": "model.embed_tokens.weight"}
    first = unique_state(learner, torch.bfloat16)
    assert "lm_head.weight" not in first and "model.embed_tokens.weight" in first
    unique_params = sum(p.numel() for p in learner.parameters())  # parameters() lists a tied one once
    assert sum(t.numel() for t in first.values()) == unique_params
    snapshot = encode_snapshot(first, 0)
    header = len(snapshot) - 2 * unique_params
    assert 0 < header < 64 * len(first) + 512  # names, shapes and the hash; no second copy of the embedding

    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-3)
    learner(input_ids=torch.arange(12)[None], labels=torch.arange(12)[None]).loss.backward()
    optimizer.step()
    assert learner.lm_head.weight is learner.model.embed_tokens.weight
    second = unique_state(learner, torch.bfloat16)
    delta = encode_delta(first, second, base_version=0, version=1)

    receiver = _tiny(tied=True, seed=1)  # other weights: everything must come from the payloads
    _, held = apply_payload(snapshot)
    load_unique_state(receiver, held)
    _, held = apply_payload(delta, held)
    load_unique_state(receiver, held)
    assert receiver.lm_head.weight.data_ptr() == receiver.model.embed_tokens.weight.data_ptr()  # the tie holds
    reference = _tiny(tied=False, seed=2)  # untied: both copies loaded by name
    reference.load_state_dict({**second, "lm_head.weight": second["model.embed_tokens.weight"]}, strict=True)
    ids = torch.arange(20)[None] % 96
    with torch.no_grad():
        assert torch.equal(receiver(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_state_that_does_not_fit_the_model_is_refused_before_loading():
    model = _tiny(tied=True, seed=0)
    state = unique_state(model)
    before = {k: v.clone() for k, v in state.items()}
    changed = {k: v + 1 for k, v in state.items()}
    with pytest.raises(RuntimeError, match="missing"):
        load_unique_state(model, {k: v for k, v in changed.items() if k != "model.norm.weight"})
    with pytest.raises(RuntimeError, match="unexpected"):
        load_unique_state(model, {**changed, "extra.weight": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="different values"):
        load_unique_state(model, {**changed, "lm_head.weight": torch.zeros_like(state["lm_head.weight"]
                                                                               if "lm_head.weight" in state else
                                                                               state["model.embed_tokens.weight"])})
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # nothing was loaded
    load_unique_state(model, {**changed, "lm_head.weight": changed["model.embed_tokens.weight"]})  # an equal alias is fine
    assert torch.equal(model.lm_head.weight, changed["model.embed_tokens.weight"])


def test_an_untied_model_keeps_both_matrices():
    model = _tiny(tied=False, seed=0)
    assert tied_aliases(model) == {}
    assert "lm_head.weight" in unique_state(model)


def test_long_streams_travel_in_segments_compressed_side_by_side(monkeypatch):
    monkeypatch.setattr(wire_layout, "SEGMENT", 1000)
    gen = torch.Generator().manual_seed(3)
    base = {"w": (torch.randn(200_000, generator=gen) * 0.02).to(torch.bfloat16), "d": torch.arange(3000, dtype=torch.int32)}
    new = {"w": _moved(base["w"], 0.3, gen), "d": torch.randint(-2**31, 2**31 - 1, (3000,), generator=gen, dtype=torch.int32)}
    payload = encode_delta(base, new, base_version=0, version=1)
    outer = msgpack.unpackb(payload[1:], raw=False)
    assert len(outer["gaps"]) > 3 and all(size <= 1000 for size, _ in outer["gaps"])
    dense = next(e for e in outer["tensors"] if e["n"] == "d")
    assert dense["k"] == "dense" and len(dense["b"]) == 12
    _, state = apply_payload(payload, base)
    assert_bit_exact(state, new)
    outer["gaps"][1], outer["gaps"][2] = outer["gaps"][2], outer["gaps"][1]  # segments out of order: caught
    with pytest.raises(CorruptVersion):
        apply_payload(b"C" + msgpack.packb(outer, use_bin_type=True), base)


def test_the_transformers_backend_takes_a_published_state_and_keeps_its_tie():
    from swarm.generation import TransformersBackend
    from swarm.model.loading import load_policy

    model, tokenizer = load_policy("embedded")
    assert tied_aliases(model)  # the embedded policy ties its output layer to the embedding
    backend = TransformersBackend(model, tokenizer)
    published = {k: v + 0.5 if v.is_floating_point() else v for k, v in unique_state(model, torch.bfloat16).items()}
    _, held = apply_payload(encode_snapshot(published, 7))
    backend.load_state_dict(held)
    head, embed = backend.model.get_output_embeddings().weight, backend.model.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr()
    assert torch.equal(embed, held["model.embed_tokens.weight"].to(embed.dtype))
