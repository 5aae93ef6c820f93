"""The integer codings of weight deltas' streams (weights/delta.py), vectorised with numpy: zigzag
(signed steps as unsigned numbers, small either way) and LEB128 varints (7 bits a byte, low first,
the high bit set on all but a number's last byte). Decoding is bounded by the data's size whatever
the data, and can run in parts on an executor (numpy releases the GIL). Decoding takes kernels.py's
compiled pass where numba is there (the same numbers, the same refusals)."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from swarm.fabric.weights import kernels

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_DECODE_BYTES = 1 << 18  # varint bytes decoded at once (bounds the decoder's temporaries)


class Inline:
    """An executor that runs each task when it is submitted, in the caller's thread (THREADS <= 1)."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001  raised to whoever asks for the result, as a pool's would be
            future.set_exception(exc)
        return future


def zigzag(step: np.ndarray) -> np.ndarray:
    """Unsigned w-bit steps read as two's complement -> 0, -1, +1, -2, ... as 0, 1, 2, 3, ..."""
    width = step.dtype.itemsize * 8
    signs = (step.view(_SIGNED[step.dtype.itemsize]) >> (width - 1)).view(step.dtype)  # all ones where negative
    return (step << step.dtype.type(1)) ^ signs


def unzigzag(z: np.ndarray) -> np.ndarray:
    return (z >> z.dtype.type(1)) ^ (np.zeros_like(z) - (z & z.dtype.type(1)))


def _unsigned(values) -> np.ndarray:
    v = np.asarray(values)
    return v if v.dtype.kind == "u" else v.astype(np.uint64)


def _varint_lengths(v: np.ndarray) -> np.ndarray:
    """Bytes each unsigned integer takes as a varint (uint8), computed in the integers' own width."""
    lengths = np.ones(v.shape, np.uint8)
    for j in range(1, (v.dtype.itemsize * 8 + 6) // 7):
        more = v >= v.dtype.type(1 << (7 * j))
        if not more.any():
            break
        lengths += more
    return lengths


def varint_sizes(values: np.ndarray) -> np.ndarray:
    """Bytes each unsigned integer takes as a varint."""
    return _varint_lengths(_unsigned(values)).astype(np.int64)


def varint_array(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unsigned integers as LEB128 varints (uint8), and each one's length."""
    v = v.ravel()
    lengths = _varint_lengths(v)
    longest = int(lengths.max()) if v.size else 1
    if longest == 1:
        return v.astype(np.uint8), lengths
    starts = np.cumsum(lengths, dtype=np.int64)
    out = np.empty(int(starts[-1]), np.uint8)
    starts -= lengths
    # every number's first byte, then the second of those with two or more, ...
    out[starts] = (v & v.dtype.type(0x7F)).astype(np.uint8) | ((lengths > 1).view(np.uint8) << 7)
    for j in range(1, longest):
        rows = np.flatnonzero(lengths > j)
        byte = ((v[rows] >> v.dtype.type(7 * j)) & v.dtype.type(0x7F)).astype(np.uint8)
        out[starts[rows] + j] = byte | ((lengths[rows] > j + 1).view(np.uint8) << 7)
    return out, lengths


def varint_encode(values: np.ndarray) -> bytes:
    """Unsigned integers as LEB128 varints (7 bits a byte, low first, high bit set on all but the last)."""
    return varint_array(_unsigned(values))[0].tobytes()


def varint_bytes(value: int) -> bytes:
    """One unsigned integer as a varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def varint_decode(data, *, max_count: int, width_bits: int = 64, dtype=np.uint64, pool=None) -> np.ndarray:
    """LEB128 varints -> uint64 array (or `dtype`, a narrower unsigned type: a number that does not
    fit it is refused). ValueError when the data is truncated, holds more than `max_count` numbers,
    or a number wider than `width_bits` (memory is bounded by the data's size, whatever the data).
    `pool`: an executor to decode runs of a few hundred KB on."""
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"varints must be bytes, not {type(data).__name__}")
    buf = np.frombuffer(data, np.uint8)
    if buf.size == 0:
        return np.empty(0, dtype)
    if buf[-1] >= 0x80:
        raise ValueError("truncated varint")
    runs = _varint_runs(buf, width_bits)
    counts = [int(np.count_nonzero(buf[start:stop] < 0x80)) for start, stop in runs]
    if sum(counts) > max_count:
        raise ValueError(f"{sum(counts)} varints where at most {max_count} fit")
    out = np.empty(sum(counts), dtype)
    offsets = np.cumsum([0] + counts).tolist()
    pool = pool or Inline()
    decoded = [pool.submit(_decode_varints, buf[start:stop], out[offset:], width_bits) for (start, stop), offset in zip(runs, offsets)]
    for future in decoded:  # the first run's error first
        future.result()
    return out


def _varint_runs(buf: np.ndarray, width_bits: int) -> list[tuple[int, int]]:
    """buf cut into runs of about _DECODE_BYTES, each ending with a varint's last byte."""
    runs, start = [], 0
    while start < buf.size:
        stop = min(start + max(_DECODE_BYTES, 16), buf.size)  # 16: longer than any varint allowed
        if stop < buf.size:
            tail = max(start, stop - 16)  # varints are short: their last bytes are near the run's end
            ends = np.flatnonzero(buf[tail:stop] < 0x80)
            if ends.size == 0:
                tail = start
                ends = np.flatnonzero(buf[start:stop] < 0x80)
            if ends.size == 0:
                raise ValueError(f"a varint of more than {stop - start} bytes for a {width_bits}-bit number")
            stop = tail + int(ends[-1]) + 1
        runs.append((start, stop))
        start = stop
    return runs


def _decode_varints(buf: np.ndarray, out: np.ndarray, width_bits: int) -> int:
    """Decode whole varints into the start of `out`; returns how many."""
    if kernels.ENABLED:
        limit = min(width_bits, out.dtype.itemsize * 8)
        count = kernels.decode_varints(buf, out, (width_bits + 6) // 7, limit)
        if count >= 0:
            return count
        if count == kernels.VARINT_TOO_LONG:
            raise ValueError(f"a varint of more than {(width_bits + 6) // 7} bytes for a {width_bits}-bit number")
        if count == kernels.VARINT_OVER_64_BITS:
            raise ValueError("a varint wider than 64 bits")
        raise ValueError(f"a varint wider than {limit} bits")
    ends = np.flatnonzero(buf < 0x80)
    count = ends.size
    if count == buf.size:
        values = buf.astype(np.uint64)
    else:
        lengths = np.diff(ends, prepend=-1)
        longest = int(lengths.max())
        if longest > (width_bits + 6) // 7:
            raise ValueError(f"a varint of {longest} bytes for a {width_bits}-bit number")
        starts = ends - lengths + 1
        values = (buf[starts] & 0x7F).astype(np.uint64)
        for j in range(1, longest):
            rows = np.flatnonzero(lengths > j)
            byte = buf[starts[rows] + j]
            if j == 9 and (byte > 1).any():
                raise ValueError("a varint wider than 64 bits")
            values[rows] |= (byte & 0x7F).astype(np.uint64) << np.uint64(7 * j)
    if width_bits < 64 and (values >> np.uint64(width_bits)).any():
        raise ValueError(f"a varint wider than {width_bits} bits")
    if out.dtype.itemsize < 8 and (values >> np.uint64(out.dtype.itemsize * 8)).any():
        raise ValueError(f"a varint wider than {out.dtype.itemsize * 8} bits")
    out[:count] = values
    return count
