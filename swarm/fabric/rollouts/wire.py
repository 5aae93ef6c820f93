"""The rollout-group wire format, in one place: msgpack maps of plain types and packed arrays
(never pickle), with size bounds, and validation of everything a peer sends.

A group on the wire (keys are short to keep frames small):
  v    int    format version (WIRE_VERSION)
  uid  str    random id of this group, for at-most-once delivery (<= 64 chars)
  pid  str    problem id (<= 256 chars)
  sid  str    sampler id (<= 128 chars)
  ver  int    policy version that generated the completions (>= 0)
  t    float  sampling temperature (> 0); tk int top-k (>= 0); tp float top-p (0, 1]
  at   float  creation time, seconds since the epoch
  pr   bytes  prompt token ids, little-endian int32
  cl   [int]  completion lengths (G entries)
  ct   bytes  completion token ids, concatenated, int32
  lp   bytes  sampler log-probs of those tokens, concatenated, float32
  rw   [float | None]  rewards as the sampler scored them (None: unscorable)
  tx   [str]  completion texts (for re-scoring and logs)
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

import msgpack
import numpy as np

from swarm.rollouts import RolloutGroup

WIRE_VERSION = 1


@dataclass(frozen=True)
class WireLimits:
    max_frame_bytes: int = 16 * 1024 * 1024
    max_completions: int = 64  # completions per group (GEPO's paper uses 8 to 16)
    max_prompt_tokens: int = 32_768
    max_completion_tokens: int = 32_768
    max_text_chars: int = 200_000

    @classmethod
    def for_run(cls, context_tokens: int | None, max_completion_length: int) -> "WireLimits":
        """What one group of a run may hold: completions up to the run's longest, prompts up to what
        the model's context (None: unknown) leaves for them."""
        context = context_tokens or cls.max_prompt_tokens + max_completion_length
        return cls(max_completion_tokens=max_completion_length, max_prompt_tokens=max(1, context - max_completion_length))


class InvalidRollout(ValueError):
    """A rollout group from a peer that must not be used; the message says why. `blame` is False
    for refusals an honest peer can cause (a slow sampler's group going stale in transit)."""

    def __init__(self, reason: str, *, blame: bool = True) -> None:
        super().__init__(reason)
        self.blame = blame


def encode_group(group: RolloutGroup, uid: str | None = None) -> bytes:
    lengths = [len(c) for c in group.completion_ids]
    return msgpack.packb(
        {
            "v": WIRE_VERSION,
            "uid": uid or uuid.uuid4().hex,
            "pid": group.problem_id,
            "sid": group.sampler_id,
            "ver": int(group.version),
            "t": float(group.temperature),
            "tk": int(group.top_k),
            "tp": float(group.top_p),
            "at": float(group.created_at),
            "pr": np.asarray(group.prompt_ids, dtype="<i4").tobytes(),
            "cl": lengths,
            "ct": np.asarray([t for c in group.completion_ids for t in c], dtype="<i4").tobytes(),
            "lp": np.asarray([x for lp in group.sampler_logprobs for x in lp], dtype="<f4").tobytes(),
            "rw": [None if r is None else float(r) for r in group.rewards],
            "tx": list(group.completion_texts),
        },
        use_bin_type=True,
    )


def _check(condition: bool, reason: str, *, blame: bool = True) -> None:
    if not condition:
        raise InvalidRollout(reason, blame=blame)


def _str(obj: dict, key: str, max_len: int) -> str:
    value = obj.get(key)
    _check(isinstance(value, str) and 0 < len(value) <= max_len, f"field {key!r} must be a non-empty string of <= {max_len} chars")
    return value


def decode_group(
    frame: bytes,
    *,
    vocab_size: int,
    learner_version: int,
    max_staleness: int,
    limits: WireLimits = WireLimits(),
) -> tuple[str, RolloutGroup]:
    """(uid, group) from a frame, or InvalidRollout naming the first problem found."""
    _check(len(frame) <= limits.max_frame_bytes, f"frame of {len(frame)} bytes exceeds {limits.max_frame_bytes}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=limits.max_frame_bytes,
                              max_str_len=limits.max_text_chars, max_array_len=limits.max_completions * 4)
    except Exception as exc:  # noqa: BLE001  msgpack raises several types on garbage
        raise InvalidRollout(f"not a msgpack map: {type(exc).__name__}") from exc
    _check(isinstance(obj, dict), "frame is not a map")
    _check(obj.get("v") == WIRE_VERSION, f"wire format version {obj.get('v')!r}, expected {WIRE_VERSION}")
    uid, pid, sid = _str(obj, "uid", 64), _str(obj, "pid", 256), _str(obj, "sid", 128)
    version = obj.get("ver")
    _check(isinstance(version, int) and not isinstance(version, bool) and version >= 0, "version must be an int >= 0")
    # neither is the sender's fault: a learner resumed from a checkpoint, a slow link
    _check(version <= learner_version, f"version {version} is from the future (learner is at {learner_version})", blame=False)
    _check(learner_version - version <= max_staleness, f"version {version} is {learner_version - version} steps stale (max {max_staleness})", blame=False)
    temperature, top_k, top_p, created = obj.get("t"), obj.get("tk"), obj.get("tp"), obj.get("at")
    _check(isinstance(temperature, float) and 0 < temperature <= 100, "temperature must be a float in (0, 100]")
    _check(isinstance(top_k, int) and top_k >= 0, "top_k must be an int >= 0")
    _check(isinstance(top_p, float) and 0 < top_p <= 1, "top_p must be a float in (0, 1]")
    _check(isinstance(created, float) and math.isfinite(created), "creation time must be a finite float")

    for key in ("pr", "ct", "lp"):
        _check(isinstance(obj.get(key), bytes) and len(obj[key]) % 4 == 0, f"field {key!r} must be packed 4-byte values")
    prompt = np.frombuffer(obj["pr"], dtype="<i4")
    tokens = np.frombuffer(obj["ct"], dtype="<i4")
    logprobs = np.frombuffer(obj["lp"], dtype="<f4")
    lengths, rewards, texts = obj.get("cl"), obj.get("rw"), obj.get("tx")
    _check(isinstance(lengths, list) and 0 < len(lengths) <= limits.max_completions,
           f"a group needs 1..{limits.max_completions} completions")
    g = len(lengths)
    _check(all(isinstance(n, int) and 0 <= n <= limits.max_completion_tokens for n in lengths),
           f"completion lengths must be ints in 0..{limits.max_completion_tokens}")
    _check(0 < prompt.size <= limits.max_prompt_tokens, f"prompt must have 1..{limits.max_prompt_tokens} tokens")
    _check(tokens.size == sum(lengths), f"{tokens.size} completion tokens but lengths sum to {sum(lengths)}")
    _check(logprobs.size == tokens.size, f"{logprobs.size} log-probs for {tokens.size} tokens")
    for name, ids in (("prompt", prompt), ("completion", tokens)):
        _check(ids.size == 0 or (ids.min() >= 0 and ids.max() < vocab_size), f"{name} token ids outside the vocabulary (0..{vocab_size - 1})")
    _check(bool(np.isfinite(logprobs).all()) and (logprobs.size == 0 or logprobs.max() <= 1e-3), "log-probs must be finite and <= 0")
    _check(isinstance(rewards, list) and len(rewards) == g, f"need {g} rewards")
    _check(all(r is None or (isinstance(r, float) and math.isfinite(r)) for r in rewards), "rewards must be finite floats or None")
    _check(isinstance(texts, list) and len(texts) in (0, g) and all(isinstance(t, str) for t in texts), f"need 0 or {g} completion texts")

    bounds = np.cumsum([0] + lengths)
    token_list, lp_list = tokens.tolist(), logprobs.astype(np.float64).tolist()
    group = RolloutGroup(
        problem_id=pid, prompt_ids=prompt.tolist(),
        completion_ids=[token_list[bounds[i]:bounds[i + 1]] for i in range(g)],
        sampler_logprobs=[lp_list[bounds[i]:bounds[i + 1]] for i in range(g)],
        rewards=list(rewards), version=version, sampler_id=sid, completion_texts=list(texts),
        temperature=temperature, top_k=top_k, top_p=top_p, created_at=created,
    )
    return uid, group
