"""Speed and memory of weight deltas (swarm/fabric/weights/delta.py) against the code before they
were parallelised: git REFERENCE's module, loaded into this process, on the same inputs.

Inputs: a synthetic bf16 state of about 50M elements shaped like a small Qwen3 (a 16384 x 1024
embedding, three layers of attention and MLP matrices, RMSNorm weights near 1), the bf16 cast of
float32 masters drawn N(0, 0.02). The next version adds +-u to every master and casts again:
u = 5e-7 moves about 2% of the bf16 elements by one ulp (what lr 1e-6 does, benchmarks/results/
delta_scale.md), u = 7e-6 about 20% (lr 1e-5).

Figures, per change rate: encode and apply seconds (best of REPEATS, old and new timed
alternately so that the machine's drift hits both), the new code also with one thread; the peak
memory each allocates beyond its result (tracemalloc: numpy's buffers and Python's objects; the
payload for encode, the new state for apply) per changed element; and whether the new encoder's
payload is byte-identical to the old one's (it must be: the wire format is unchanged).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
import types
from pathlib import Path

import torch

from benchmarks.common import markdown_table, write_result

REFERENCE = "c050e8d97aa5f55000fb5f4fca037e2f98e2c572"  # weight_delta.py before this work (format 3, single-threaded)
RATES = {"2%": 5e-7, "20%": 7e-6}  # label -> update added to the float32 masters
REPEATS = int(os.environ.get("GEPO_DELTA_SPEED_REPEATS", 3))
SCALES = {"Qwen3-0.6B": 0.6e9, "7B": 7.6e9}


def shapes() -> dict[str, tuple[int, ...]]:
    d = 1024
    out = {"embed": (16384, d)}
    for layer in range(3):
        for name, shape in [("q", (d, d)), ("k", (256, d)), ("v", (256, d)), ("o", (d, d)), ("gate", (2816, d)),
                            ("up", (2816, d)), ("down", (d, 2816)), ("norm1", (d,)), ("norm2", (d,))]:
            out[f"l{layer}.{name}"] = shape
    return out


def synthetic_states(update: float, seed: int = 0) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(seed)
    base, new = {}, {}
    for name, shape in shapes().items():
        norm = name.endswith(("norm1", "norm2"))
        master = (torch.ones(shape) + torch.randn(shape, generator=gen) * 1e-3) if norm else torch.randn(shape, generator=gen) * 0.02
        base[name] = master.to(torch.bfloat16)
        master.add_(torch.randn(shape, generator=gen).sign_().mul_(update))
        new[name] = master.to(torch.bfloat16)
    return base, new


def reference_module() -> types.ModuleType | None:
    """weight_delta.py as of REFERENCE (None without git history)."""
    root = Path(__file__).resolve().parents[1]
    try:
        source = subprocess.run(["git", "show", f"{REFERENCE}:swarm/fabric/weight_delta.py"], cwd=root, check=True,
                                capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("weight_delta_reference")
    sys.modules[module.__name__] = module  # (dataclasses and the like look modules up by name)
    exec(compile(source, f"{REFERENCE[:8]}:weight_delta.py", "exec"), module.__dict__)
    return module


def changed_elements(base: dict, new: dict) -> int:
    return sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in base)


def peak_bytes(fn) -> tuple[object, int]:
    """fn's result and the most memory it held at once beyond what was held before it."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def best_times(variants: dict, repeats: int) -> dict[str, float]:
    """Best seconds of each variant, run in turn `repeats` times."""
    best = {name: float("inf") for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            started = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def with_threads(module, threads: int, fn):
    def run():
        saved = module.THREADS
        module.THREADS = threads
        try:
            return fn()
        finally:
            module.THREADS = saved
    return run


def measure(label: str, update: float, old) -> dict:
    from swarm.fabric.weights import delta as wd

    base, new = synthetic_states(update)
    elements = sum(t.numel() for t in new.values())
    changed = changed_elements(base, new)
    state_bytes = sum(t.numel() * t.element_size() for t in new.values())
    payload = wd.encode_delta(base, new, base_version=0, version=1)
    _, state = wd.apply_payload(payload, base)
    assert all(torch.equal(state[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    row = {"label": label, "update": update, "elements": elements, "changed": changed, "changed_fraction": changed / elements,
           "payload_bytes": len(payload), "threads": wd.THREADS}

    encode = {"new": lambda: wd.encode_delta(base, new, base_version=0, version=1),
              "new, 1 thread": with_threads(wd, 1, lambda: wd.encode_delta(base, new, base_version=0, version=1))}
    apply = {"new": lambda: wd.apply_payload(payload, base), "new, 1 thread": with_threads(wd, 1, lambda: wd.apply_payload(payload, base))}
    if old is not None:
        old_payload = old.encode_delta(base, new, base_version=0, version=1)
        row["identical_payload"] = old_payload == payload
        assert row["identical_payload"], "the new encoder's payload differs from the reference's"
        encode["old"] = lambda: old.encode_delta(base, new, base_version=0, version=1)
        apply["old"] = lambda: old.apply_payload(payload, base)
    row["encode_s"] = best_times(encode, REPEATS)
    row["apply_s"] = best_times(apply, REPEATS)

    memory = {"new": (encode["new"], apply["new"])}
    if old is not None:
        memory["old"] = (encode["old"], apply["old"])
    row["encode_peak_bytes"], row["apply_peak_bytes"] = {}, {}
    for name, (enc, app) in memory.items():
        out, row["encode_peak_bytes"][name] = peak_bytes(enc)
        del out
        out, row["apply_peak_bytes"][name] = peak_bytes(app)
        del out
    # beyond the result (the payload; the new state), per changed element
    row["encode_bytes_per_changed"] = {k: (v - len(payload)) / changed for k, v in row["encode_peak_bytes"].items()}
    row["apply_bytes_per_changed"] = {k: (v - state_bytes) / changed for k, v in row["apply_peak_bytes"].items()}
    speed = lambda s: {k: s["old"] / v for k, v in s.items() if k != "old"} if "old" in s else {}  # noqa: E731
    row["encode_speedup"], row["apply_speedup"] = speed(row["encode_s"]), speed(row["apply_s"])
    print(f"  {label}: {changed / elements:.1%} changed; encode " + ", ".join(f"{k} {v:.2f} s" for k, v in row["encode_s"].items())
          + "; apply " + ", ".join(f"{k} {v:.2f} s" for k, v in row["apply_s"].items()), flush=True)
    return row


def run() -> dict:
    started = time.perf_counter()
    old = reference_module()
    if old is None:
        print(f"  (no git history: the reference {REFERENCE[:8]} is not measured)", flush=True)
    rows = [measure(label, update, old) for label, update in RATES.items()]
    figures = {"reference": REFERENCE, "repeats": REPEATS, "rows": rows, "seconds": time.perf_counter() - started}
    write_result("delta_speed", figures, markdown(figures))
    return figures


def markdown(f: dict) -> str:
    rows = f["rows"]
    mb = 1e6
    compared = all("old" in r["encode_s"] for r in rows)

    def pair(r, key, name):
        return f"{r[key][name]:.2f} s" if name in r[key] else "-"

    lines = [
        "# Weight-delta encode and apply: speed and memory\n",
        f"`python -m benchmarks delta_speed` (`benchmarks/delta_speed.py`). A synthetic bf16 state of "
        f"{rows[0]['elements'] / 1e6:.1f}M elements (a 16384 x 1024 embedding and three layers of Qwen3-shaped matrices, "
        "N(0, 0.02), norms near 1); the next version moves every float32 master by +-u and casts again. "
        f"Old: `swarm/fabric/weight_delta.py` as of {f['reference'][:8]} (single-threaded), loaded into the same process; "
        f"new: the current module with {rows[0]['threads']} threads (THREADS, min(4, cores)) and with one. "
        f"Best of {f['repeats']}, old and new run alternately. Memory: the peak that tracemalloc sees (numpy's buffers, "
        "Python's objects) beyond what was held before, less the call's result (the payload; the new state), per "
        "changed element.\n",
        markdown_table(
            ["changed", "payload", "encode old", "encode new", "speed-up", "encode new, 1 thread",
             "apply old", "apply new", "speed-up", "apply new, 1 thread", "identical payload"],
            [[f"{r['changed_fraction']:.1%} ({r['changed'] / mb:.2f}M)", f"{r['payload_bytes'] / mb:.2f} MB",
              pair(r, "encode_s", "old"), pair(r, "encode_s", "new"),
              f"{r['encode_speedup']['new']:.2f}x" if r["encode_speedup"] else "-", pair(r, "encode_s", "new, 1 thread"),
              pair(r, "apply_s", "old"), pair(r, "apply_s", "new"),
              f"{r['apply_speedup']['new']:.2f}x" if r["apply_speedup"] else "-", pair(r, "apply_s", "new, 1 thread"),
              {True: "yes", False: "NO"}.get(r.get("identical_payload"), "not compared")] for r in rows]),
        "\nPeak memory beyond the result, bytes per changed element (and the whole peak):\n",
        markdown_table(
            ["changed", "encode old", "encode new", "apply old", "apply new"],
            [[f"{r['changed_fraction']:.1%}"] + [
                f"{r[per][name]:.0f} ({r[peak][name] / mb:.0f} MB)" if name in r[per] else "-"
                for per, peak, name in (("encode_bytes_per_changed", "encode_peak_bytes", "old"),
                                        ("encode_bytes_per_changed", "encode_peak_bytes", "new"),
                                        ("apply_bytes_per_changed", "apply_peak_bytes", "old"),
                                        ("apply_bytes_per_changed", "apply_peak_bytes", "new"))] for r in rows]),
        "\nExtrapolated linearly per element (the same change rate; one process, this machine's cores):\n",
        markdown_table(
            ["model", "changed"] + (["encode old / new", "apply old / new"] if compared else ["encode", "apply"]),
            [[name, f"{r['changed_fraction']:.0%}"] + [
                " / ".join(f"{r[key][v] / r['elements'] * params:.0f} s" for v in (("old", "new") if compared else ("new",)))
                for key in ("encode_s", "apply_s")] for name, params in SCALES.items() for r in rows]),
    ]
    if not compared:
        lines.append(f"\n(No git history here: the reference {f['reference'][:8]} was not measured.)\n")
    return "\n".join(lines)
