"""Byte streams handed to zlib in the pieces they were made in, never joined into one copy (weight
deltas' varint streams and dense tensors' bits: swarm.fabric.weights.delta compresses each of them
this way, on its own thread), and a msgpack body packed in pieces around such streams."""

from __future__ import annotations

import zlib
from typing import Iterator

import msgpack

# bytes handed to zlib per call
FEED = 1 << 20


class Bin:
    """A msgpack bin given as pieces (bytes-like), packed without being joined."""

    def __init__(self, chunks) -> None:
        self.chunks = chunks  # bytes or 1-d uint8 arrays
        self.size = sum(len(c) for c in chunks)


def bin_header(size: int) -> bytes:
    for code, width in ((b"\xc4", 1), (b"\xc5", 2), (b"\xc6", 4)):
        if size < 1 << (8 * width):
            return code + size.to_bytes(width, "big")
    raise ValueError("bytes object is too large")  # as msgpack says


def packed(obj, packer: msgpack.Packer) -> Iterator:
    """msgpack.packb(obj, use_bin_type=True), in pieces: maps and lists are opened here, so that
    a Bin's pieces are passed on without being copied."""
    if isinstance(obj, dict):
        yield packer.pack_map_header(len(obj))
        for key, value in obj.items():
            yield from packed(key, packer)
            yield from packed(value, packer)
    elif isinstance(obj, list):
        yield packer.pack_array_header(len(obj))
        for item in obj:
            yield from packed(item, packer)
    elif isinstance(obj, Bin):
        yield bin_header(obj.size)
        yield from obj.chunks
    else:
        yield packer.pack(obj)


def deflated(head: bytes, chunks: Iterator, level: int, strategy: int) -> bytes:
    """head + zlib of the chunks joined, fed a megabyte or so at a time (deflate's output does not
    depend on how its input is cut)."""
    deflater = zlib.compressobj(level, zlib.DEFLATED, zlib.MAX_WBITS, 9, strategy)
    out, pending = [head], bytearray()
    for chunk in chunks:
        if len(chunk) >= FEED:
            out += [deflater.compress(pending), deflater.compress(chunk)]
            pending.clear()
            continue
        pending.extend(chunk)  # (+= would let numpy add an array to it)
        if len(pending) >= FEED:
            out.append(deflater.compress(pending))
            pending.clear()
    out += [deflater.compress(pending), deflater.flush()]
    return b"".join(out)
