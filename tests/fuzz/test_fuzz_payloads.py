"""Fuzzing of weight payloads (the strategies are test_fuzz.py's): mutated snapshots and deltas of
a small state, applied to the right base, to none and to a wrong one, and random payloads. Either
the exact published state comes back (bit for bit) or CorruptVersion; nothing else, ever."""

from __future__ import annotations

import msgpack
import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from swarm.fabric.weights import delta as wd
from swarm.fabric.weights.delta import CorruptVersion, apply_payload, encode_delta, encode_snapshot, payload_header, state_hash
from tests.fuzz.test_fuzz import WEIRD, chooser, fuzz, mutate_bytes, weighted

# weight payloads

def small_states():
    gen = torch.Generator().manual_seed(7)
    base = {"emb": torch.randn(4, 3, generator=gen), "norm": torch.randn(5, generator=gen).to(torch.bfloat16),
            "bias": torch.randn(2, generator=gen), "head": torch.randn(2, 8, generator=gen).to(torch.bfloat16)}
    new = {k: v.clone() for k, v in base.items()}
    new["emb"][1, 2] += 1.0  # one element: a sparse entry
    new["norm"] += 1.0  # all: a dense entry
    new["head"][0, 0] = 3.0  # bias unchanged: a "same" entry
    other = {k: v.clone() + 2 for k, v in base.items()}  # not the base the delta is against
    return base, new, other


BASE, NEW, OTHER = small_states()
NEW_HASH = state_hash(NEW)
SNAPSHOT = encode_snapshot(NEW, 3)
DELTA = encode_delta(BASE, NEW, base_version=2, version=3)
BODY_KEYS = ("v", "kind", "version", "base", "base_hash", "hash", "tensors")
ENTRY_KEYS = ("n", "d", "s", "k", "i", "b")
PLAUSIBLE = {
    "n": st.sampled_from(sorted(NEW) + ["missing", ""]),
    "d": st.sampled_from(("torch.float32", "torch.bfloat16", "torch.float16", "torch.int64", "torch.int32", "torch.uint8",
                          "torch.bool", "torch.float64", "float32")),
    "s": st.lists(st.integers(-2, 13) | st.sampled_from((2**31, 2**63 - 1, 2**64 - 1)), max_size=3),
    "k": st.sampled_from(("same", "sparse", "dense", "delta", "")),
    "i": st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 20), max_size=6).map(lambda xs: np.asarray(xs, np.uint32).tobytes()),
    "b": st.binary(max_size=80),
}


def body_of(payload: bytes) -> tuple[bytes, dict]:
    """A payload's codec and body, a delta's streams decompressed (what the mutations work on)."""
    return payload[:1], wd.delta_body(payload)


def payload_of(codec: bytes, body, use_bin_type: bool = True) -> bytes:
    """The payload of a (mutated) body: a delta's streams compressed again, as the wire has them."""
    if codec == wd.DELTA_CODEC and isinstance(body, dict):
        payload = wd.delta_payload(body)
        return payload if use_bin_type else codec + msgpack.packb(msgpack.unpackb(payload[1:], raw=False, strict_map_key=False), use_bin_type=False)
    return codec + msgpack.packb(body, use_bin_type=use_bin_type)


@st.composite
def mutated_payloads(draw) -> bytes:
    rnd = chooser(draw)
    payload = rnd.choice((SNAPSHOT, DELTA))
    how = weighted(rnd, bytes=2, inner_bytes=2, structure=8, codec=1)
    if how == "bytes":  # the payload as received: mostly breaks zlib or msgpack
        return mutate_bytes(draw, payload)
    codec, body = body_of(payload)
    if how == "inner_bytes":  # msgpack bytes changed, compressed again: reaches the tensors
        inner = mutate_bytes(draw, msgpack.packb(body, use_bin_type=True))
        try:
            return payload_of(codec, msgpack.unpackb(inner, raw=False))
        except Exception:  # noqa: BLE001  no longer msgpack: sent as it is
            return codec + inner
    if how == "codec":
        return rnd.choice((b"Z", b"R", b"C", b"X", b"")) + payload_of(b"R", body)[1:]
    for _ in range(rnd.choice((1, 1, 2, 3))):
        op = weighted(rnd, drop=1, replace=2, entry_drop=1, entry_replace=3, entry_plausible=3, entries=1, entry_swap=1)
        tensors = body.get("tensors") if isinstance(body.get("tensors"), list) else []
        entries = [e for e in tensors if isinstance(e, dict)]
        if op == "drop":
            body.pop(rnd.choice(BODY_KEYS), None)
        elif op == "replace":
            body[rnd.choice(BODY_KEYS)] = draw(WEIRD)
        elif op.startswith("entry_") and entries:
            entry, key = rnd.choice(entries), rnd.choice(ENTRY_KEYS)
            if op == "entry_drop":
                entry.pop(key, None)
            elif op == "entry_replace":
                entry[key] = draw(WEIRD)
            elif op == "entry_plausible":
                entry[key] = draw(PLAUSIBLE[key])
            elif op == "entry_swap" and len(entries) > 1:
                other = rnd.choice(entries)
                entry[key], other[key] = other.get(key), entry.get(key)
        elif op == "entries" and tensors:
            choice = rnd.choice(("delete", "duplicate", "reverse", "weird"))
            if choice == "delete":
                del tensors[rnd.randrange(len(tensors))]
            elif choice == "duplicate":
                tensors.append(dict(rnd.choice(entries)) if entries else None)
            elif choice == "reverse":
                tensors.reverse()
            else:
                tensors.append(draw(WEIRD))
    return payload_of(codec, body, use_bin_type=rnd.random() > 0.05)


def snapshot_with(change) -> bytes:
    codec, body = body_of(SNAPSHOT)
    change(body)
    return payload_of(codec, body)


# smallest cases of failures this test found (explicit examples: always tried)
SNAPSHOT_WITHOUT_BASE_HASH = snapshot_with(lambda body: body.pop("base_hash"))
SNAPSHOT_WITH_AN_INT_NAME = snapshot_with(lambda body: body["tensors"][0].update(n=5))


def check_payload(payload: bytes, base) -> bool:
    """apply_payload's contract: the published state bit for bit, or CorruptVersion."""
    try:
        header = payload_header(payload)
    except CorruptVersion:
        header = None
    else:
        assert isinstance(header, dict) and set(header) >= {"kind", "version", "base", "base_hash", "hash"}
    try:
        _, state = apply_payload(payload, base)
    except CorruptVersion as exc:
        assert str(exc)
        return False
    assert header is not None, "apply_payload accepted a payload whose header does not decode"
    assert isinstance(state, dict) and state_hash(state) == NEW_HASH
    assert all(torch.equal(state[k].view(torch.uint8), NEW[k].view(torch.uint8)) for k in NEW)
    return True


@fuzz(1000)
@given(payload=mutated_payloads(), base=st.sampled_from(("base", "none", "other", "new")))
@example(payload=DELTA, base="base")
@example(payload=SNAPSHOT, base="none")
@example(payload=SNAPSHOT_WITHOUT_BASE_HASH, base="none")
@example(payload=SNAPSHOT_WITH_AN_INT_NAME, base="none")
def test_mutated_weight_payloads_rebuild_exactly_or_are_refused(payload, base):
    accepted = check_payload(payload, {"base": BASE, "none": None, "other": OTHER, "new": NEW}[base])
    if payload == SNAPSHOT or (payload == DELTA and base == "base"):
        assert accepted  # an intact payload rebuilds the version (a snapshot needs no base)


@fuzz(300)
@given(payload=st.binary(max_size=200).map(lambda b: b"Z" + b) | st.binary(max_size=200).map(lambda b: b"R" + b)
       | st.binary(max_size=200).map(lambda b: b"C" + b) | st.binary(max_size=200), base=st.sampled_from((None, "base")))
def test_random_weight_payloads_are_refused(payload, base):
    assert not check_payload(payload, BASE if base else None)
