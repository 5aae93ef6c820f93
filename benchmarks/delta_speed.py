"""Speed and size of weight versions at Qwen3-0.6B shape (swarm/fabric/weights/delta.py, format 4)
against format 3 (git REFERENCE's codec, loaded into this process, run on the same inputs).

Inputs: a synthetic bf16 state with Qwen3-0.6B's parameter shapes (28 layers, hidden 1,024, MLP
3,072, 16 query / 8 key-value heads of 128, vocabulary 151,936, tied embeddings: 596M parameters),
built directly as tensors (no model): the bf16 cast of float32 masters drawn N(0, 0.02) (RMSNorm
weights near 1). The next version adds +-u to every master and casts again: u = 1e-6 changes about
4% of the bf16 elements, what one AdamW step at lr 1e-6 does (issue 44).

Format 5 runs twice: on its numpy path (kernels.ENABLED off: what a peer without numba runs) and
with its compiled kernels (swarm/fabric/weights/kernels.py), the same bytes; the kernels compile
(or load from numba's cache) before anything is timed.

"Before" is what was published before tied parameters went once: format 3 with the embedding a
second time as lm_head.weight (751.6M elements); "after" is format 4 with the 596M unique ones.
Figures: encode (a delta, the hashes of both states included), the state hash alone, apply with
its checks (the base's hash and the result's), each in wall seconds and in CPU seconds of this
process (time.process_time: all threads; less disturbed than wall time on a shared machine);
format 4 also with the base's hash known to the caller (a VersionStore holds it); payload bytes;
a snapshot's encode time and bytes. GEPO_DELTA_SPEED_SHAPE=small runs the same on a 3-layer state
with a 16,384-row vocabulary (the smoke test's size).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from benchmarks.common import markdown_table, write_result

REFERENCE = "f97113a09f79fce3ff7f6f5d62738dce039867c2"  # format 3's codec (the last commit before format 4)
FORMAT_4 = "3be50c761b8195cd98f7680690c6aae70deec604"  # format 4's codec (the `codec` branch before format 5)
REFERENCE_MODULES = ("packed_stream", "varints", "value_classes", "delta")
FORMAT_4_MODULES = ("packed_stream", "varints", "value_classes", "wire_layout", "delta")
UPDATE = 1e-6  # added to the float32 masters: ~4% of bf16 elements change
REPEATS = int(os.environ.get("GEPO_DELTA_SPEED_REPEATS", 2))
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
GOAL_S = 2.0  # issue 44: encode + hash, and apply with its checks, each at most this (on a quiet machine)


def shapes(which: str = "qwen3-0.6b") -> dict[str, tuple[int, ...]]:
    """Qwen3-0.6B's parameters (config.json: hidden 1024, intermediate 3072, 28 layers, head_dim 128,
    16 / 8 heads, vocabulary 151,936), the tied lm_head left out; `small`: 3 layers, 16,384 rows."""
    d, inter, hd = 1024, 3072, 128
    layers, vocab = (28, 151_936) if which == "qwen3-0.6b" else (3, 16_384)
    out = {EMBED: (vocab, d), "model.norm.weight": (d,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj.weight", (16 * hd, d)), ("self_attn.k_proj.weight", (8 * hd, d)),
                            ("self_attn.v_proj.weight", (8 * hd, d)), ("self_attn.o_proj.weight", (d, 16 * hd)),
                            ("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,)),
                            ("mlp.gate_proj.weight", (inter, d)), ("mlp.up_proj.weight", (inter, d)),
                            ("mlp.down_proj.weight", (d, inter)), ("input_layernorm.weight", (d,)),
                            ("post_attention_layernorm.weight", (d,))]:
            out[p + name] = shape
    return out


def synthetic_states(which: str, update: float = UPDATE, seed: int = 0) -> tuple[dict, dict]:
    """(base, new) bf16 states, tensor by tensor (one float32 master alive at a time)."""
    gen = torch.Generator().manual_seed(seed)
    base, new = {}, {}
    for name, shape in shapes(which).items():
        norm = len(shape) == 1
        master = (torch.ones(shape) + torch.randn(shape, generator=gen) * 1e-3) if norm else torch.randn(shape, generator=gen).mul_(0.02)
        base[name] = master.to(torch.bfloat16)
        master.add_(torch.randn(shape, generator=gen).sign_().mul_(update))
        new[name] = master.to(torch.bfloat16)
        del master
    return base, new


def with_tied_copy(state: dict) -> dict:
    """The state as published before: the embedding a second time, as the output layer."""
    return {**state, HEAD: state[EMBED]}


def reference_codec(commit: str = REFERENCE, modules=REFERENCE_MODULES, package_name: str = "weights_format3") -> types.ModuleType | None:
    """delta.py (and the modules beside it) as of `commit` (format 3's: REFERENCE), loaded under
    another name; None without git history."""
    root = Path(__file__).resolve().parents[1]
    package = types.ModuleType(package_name)
    package.__path__ = []
    sys.modules[package.__name__] = package
    module = None
    for name in modules:
        try:
            source = subprocess.run(["git", "show", f"{commit}:swarm/fabric/weights/{name}.py"], cwd=root, check=True,
                                    capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        module = types.ModuleType(f"{package.__name__}.{name}")
        sys.modules[module.__name__] = module  # (dataclasses and the like look modules up by name)
        source = source.replace("swarm.fabric.weights.", f"{package.__name__}.")
        exec(compile(source, f"{commit[:8]}:{name}.py", "exec"), module.__dict__)
    return module


def timed(fn) -> tuple[object, float, float]:
    """fn's result, wall seconds and CPU seconds (this process, all threads)."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def best(fn, repeats: int) -> dict:
    """Best wall and best CPU seconds of `repeats` runs (the result of none is kept)."""
    walls, cpus = [], []
    for _ in range(repeats):
        out, wall, cpu = timed(fn)
        del out
        walls.append(wall)
        cpus.append(cpu)
    return {"wall_s": min(walls), "cpu_s": min(cpus)}


def measure_format(label: str, codec, base: dict, new: dict, repeats: int, *, known_hash: bool, snapshot: bool) -> dict:
    """Delta encode, hash, apply (and a snapshot's encode where `snapshot`: format 3's would hold
    1.5 GB twice at once, msgpack.packb's buffer and its copy, past this benchmark's memory bound)."""
    elements = sum(t.numel() for t in new.values())
    payload = codec.encode_delta(base, new, base_version=0, version=1)
    _, state = codec.apply_payload(payload, base)
    assert all(torch.equal(state[k].view(torch.int16), new[k].view(torch.int16)) for k in new), f"{label}: not bit for bit"
    del state
    row = {"label": label, "elements": elements, "payload_bytes": len(payload),
           "encode": best(lambda: codec.encode_delta(base, new, base_version=0, version=1), repeats),
           "hash": best(lambda: codec.state_hash(new), repeats),
           "apply": best(lambda: codec.apply_payload(payload, base), repeats)}
    if known_hash:
        digest = codec.state_hash(base)
        row["encode_known_base"] = best(lambda: codec.encode_delta(base, new, base_version=0, version=1, base_hash=digest), repeats)
        row["apply_known_base"] = best(lambda: codec.apply_payload(payload, base, base_hash=digest), repeats)
    if known_hash and codec.__name__ == "swarm.fabric.weights.delta":  # this codec: also the undo delta a store holds
        from swarm.fabric.weights.undo import encode_undo

        def undo():
            return encode_undo(new, base, newer=1, newer_hash="", version=0, version_hash="")
        row["undo_bytes"] = undo().nbytes
        row["undo"] = best(undo, repeats)
    payload = b""  # (freed before the snapshot is made)
    weights = sum(t.numel() * t.element_size() for t in new.values())
    if snapshot:
        payload, wall, cpu = timed(lambda: codec.encode_snapshot(new, 1))
        row["snapshot"] = {"bytes": len(payload), "wall_s": wall, "cpu_s": cpu, "header_bytes": len(payload) - weights}
        payload = b""
    else:
        row["snapshot"] = {"bytes": weights, "header_bytes": None}  # the weights' bytes; the header not measured
    print(f"  {label}: {elements / 1e6:.1f}M elements, delta {row['payload_bytes'] / 1e6:.2f} MB; encode "
          f"{row['encode']['wall_s']:.2f} s ({row['encode']['cpu_s']:.2f} s CPU), hash {row['hash']['wall_s']:.2f} s, "
          f"apply {row['apply']['wall_s']:.2f} s ({row['apply']['cpu_s']:.2f} s CPU)", flush=True)
    return row


def run() -> dict:
    from swarm.fabric.weights import delta as current

    which = os.environ.get("GEPO_DELTA_SPEED_SHAPE", "qwen3-0.6b")
    started = time.perf_counter()
    load_before = os.getloadavg()
    base, new = synthetic_states(which)
    changed = sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in new)
    unique = sum(t.numel() for t in new.values())
    rows = []
    old = reference_codec()
    if old is None:
        print(f"  (no git history: format 3 as of {REFERENCE[:8]} is not measured)", flush=True)
    else:
        rows.append(measure_format("format 3, tied copy published", old, with_tied_copy(base), with_tied_copy(new), REPEATS,
                                   known_hash=False, snapshot=False))
    previous = reference_codec(FORMAT_4, FORMAT_4_MODULES, "weights_format4")
    if previous is None:
        print(f"  (no git history: format 4 as of {FORMAT_4[:8]} is not measured)", flush=True)
    else:
        rows.append(measure_format("format 4, tied parameter once", previous, base, new, REPEATS, known_hash=True, snapshot=False))
    from swarm.fabric.weights import kernels

    if kernels.ENABLED:  # the same codec on its numpy path (what runs without numba): the in-process baseline
        kernels.ENABLED = False
        try:
            rows.append(measure_format(f"format {current.FORMAT}, numpy path", current, base, new, REPEATS, known_hash=True,
                                       snapshot=False))
        finally:
            kernels.ENABLED = True
    label = "compiled kernels" if kernels.ENABLED else "numpy path (no numba)"
    rows.append(measure_format(f"format {current.FORMAT}, {label}", current, base, new, REPEATS, known_hash=True,
                               snapshot=True))
    figures = {"shape": which, "reference": REFERENCE, "format_4": FORMAT_4, "format": current.FORMAT, "repeats": REPEATS, "threads": current.THREADS,
               "cpu_count": os.cpu_count(), "unique_elements": unique, "changed": changed, "changed_fraction": changed / unique,
               "update": UPDATE, "rows": rows, "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "seconds": time.perf_counter() - started}
    write_result("delta_speed" if which == "qwen3-0.6b" else f"delta_speed_{which}", figures, markdown(figures))
    return figures


def markdown(f: dict) -> str:
    rows = f["rows"]
    mb = 1e6

    def secs(r, key):
        if key not in r:
            return "-"
        return f"{r[key]['wall_s']:.2f} s ({r[key]['cpu_s']:.2f} s CPU)"

    def snapshot(r):
        if r["snapshot"]["header_bytes"] is None:
            return f"{r['snapshot']['bytes'] / mb:.1f} MB + header", "not built"
        return f"{r['snapshot']['bytes'] / mb:.1f} MB", secs(r, "snapshot") if "cpu_s" in r["snapshot"] else "-"

    busy = f["load_average_before"][0] > 0.5 * f["cpu_count"]  # (the load after is this benchmark's own)
    lines = [
        "# Weight versions at Qwen3-0.6B shape: encode, hash, apply, bytes\n" if f["shape"] == "qwen3-0.6b"
        else f"# Weight versions, {f['shape']} shape\n",
        f"`python -m benchmarks delta_speed` (`benchmarks/delta_speed.py`). A synthetic bf16 state with the parameter "
        f"shapes of {'Qwen3-0.6B' if f['shape'] == 'qwen3-0.6b' else 'a 3-layer Qwen3'} ({f['unique_elements'] / 1e6:.1f}M "
        f"unique elements, tied embeddings), float32 masters N(0, 0.02) cast to bf16; the next version moves every master "
        f"by +-{f['update']:g}: {f['changed_fraction']:.1%} of the elements change ({f['changed'] / 1e6:.2f}M). "
        f"Format 3: the codec as of {f['reference'][:8]}, loaded into the same process, on the state as it was published "
        f"(the tied embedding a second time as lm_head.weight); format 4: the codec as of {f['format_4'][:8]} (classes of "
        f"one exponent each, sorted), and format {f['format']}: this codec (four ranges of exponents, ranked without a "
        f"sort), each on each parameter once. {f['threads']} threads, {f['cpu_count']} cores; best of {f['repeats']} "
        "(wall and CPU each), oldest format first. "
        f"Encode includes hashing both states; apply includes the base's hash check and the result's.\n",
        f"Machine load (1-minute average) {f['load_average_before'][0]:.1f} before, {f['load_average_after'][0]:.1f} after"
        + (": **busy** (other jobs share these cores), so wall times are inflated; CPU seconds are the steadier figure, "
           "and the goals are for a quiet machine.\n" if busy else ".\n"),
        markdown_table(
            ["", "elements", "delta", "encode (with both hashes)", "hash", "apply + checks", "snapshot", "snapshot encode"],
            [[r["label"], f"{r['elements'] / mb:.1f}M", f"{r['payload_bytes'] / mb:.2f} MB", secs(r, "encode"), secs(r, "hash"),
              secs(r, "apply"), *snapshot(r)] for r in rows]),
    ]
    new = rows[-1]
    lines.append(f"\nFormat {f['format']} with the base's hash known to the caller (a VersionStore holds it): encode "
                 f"{secs(new, 'encode_known_base')}, apply {secs(new, 'apply_known_base')}. A snapshot is "
                 f"{new['snapshot']['bytes'] - new['snapshot']['header_bytes']:,} bytes of weights (2 bytes x "
                 f"{f['unique_elements']:,} parameters) plus a {new['snapshot']['header_bytes']:,}-byte header.\n")
    for old in rows[:-1]:
        ratio = lambda key, kind: old[key][kind] / new[key][kind]  # noqa: E731
        lines.append(markdown_table(
            [f"{old['label'].split(',')[0]} / format {f['format']}", "wall", "CPU"],
            [[what, f"{ratio(key, 'wall_s'):.2f}x", f"{ratio(key, 'cpu_s'):.2f}x"]
             for what, key in (("encode", "encode"), ("hash", "hash"), ("apply + checks", "apply"))]
            + [["delta bytes", f"{old['payload_bytes'] / new['payload_bytes']:.2f}x", ""]]))
        lines.append("")
    undone = [r for r in rows if "undo" in r]
    if undone:
        lines.append("Undo delta (what a publisher also encodes for each version a store holds, never sent: "
                     "swarm/fabric/weights/undo.py), " + "; ".join(f"{r['label'].split(', ')[-1]} {secs(r, 'undo')}"
                                                                  for r in undone)
                     + f"; {undone[-1]['undo_bytes'] / mb:.1f} MB.\n")
    lines.append(f"\nGoal (issue 44, a quiet machine): encode + hash at most {GOAL_S:.1f} s, apply with its checks at most "
                 f"{GOAL_S:.1f} s. Peak resident memory of the run: {f['peak_rss_bytes'] / 1e9:.1f} GB.\n")
    return "\n".join(lines)
