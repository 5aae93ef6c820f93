"""Property-based fuzzing (hypothesis) of every decoder and handler that takes bytes or requests
from other peers: here the rollout wire format (decode_group), the gRPC registry's handlers and the
learner's inbox (InboxCore), called directly, and the strategies and invariants shared with
test_fuzz_payloads.py (weight payloads) and test_fuzz_peers.py (real loopback servers of both
transports).

Inputs start from valid messages and are mutated: byte flips, truncations, extensions, insertions,
structured changes of the decoded maps (keys dropped, values swapped for values of other types:
huge and negative ints, inf/nan, bools, None, nested lists and maps, long strings, odd-length
bytes), plus fully random bytes. The properties: a decoder returns something that satisfies every
invariant of its format or refuses with its own exception (InvalidRollout, CorruptVersion); a
handler answers (a map) and stores nothing invalid; a server keeps serving valid requests.
Failures found while writing this are kept as explicit examples (smallest inputs), so they are
always tried first."""

from __future__ import annotations

import hashlib
import math
import random
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hivemind.utils.crypto import RSAPrivateKey

from swarm.fabric.rollouts.bans import PeerBans
from swarm.fabric.grpc.common import Caller, key_id, pack, peer_id_of, unpack
from swarm.fabric.signing import owner_key, verify_owner_signature
from swarm.fabric.grpc.registry import Registry
from swarm.fabric.membership.records import Heartbeat, MemberRecord
from swarm.fabric.weights.announcements import RunSampling, VersionAnnouncement
from swarm.fabric.rollouts.inbox import InboxCore
from swarm.fabric.rollouts.wire import WIRE_VERSION, InvalidRollout, WireLimits, decode_group, encode_group
from swarm.rollouts import RolloutGroup

VOCAB = 97
LEARNER_VERSION = 10
MAX_STALENESS = 4
# small limits, so that mutations reach every bound (the checks are the same at any size)
LIMITS = WireLimits(max_frame_bytes=64 * 1024, max_completions=8, max_prompt_tokens=64, max_completion_tokens=64,
                    max_text_chars=4096)
LOGPROB_TOLERANCE = 1e-3  # decode_group lets log-probs round up to this much above 0 (float32 samplers)
RUN = "fuzz-test"


def fuzz(n: int, **extra):
    """hypothesis settings for `n` examples: no deadline (2 shared cores), no example database
    (nothing written into the checkout)."""
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much], **extra)


# ---------------------------------------------------------------------------------------------
# values of every msgpack type, for swapping into valid messages

EDGE_INTS = (0, 1, -1, 2, 3, 255, 256, 2**31 - 1, 2**31, -(2**31), 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63))
# Sizes a handler could turn into allocations (bytes(n)) are kept out of the random requests sent to
# the registry: its own test below checks that one tiny request cannot allocate that much.
SAFE_EDGE_INTS = (0, 1, -1, 2, 3, 255, 256, -(2**31), 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63))
EDGE_FLOATS = (math.inf, -math.inf, math.nan, -0.0, 0.0, 1e-45, 5e-324, 1e308, -1e308, 1.0, 1.5, 100.0, 100.5)
# (piece, times): long values are built when drawn, so that hypothesis's repr of the strategy stays short
LONG_STRINGS = st.sampled_from((("x", 65), ("p", 257), ("s", 129), ("é", 700), ("y", 5000), ("\x00", 10), ("\u202e\ufeff", 1),
                                ("0", 4400))).map(lambda spec: spec[0] * spec[1])
ODD_BYTES = st.sampled_from(((b"\x00", 1), (b"\x01\x02\x03", 1), (b"\xff", 5), (b"\x00", 4097), (bytes(range(7)), 1))).map(
    lambda spec: spec[0] * spec[1])


def scalars(ints=st.integers(-(2**63), 2**64 - 1), edge_ints=EDGE_INTS):
    return st.one_of(
        st.none(), st.booleans(), ints, st.sampled_from(edge_ints),
        st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(EDGE_FLOATS),
        st.text(max_size=12), LONG_STRINGS,
        st.binary(max_size=13), ODD_BYTES,
        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6)),
    )


def msgpack_values(ints=st.integers(-(2**63), 2**64 - 1), edge_ints=EDGE_INTS, max_leaves=12):
    leaves = scalars(ints, edge_ints)
    # mostly string keys: a map keyed otherwise fails to decode at all, which other cases cover
    keys = st.one_of(st.text(max_size=6), st.text(max_size=6), st.text(max_size=6), st.integers(-3, 3), st.binary(max_size=3))
    return st.recursive(leaves, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(keys, kids, max_size=4),
                        max_leaves=max_leaves)


WEIRD = msgpack_values()
SAFE_INTS = st.integers(-(2**20), 2**20)
SAFE_WEIRD = msgpack_values(SAFE_INTS, SAFE_EDGE_INTS)


# ---------------------------------------------------------------------------------------------
# rollout groups: valid ones, their frames, and mutations of those frames

@st.composite
def rollout_groups(draw) -> RolloutGroup:
    g = draw(st.integers(1, 4))
    lengths = [draw(st.integers(0, 5)) for _ in range(g)]
    token = st.integers(0, VOCAB - 1)
    return RolloutGroup(
        problem_id=draw(st.text(min_size=1, max_size=12)),
        prompt_ids=draw(st.lists(token, min_size=1, max_size=6)),
        completion_ids=[draw(st.lists(token, min_size=n, max_size=n)) for n in lengths],
        sampler_logprobs=[draw(st.lists(st.floats(-30.0, 0.0, width=32), min_size=n, max_size=n)) for n in lengths],
        rewards=draw(st.lists(st.none() | st.floats(-10.0, 10.0), min_size=g, max_size=g)),
        version=draw(st.integers(LEARNER_VERSION - MAX_STALENESS, LEARNER_VERSION)),
        sampler_id=draw(st.text(min_size=1, max_size=10)),
        completion_texts=draw(st.just([]) | st.lists(st.text(max_size=8), min_size=g, max_size=g)),
        temperature=draw(st.floats(0.05, 100.0)), top_k=draw(st.integers(0, 50)),
        top_p=draw(st.floats(0.01, 1.0)), created_at=draw(st.floats(0.0, 2e9)),
    )


UIDS = st.text(alphabet="0123456789abcdef", min_size=1, max_size=32)


@st.composite
def valid_frames(draw) -> bytes:
    return encode_group(draw(rollout_groups()), uid=draw(UIDS))


MARKER_BYTES = (0x00, 0x7F, 0x80, 0x8F, 0x90, 0xA0, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC6, 0xC7, 0xCA, 0xCB, 0xCF,
                0xD3, 0xD4, 0xD6, 0xD9, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xE0, 0xFF)


SEEDS = st.tuples(*[st.integers(0, 2**64 - 1)] * 4)


def chooser(draw, material: bytes = b"") -> random.Random:
    """Which mutations to make, and where: a Random seeded from hypothesis's draws and the message
    being mutated. (hypothesis's own choices repeat a lot, zeros above all: drawing each choice
    from it made one mutation of one field most of the examples.) The values swapped in are drawn
    by hypothesis, with its edge cases."""
    return random.Random(hashlib.sha256(repr(draw(SEEDS)).encode() + material).digest())


def weighted(rnd: random.Random, **choices: int) -> str:
    return rnd.choices(list(choices), weights=list(choices.values()))[0]


def mutate_bytes(draw, data: bytes) -> bytes:
    rnd, data = chooser(draw, data), bytearray(data)
    for _ in range(rnd.choice((1, 1, 1, 2, 3))):
        op = weighted(rnd, flip=4, set=2, truncate=1, extend=1, insert=1, delete=1)
        pos = rnd.randrange(len(data) + 1)
        if op == "flip" and data:
            data[min(pos, len(data) - 1)] ^= rnd.randrange(1, 256)
        elif op == "set" and data:
            data[min(pos, len(data) - 1)] = draw(st.sampled_from(MARKER_BYTES) | st.integers(0, 255))
        elif op == "truncate":
            del data[pos:]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=64))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos:pos + rnd.randrange(1, 9)]
    return bytes(data)


@st.composite
def byte_mutated_frames(draw) -> bytes:
    return mutate_bytes(draw, draw(valid_frames()))


FIELDS = ("v", "uid", "pid", "sid", "ver", "t", "tk", "tp", "at", "pr", "cl", "ct", "lp", "rw", "tx")


def packed_ints(draw) -> bytes:
    ids = draw(st.lists(st.integers(-(2**31), 2**31 - 1) | st.sampled_from((-1, VOCAB - 1, VOCAB, 2**31 - 1)), max_size=8))
    return np.asarray(ids, dtype="<i4").tobytes()


def packed_floats(draw) -> bytes:
    values = draw(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from((1e-4, 2e-3, 0.5)),
                           max_size=8))
    return np.asarray(values, dtype="<f4").tobytes()


@st.composite
def structured_frames(draw) -> bytes:
    """A valid frame, decoded, changed as a map, and packed again."""
    frame = draw(valid_frames())
    obj, rnd = msgpack.unpackb(frame, raw=False), chooser(draw, frame)
    for _ in range(rnd.choice((1, 1, 2, 3))):
        op = weighted(rnd, drop=1, replace=3, element=2, append=1, packed=2, extra=1, lengths=1)
        key = rnd.choice(FIELDS)
        if op == "drop":
            obj.pop(key, None)
        elif op == "replace":
            obj[key] = draw(WEIRD)
        elif op == "element" and isinstance(obj.get(key), list) and obj[key]:
            obj[key][rnd.randrange(len(obj[key]))] = draw(WEIRD)
        elif op == "append" and isinstance(obj.get(key), list):
            obj[key].append(draw(WEIRD | st.integers(0, 3) | st.floats(-1, 1) | st.text(max_size=3)))
        elif op == "packed":
            obj[rnd.choice(("pr", "ct"))] = packed_ints(draw)
            if rnd.random() < 0.5:
                obj["lp"] = packed_floats(draw)
        elif op == "extra":
            obj[draw(st.text(max_size=4) | st.integers(0, 3))] = draw(WEIRD)
        elif op == "lengths":
            obj["cl"] = draw(st.lists(st.integers(0, 6) | st.sampled_from((-1, 2**32, 2**64 - 1, 10**6)), max_size=10))
    if rnd.random() < 0.05:
        obj = rnd.choice((list(obj.values()), None, 1, "map", b"map", [obj]))
    return msgpack.packb(obj, use_bin_type=rnd.random() > 0.05)  # bytes packed as strings, now and then


ANY_FRAME = st.one_of(valid_frames(), byte_mutated_frames(), structured_frames(), structured_frames(),
                      st.binary(max_size=300))

# What the format requires, whatever decode_group's code says: a frame lacking one of these, or
# holding a value of another type, must be refused.
FIELD_TYPES = {"uid": str, "pid": str, "sid": str, "ver": int, "t": float, "tk": int, "tp": float, "at": float,
               "pr": bytes, "ct": bytes, "lp": bytes, "cl": list, "rw": list, "tx": list}


def must_refuse(frame: bytes) -> str | None:
    """A reason, found independently of decode_group, why `frame` must be refused (None: no such
    reason; the frame may still be refused for its values)."""
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001
        return "not msgpack"
    if not isinstance(obj, dict):
        return "not a map"
    if any(not isinstance(k, (str, bytes)) for k in obj):
        return "a key that is not a string"
    if obj.get("v") != WIRE_VERSION:
        return "wire format version"
    for key, kind in FIELD_TYPES.items():
        if key not in obj:
            return f"no {key!r}"
        if not isinstance(obj[key], kind) or (key == "ver" and isinstance(obj[key], bool)):
            return f"{key!r} is a {type(obj[key]).__name__}"
    g = len(obj["cl"])
    if not 1 <= g <= LIMITS.max_completions or any(not isinstance(n, int) for n in obj["cl"]):
        return "completion lengths"
    if len(obj["rw"]) != g or any(r is not None and not isinstance(r, float) for r in obj["rw"]):
        return "rewards"
    if len(obj["tx"]) not in (0, g) or any(not isinstance(t, str) for t in obj["tx"]):
        return "texts"
    if any(len(obj[k]) % 4 for k in ("pr", "ct", "lp")):
        return "packed field length"
    if not 0 <= LEARNER_VERSION - obj["ver"] <= MAX_STALENESS:
        return "version out of bounds"
    return None


def is_float(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def assert_valid_group(group: RolloutGroup, uid: str | None = None) -> None:
    """Every invariant a learner relies on for a group that passed validation."""
    assert isinstance(group, RolloutGroup)
    if uid is not None:
        assert isinstance(uid, str) and 0 < len(uid) <= 64
    for value, cap in ((group.problem_id, 256), (group.sampler_id, 128)):
        assert isinstance(value, str) and 0 < len(value) <= cap
    assert type(group.version) is int and 0 <= LEARNER_VERSION - group.version <= MAX_STALENESS
    assert is_float(group.temperature) and 0 < group.temperature <= 100
    assert isinstance(group.top_k, int) and group.top_k >= 0
    assert is_float(group.top_p) and 0 < group.top_p <= 1
    assert is_float(group.created_at)
    assert isinstance(group.prompt_ids, list) and 1 <= len(group.prompt_ids) <= LIMITS.max_prompt_tokens
    assert all(type(t) is int and 0 <= t < VOCAB for t in group.prompt_ids)
    g = len(group.completion_ids)
    assert 1 <= g <= LIMITS.max_completions
    assert len(group.sampler_logprobs) == g and len(group.rewards) == g and len(group.completion_texts) in (0, g)
    for ids, logprobs in zip(group.completion_ids, group.sampler_logprobs):
        assert isinstance(ids, list) and isinstance(logprobs, list)
        assert len(ids) == len(logprobs) <= LIMITS.max_completion_tokens
        assert all(type(t) is int and 0 <= t < VOCAB for t in ids)
        assert all(is_float(x) and x <= LOGPROB_TOLERANCE for x in logprobs)
    assert all(r is None or (is_float(r) and not isinstance(r, bool)) for r in group.rewards)
    assert all(isinstance(t, str) and len(t) <= LIMITS.max_text_chars for t in group.completion_texts)


def decode(frame: bytes):
    return decode_group(frame, vocab_size=VOCAB, learner_version=LEARNER_VERSION, max_staleness=MAX_STALENESS, limits=LIMITS)


def check_decode(frame: bytes) -> bool:
    """decode_group's contract on any frame; True when it was accepted."""
    reason = must_refuse(frame)
    try:
        uid, group = decode(frame)
    except InvalidRollout as exc:
        assert str(exc), "a refusal names its reason"
        return False
    assert reason is None, f"accepted a frame that must be refused ({reason})"
    assert_valid_group(group, uid)
    return True


# ---------------------------------------------------------------------------------------------
# 1. decode_group

@fuzz(150)
@given(group=rollout_groups(), uid=UIDS)
def test_valid_frames_decode_to_the_same_group(group, uid):
    got_uid, got = decode(encode_group(group, uid=uid))
    assert got_uid == uid
    assert_valid_group(got, got_uid)
    for name in ("problem_id", "prompt_ids", "completion_ids", "rewards", "version", "sampler_id", "completion_texts",
                 "temperature", "top_k", "top_p", "created_at"):
        assert getattr(got, name) == getattr(group, name), name
    # log-probs travel as float32: the generator draws float32 values, so they arrive exactly
    assert got.sampler_logprobs == group.sampler_logprobs


@fuzz(800)
@given(frame=byte_mutated_frames())
def test_byte_mutated_frames_are_refused_or_valid(frame):
    check_decode(frame)


@fuzz(800)
@given(frame=structured_frames())
def test_structurally_mutated_frames_are_refused_or_valid(frame):
    check_decode(frame)


@fuzz(600)
@given(frame=st.binary(max_size=400) | st.builds(lambda head, tail: head + tail, st.sampled_from(
    (b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff", b"\x8f", b"\x9f",
     b"\xd6\xff", b"\xc7\x03\xff", b"\x81\xa1v\x01")), st.binary(max_size=40)))
@example(frame=b"\x91" * 5000 + b"\xc0")  # nesting deeper than the unpacker's stack
@example(frame=b"\x81" + b"\xc0" * 2)  # a map keyed by nil
@example(frame=b"")
@example(frame=bytes(LIMITS.max_frame_bytes + 1))
def test_random_bytes_are_refused(frame):
    assert not check_decode(frame)


# ---------------------------------------------------------------------------------------------
# 2. the gRPC registry's handlers, called directly

KEYS = [RSAPrivateKey() for _ in range(2)]
NOW = 1_000_000.0


def caller(key, address: str = "127.0.0.1:5", ip: str = "127.0.0.1", run_id: str = "r") -> Caller:
    """Who a request comes from, as the registry's authenticator hands it over (a signature that
    held): the handlers are fuzzed with what a signed peer can send."""
    owner = owner_key(key)
    return Caller(owner=owner, key=key_id(owner), peer=peer_id_of(key_id(owner), address), run_id=run_id, ip=ip)


CALLERS = [caller(KEYS[0]), caller(KEYS[1], "127.0.0.1:6"), caller(KEYS[0], ip="10.0.0.9", run_id="s"), None]


def announcement_value(run_id: str, version: int, peer_id: str = "127.0.0.1:1") -> dict:
    if hasattr(VersionAnnouncement, "of"):  # announcements carry the run's sampling settings
        return VersionAnnouncement.of(run_id, version, "a" * 64, peer_id, 0.0, RunSampling()).dict()
    return VersionAnnouncement(run_id=run_id, version=version, hash="a" * 64, peer_id=peer_id, time=0.0).dict()


SIGNED = {}


def signed(key, value) -> dict:
    payload = pack(value)
    if (id(key), payload) not in SIGNED:  # RSA signing is the slow part of building requests
        SIGNED[id(key), payload] = key.sign(payload)
    return {"owner": owner_key(key), "payload": payload, "signature": SIGNED[id(key), payload]}


def valid_requests(run_id: str = "r", who: Caller | None = CALLERS[0]) -> dict:
    peer = who.peer if who is not None else "127.0.0.1:5"
    key = KEYS[1] if who is not None and who.owner == owner_key(KEYS[1]) else KEYS[0]
    record = Heartbeat(role="sampler", model="m", version=3).record(peer, NOW).dict()
    return {
        "heartbeat": {"run_id": run_id, "record": record, "expiry_s": 30.0},
        "announce": {"run_id": run_id, **signed(key, announcement_value(run_id, 4)), "expiry_s": 60.0},
        "list_members": {"run_id": run_id, "after": None},
        "list_versions": {"run_id": run_id, "owners": [owner_key(KEYS[0])]},
    }


REQUEST_KEYS = ("run_id", "record", "expiry_s", "owner", "payload", "signature", "owners", "after", "limit", "token", "peer_id")


@st.composite
def mutated_requests(draw, method: str):
    """(request, caller): a valid request of `method`, changed."""
    who = draw(st.sampled_from(CALLERS))
    request = valid_requests(draw(st.sampled_from(("r", "s"))), who)[method]
    rnd = chooser(draw, repr(request).encode())
    for _ in range(rnd.choice((1, 1, 2, 3))):
        op = weighted(rnd, drop=1, replace=3, extra=1, record=2, announcement=2)
        if op == "drop" and request:
            request.pop(rnd.choice(sorted(request, key=repr)))
        elif op == "replace":
            request[rnd.choice(REQUEST_KEYS)] = draw(SAFE_WEIRD)
        elif op == "extra":
            request[draw(st.text(max_size=5))] = draw(SAFE_WEIRD)
        elif op == "record" and isinstance(request.get("record"), dict):
            record = request["record"]
            field = rnd.choice(sorted(record, key=repr) + ["extra"])
            if rnd.random() < 0.3:
                record.pop(field, None)
            else:
                record[field] = draw(SAFE_WEIRD | st.sampled_from(("learner", "sampler", "127.0.0.1:6", "", "x" * 200)))
        elif op == "announcement":  # correctly signed, by a key of the test's, whatever the content
            value = {**announcement_value("r", 5), "run_id": request.get("run_id", "r")}
            value[rnd.choice(sorted(value))] = draw(SAFE_WEIRD)
            request.update(signed(rnd.choice(KEYS), value))
    return request, who


def random_requests(values=SAFE_WEIRD):
    request = st.one_of(values, st.dictionaries(st.sampled_from(REQUEST_KEYS) | st.text(max_size=4), values, max_size=8))
    return st.tuples(request, st.sampled_from(CALLERS))


def requests_for(method: str):
    return st.lists(mutated_requests(method) | random_requests(), min_size=1, max_size=6)


def seeded_registry() -> Registry:
    """A registry holding valid records and announcements, so that fuzzed requests meet held
    entries (a peer's own record, an older version)."""
    registry = Registry(clock=lambda: NOW)
    for who in CALLERS[:3]:
        for name, request in valid_requests(who.run_id, who).items():
            getattr(registry, name)(request, who)
    return registry


def test_the_seeded_registry_holds_what_the_fuzz_builds_on():
    """The fuzz below starts from a registry holding valid records: were they refused (the API
    changed), the fuzz would never meet a held record."""
    registry = seeded_registry()
    members = registry.list_members({"run_id": "r"})["members"]
    assert sorted(m["record"]["peer_id"] for m in members) == sorted([CALLERS[0].peer, CALLERS[1].peer])
    assert len(registry.list_versions({"run_id": "r"})["versions"]) == 2
    assert len(registry.list_members({"run_id": "s"})["members"]) == 1
    assert_registry_sound(registry, {"r", "s"})


def run_ids_in(requests) -> set[str]:
    ids = {"r", "s", "None", ""}
    for request, _ in requests:
        if isinstance(request, dict) and "run_id" in request:
            ids.add(str(request["run_id"]))
    return ids


def assert_registry_sound(registry: Registry, run_ids, now: float = NOW) -> None:
    """Only records that parse, owned by the key that signed them, with a finite expiry, are held;
    listings still encode."""
    for run_id in run_ids:
        members = registry.list_members({"run_id": run_id})
        assert isinstance(members, dict)
        for item in members["members"]:
            record = MemberRecord.parse_obj(item["record"])
            assert math.isfinite(item["expires_at"]) and item["expires_at"] <= now + registry.max_expiry_s
            if "owner" in item:  # the record names the key it belongs to
                assert record.peer_id.partition("@")[0] == key_id(item["owner"])
        versions = registry.list_versions({"run_id": run_id})
        assert isinstance(versions, dict)
        for item in versions["versions"]:
            owner, payload, signature = item["owner"], item["payload"], item["signature"]
            assert isinstance(owner, bytes) and verify_owner_signature(owner, payload, signature)
            assert VersionAnnouncement.parse_obj(unpack(payload)).run_id == run_id
        for reply in (members, versions):
            assert isinstance(unpack(pack(reply)), dict)  # what the server sends back encodes
    for tables in (registry.members, registry.versions):
        for run_id, table in tables.items():
            assert isinstance(run_id, str)
            for entry in getattr(table, "entries", table).values():
                assert math.isfinite(entry.expires_at) and entry.expires_at <= now + registry.max_expiry_s


def call_all(registry: Registry, method: str, requests) -> None:
    for request, who in requests:
        reply = getattr(registry, method)(request, who)
        assert isinstance(reply, dict), f"{method}({request!r}) answered {reply!r}"
        if method in ("heartbeat", "announce"):
            assert isinstance(reply.get("ok"), bool)
        pack(reply)


@fuzz(120)
@given(requests=requests_for("heartbeat"))
@example(requests=[(None, CALLERS[0]), ([], CALLERS[1]), ("r", None)])
def test_registry_heartbeat_never_raises_and_stores_only_valid_records(requests):
    registry = seeded_registry()
    call_all(registry, "heartbeat", requests)
    assert_registry_sound(registry, run_ids_in(requests))


@fuzz(120)
@given(requests=requests_for("announce"))
@example(requests=[(None, CALLERS[0]), ([], None)])
def test_registry_announce_never_raises_and_stores_only_valid_announcements(requests):
    registry = seeded_registry()
    call_all(registry, "announce", requests)
    assert_registry_sound(registry, run_ids_in(requests))


@fuzz(100)
@given(members=requests_for("list_members"), versions=requests_for("list_versions"))
@example(members=[(None, None)], versions=[(None, None)])
@example(members=[([], CALLERS[0])], versions=[(["r"], CALLERS[0])])
def test_registry_listings_never_raise(members, versions):
    registry = seeded_registry()
    call_all(registry, "list_members", members)
    call_all(registry, "list_versions", versions)
    assert_registry_sound(registry, run_ids_in(members + versions))


@pytest.mark.parametrize("method", ["heartbeat", "announce", "list_members", "list_versions"])
def test_a_tiny_registry_request_cannot_make_it_allocate_much(method):
    """A request of a few bytes (an int where bytes belong) must not make the registry allocate a
    buffer of that size: over gRPC the request is msgpack, and 2**34 is 9 bytes of it."""
    claimed = 64 * 1024 * 1024
    for key in REQUEST_KEYS:
        request = {**valid_requests()[method], key: claimed}
        registry = seeded_registry()
        tracemalloc.start()
        try:
            getattr(registry, method)(request, CALLERS[0])
        except Exception:  # noqa: BLE001  whether handlers raise is the other tests' business
            pass
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < claimed // 8, f"{method} with {key}={claimed}: peak {peak / 2**20:.0f} MiB traced"


# ---------------------------------------------------------------------------------------------
# 3. the learner's inbox, called directly

def drain(inbox, most: int | None = None) -> list[RolloutGroup]:
    """The groups waiting in `inbox` (at most `most`), without waiting."""
    groups = []
    while (most is None or len(groups) < most) and (group := inbox.get(timeout=0)) is not None:
        groups.append(group)
    return groups


REMOTES = ("peer-a", "peer-b", "peer-c")


@fuzz(150)
@given(sends=st.lists(st.tuples(ANY_FRAME, st.sampled_from(REMOTES), st.integers(0, 3)), min_size=1, max_size=25),
       fresh=rollout_groups())
def test_inbox_core_acks_everything_and_queues_only_valid_groups(sends, fresh):
    inbox = InboxCore(vocab_size=VOCAB, max_staleness=MAX_STALENESS, capacity=3, put_timeout_s=0.01, limits=LIMITS,
                      bans=PeerBans(strikes=4, window_s=60, ban_s=60))
    inbox.learner_version = LEARNER_VERSION
    accepted, queued, banned = 0, 0, set()
    for frame, remote, take in sends:
        ack = inbox.accept_blocking(frame, remote)
        assert isinstance(ack, dict) and isinstance(ack.get("ok"), bool), ack
        if remote in banned:
            assert not ack["ok"] and "banned" in ack["reason"]  # a ban lasts (60 s here)
        if ack["ok"]:
            accepted += 1
            assert inbox.accept_blocking(frame, "peer-d") == {"ok": False, "reason": "duplicate"}  # at most once
        else:
            assert isinstance(ack.get("reason"), str) and ack["reason"]
            if "banned" in ack["reason"]:
                banned.add(remote)
        for group in drain(inbox, take):  # the learner takes some groups now and then
            assert_valid_group(group)
            assert group.sender in REMOTES
            queued += 1
    for group in drain(inbox):
        assert_valid_group(group)
        queued += 1
    assert queued == accepted == sum(inbox.stats.accepted.values())  # what was acked, and nothing else, was queued
    # the inbox still takes a valid group from a peer in good standing
    assert inbox.accept_blocking(encode_group(fresh), "peer-fresh") == {"ok": True}
    assert_valid_group(inbox.get(timeout=0))
