"""The outer layout of a weight payload (format 5, as format 4; swarm.fabric.weights.delta describes the body):
a codec byte, then msgpack; a delta's large byte strings travel as segments compressed with zlib,
each on its own thread. Other formats' payloads are recognised, to be refused by name: a receiver
never applies a payload it half understands."""

from __future__ import annotations

import zlib
from concurrent.futures import Future

import msgpack

from swarm.fabric.weights.packed_stream import deflated
from swarm.fabric.weights.varints import Inline

FORMAT = 5
DELTA_CODEC, SNAPSHOT_CODEC = b"C", b"R"
FORMAT_3_DELTA_CODEC = b"Z"  # format 3's deltas: recognised, to be refused by name
# No weight payload, received or decompressed, may be larger than this: a hostile holder must not
# make a peer allocate without bound. 4 GiB covers a float16 snapshot of a 2B-parameter policy;
# peers pass a tighter bound from their own model's shapes (versions.payload_limit).
MAX_PAYLOAD_BYTES = 4 * 1024**3
# The streams' redundancy is in their skewed byte values (Huffman coding) and in runs (classes whose
# elements nearly all change); zlib's run-length strategy keeps both and skips string matching: at
# Qwen3-0.6B shape it is smaller than level 4 Z_FILTERED (format 3's: 17.72 against 17.87 MB) in a
# quarter of the time (benchmarks/delta_speed.py). With Z_RLE, zlib's level changes nothing else.
ZLIB_STRATEGY = zlib.Z_RLE
ZLIB_LEVEL = 6
# a compressed stream is cut into segments of at most this many bytes, compressed side by side (zlib
# looks back 32 KB only, so the cuts cost a few bytes each: no ratio is lost)
SEGMENT = 4 << 20
class CorruptVersion(ValueError):
    """A snapshot or delta that does not decode, or whose result does not match its hash."""


class UnsupportedFormat(CorruptVersion):
    """A payload of another weight format than this peer's (FORMAT): never applied, even in part."""


def _compressed(chunks, level: int) -> list:
    """[raw size, zlib stream] of the bytes `chunks` (bytes-like pieces) hold joined."""
    return [sum(len(c) for c in chunks), deflated(b"", chunks, level, ZLIB_STRATEGY)]


def _segments(chunks) -> list[list]:
    """The bytes-like `chunks` regrouped into runs of at most SEGMENT bytes (slices, not copies)."""
    out, run, size = [], [], 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while len(view):
            part = view[:SEGMENT - size]
            run.append(part)
            size += len(part)
            view = view[len(part):]
            if size == SEGMENT:
                out.append(run)
                run, size = [], 0
    return out + [run] if run or not out else out


def compressed_segments(chunks, level: int, pool) -> list:
    """The segments of a stream, each compressed on `pool` (futures of [size, zlib stream])."""
    return [pool.submit(_compressed, run, level) for run in _segments(chunks)]


def resolved(value):
    """A body's value with its compressions (futures) done."""
    if isinstance(value, Future):
        return value.result()
    if isinstance(value, dict):
        return {k: resolved(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolved(v) for v in value]
    return value


def delta_payload(body: dict, level: int = ZLIB_LEVEL) -> bytes:
    """A delta's payload from its body as plain values (gaps, steps and dense b as raw bytes): the
    wire layout (the module's docstring), for whoever writes a delta by hand (tests, references)."""
    def squeezed(value):  # (a hand-written body may hold something else there: passed on, for the receiver to refuse)
        return resolved(compressed_segments([value], level, Inline())) if isinstance(value, (bytes, bytearray, memoryview)) \
            else value

    body = dict(body)
    if isinstance(body.get("tensors"), list):
        body["tensors"] = [dict(e, b=squeezed(e["b"])) if isinstance(e, dict) and "b" in e else e for e in body["tensors"]]
    for key in ("gaps", "steps"):
        if key in body:
            body[key] = squeezed(body[key])
    return DELTA_CODEC + msgpack.packb(body, use_bin_type=True)


def _inflate(data, size: int) -> bytes:
    """zlib data decompressed, which must come to exactly `size` bytes (never more is inflated: a
    few KB of zeros could otherwise inflate to gigabytes)."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, max(size, 1))  # (0 would mean no bound)
        more = not inflater.eof and inflater.decompress(inflater.unconsumed_tail, 1)
    except zlib.error as exc:
        raise CorruptVersion(f"a compressed stream does not decode ({exc})") from exc
    if more or len(out) > size:
        raise CorruptVersion(f"a compressed stream decompresses to more than its {size} bytes")
    if not inflater.eof or len(out) != size:
        raise CorruptVersion(f"a compressed stream is truncated ({len(out)} of its {size} bytes)")
    return out


def _compressed_fields(body: dict) -> list[tuple[dict, str]]:
    """Where a delta's compressed streams (lists of [size, stream] segments) are: (the map, its key)."""
    places = [(body, key) for key in ("gaps", "steps") if key in body]
    tensors = body.get("tensors")
    if isinstance(tensors, list):
        places += [(e, "b") for e in tensors if isinstance(e, dict) and "b" in e]
    return places


def inflate_fields(body: dict, max_bytes: int, pool) -> None:
    """A delta's compressed fields replaced by their bytes (segments decompressed side by side on
    `pool`), their declared sizes checked against `max_bytes` before any of them inflates."""
    places = _compressed_fields(body)
    for where, key in places:
        segments = where[key]
        if not (isinstance(segments, list) and all(
                isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and pair[0] >= 0 and isinstance(pair[1], bytes)
                for pair in segments)):
            raise CorruptVersion(f"a delta's {key} is not a list of [size, compressed bytes] segments")
    if sum(pair[0] for where, key in places for pair in where[key]) > max_bytes:
        raise CorruptVersion(f"payload decompresses to more than {max_bytes} bytes")
    done = [[pool.submit(_inflate, pair[1], pair[0]) for pair in where[key]] for where, key in places]
    for (where, key), futures in zip(places, done):
        parts = [future.result() for future in futures]
        where[key] = parts[0] if len(parts) == 1 else b"".join(parts)
        del parts


def _format_error(codec: bytes, version) -> UnsupportedFormat:
    if codec == FORMAT_3_DELTA_CODEC or (isinstance(version, int) and version < FORMAT):
        older = 3 if codec == FORMAT_3_DELTA_CODEC else version
        return UnsupportedFormat(f"payload is weight format {older}, written by a peer running an older GEPO Swarm; "
                                 f"this peer reads format {FORMAT} only: update that peer (its publisher or holder) "
                                 "to this release")
    return UnsupportedFormat(f"payload is not a weight version of a format this peer knows (format {version!r}, "
                             f"codec {codec!r}; this peer reads format {FORMAT}): if the swarm runs a newer GEPO "
                             "Swarm, update this peer")


def delta_body(payload: bytes, max_bytes: int = MAX_PAYLOAD_BYTES, pool=None, *, inflate: bool = True) -> dict:
    """The msgpack body of a payload, a delta's compressed fields decompressed (`inflate`; else left
    as they are) (raises CorruptVersion, UnsupportedFormat for another format's payload)."""
    codec, data = payload[:1], memoryview(payload)[1:]
    if codec == FORMAT_3_DELTA_CODEC:
        raise _format_error(codec, 3)  # format 3's body is zlib over msgpack: not even decoded
    if codec not in (DELTA_CODEC, SNAPSHOT_CODEC):
        raise CorruptVersion(f"payload does not decode: unknown codec {bytes(codec)!r} (format {FORMAT} payloads start "
                             f"with {DELTA_CODEC!r} or {SNAPSHOT_CODEC!r})")
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # noqa: BLE001  msgpack's errors
        raise CorruptVersion(f"payload does not decode ({type(exc).__name__}: {exc})") from exc
    if not isinstance(body, dict):
        raise CorruptVersion("payload is not a map")
    if body.get("v") != FORMAT:
        raise _format_error(bytes(codec), body.get("v"))
    if codec == DELTA_CODEC and body.get("kind") == "delta":
        if inflate:
            inflate_fields(body, max_bytes, pool or Inline())
    elif codec == DELTA_CODEC or body.get("kind") == "delta":
        raise CorruptVersion(f"a {body.get('kind')!r} under codec {bytes(codec)!r}")
    return body
