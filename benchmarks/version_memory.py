"""Memory of the versions a learner holds, at Qwen3-0.6B shape: 65 versions (max_staleness 64 + 1)
held as the learner's VersionStore holds them (the newest whole, older ones as undo deltas, forward
deltas for half a snapshot), against one snapshot and against 65 whole states (the old store).

States are generated, not trained: random bf16 tensors of Qwen3-0.6B's parameter shapes (tied
embeddings once: 596 M parameters, 1.19 GB a state), each version moving ~4% of the elements by one
step of their bits (a one-ulp move, as a bf16 element crossing a rounding boundary does at RL
learning rates). Only one or two states are ever whole in this process: the rest is held encoded.
Also measured: the time to rebuild the oldest version (64 undo deltas, the end checked against its
hash) and the newest but one (one undo delta), with no rebuilt version cached; and, as the baseline
in the same run, the store's old way of rebuilding the oldest: 64 undo deltas in the wire codec
(format 5), each applied with its base and result hashed (GEPO_VERSION_MEMORY_BASELINE=0 skips it;
the RSS figures include those baseline deltas, tracked bytes do not).

And the worst wait of a reader that must not wait, for the oldest held version, before and after
old versions were rebuilt in the background (issue 44): before, a verification asked the store
for the version and waited for its whole rebuild (the cold rebuild of the oldest above), and a
weight server's request waited for that and the snapshot's encoding; after, `state_now` applies at
most INLINE_UNDO_DELTAS undo deltas in the asking thread (measured cold at that distance from the
newest) and answers None at once for an older version (the group is deferred, the request answered
busy) while one background thread rebuilds it, whose time until the version is ready is reported
too (what a deferred group waits, not the training step).

`python -m benchmarks version_memory` (GEPO_VERSION_MEMORY_VERSIONS=65, GEPO_VERSION_MEMORY_SCALE=1.0:
a fraction of the vocabulary and MLP width, GEPO_VERSION_MEMORY_LAYERS=28: fewer layers, for a quicker run)
"""

from __future__ import annotations

import os
import time

import torch

from benchmarks.common import markdown_table, write_result

CHANGED = 0.04  # share of elements moved per version


def qwen3_06b_shapes(scale: float = 1.0, layers: int = 28) -> dict[str, tuple[int, ...]]:
    """Qwen3-0.6B's parameter shapes (config.json: hidden 1024, 28 layers, 16 query heads and 8
    key-value heads of 128, MLP 3072, vocabulary 151,936, tied embeddings); `scale` narrows the
    vocabulary and MLP and `layers` takes fewer layers, for a quicker run."""
    hidden, heads, kv_heads, head_dim = 1024, 16, 8, 128
    mlp, vocab = int(3072 * scale), int(151936 * scale)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (mlp, hidden), p + "mlp.up_proj.weight": (mlp, hidden), p + "mlp.down_proj.weight": (hidden, mlp),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
    return shapes


def first_state(shapes, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}


def next_state(state, gen: torch.Generator, changed: float = CHANGED) -> dict[str, torch.Tensor]:
    """A copy of `state` with ~`changed` of each tensor's elements moved one step of their bits."""
    out = {}
    for name, t in state.items():
        bits = t.view(torch.int16).clone().view(-1)
        k = max(1, int(bits.numel() * changed))
        where = torch.randint(0, bits.numel(), (k,), generator=gen)
        bits[where] += (torch.randint(0, 2, (k,), generator=gen, dtype=torch.int16) * 2 - 1)
        out[name] = bits.view(t.shape).view(torch.bfloat16)
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trimmed_rss() -> int:
    """RSS once glibc has handed freed memory back (malloc_trim): what the held versions take, not
    the heap the encoders' threads left free behind them."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss_bytes()


def reader_waits(store, oldest: int, hashes: dict[int, str]) -> dict:
    """How long a reader that must not wait (a verification, a serving request) waits now, with
    nothing rebuilt cached: the worst inline rebuild (INLINE_UNDO_DELTAS from the newest), asking
    for the oldest (queued behind), a request for the oldest's snapshot (answered busy), and how
    long the background thread takes until the oldest is ready and then served."""
    from swarm.fabric.weights.delta import encode_snapshot, state_hash
    from swarm.fabric.weights.upload_slots import HolderBusy

    def cold() -> None:
        store._cache.clear()
        for version in list(store.hashes):
            store.behind.forget(version)
        store._snapshot = None

    inline, newest = store.inline_undo, max(store.hashes)
    nearest = max(oldest, newest - inline)
    cold()
    started = time.perf_counter()
    state = store.state_now(nearest)
    inline_s = time.perf_counter() - started
    assert state is not None and state_hash(state) == hashes[nearest]
    started = time.perf_counter()
    encode_snapshot(state, nearest)
    encode_s = time.perf_counter() - started
    del state
    cold()
    asked = started = time.perf_counter()
    assert store.state_now(oldest) is None, "the oldest was rebuilt in the asking thread"
    ask_s = time.perf_counter() - started
    started = time.perf_counter()
    try:
        store.payloads(None, oldest)
        raise AssertionError("a request for the oldest's snapshot was served at once")
    except HolderBusy:
        busy_s = time.perf_counter() - started
    while not store.available_now(oldest):
        time.sleep(0.05)
    ready_s = time.perf_counter() - asked
    started = time.perf_counter()
    served = store.payloads(None, oldest)
    served_s = time.perf_counter() - started
    del served
    cold()
    return {"inline_undo": inline, "inline_worst_s": round(inline_s, 2), "encode_snapshot_s": round(encode_s, 2),
            "ask_oldest_s": round(ask_s, 4), "busy_reply_s": round(busy_s, 4), "behind_ready_s": round(ready_s, 2),
            "served_after_s": round(served_s, 2), "worst_verification_wait_s": round(max(inline_s, ask_s), 2),
            "worst_serving_wait_s": round(max(inline_s + encode_s, busy_s), 2)}


def run() -> dict:
    from swarm.fabric.weights.delta import apply_payload_verified, encode_delta, state_hash
    from swarm.fabric.weights.versions import VersionStore, snapshot_bytes

    versions = int(os.environ.get("GEPO_VERSION_MEMORY_VERSIONS", 65))
    scale = float(os.environ.get("GEPO_VERSION_MEMORY_SCALE", 1.0))
    layers = int(os.environ.get("GEPO_VERSION_MEMORY_LAYERS", 28))
    baseline = os.environ.get("GEPO_VERSION_MEMORY_BASELINE", "1") != "0"
    wire_undo: list[bytes] = []  # the old store's undo deltas (format 5), newest first once reversed
    load_before = os.getloadavg()[0]
    gen = torch.Generator().manual_seed(0)
    rss_start = rss_bytes()
    state = first_state(qwen3_06b_shapes(scale, layers), gen)
    size = snapshot_bytes(state)
    params = sum(t.numel() for t in state.values())
    rss_one = rss_bytes() - rss_start
    import swarm.fabric.weights.versions as versions_module

    trims: list[float] = []  # the store hands freed heap back after each add (swarm.heap): what that costs

    untimed = versions_module.give_back_free_heap

    def timed_trim(trim=untimed) -> bool:
        started = time.perf_counter()
        try:
            return trim()
        finally:
            trims.append(time.perf_counter() - started)
    versions_module.give_back_free_heap = timed_trim
    store = VersionStore(capacity=versions, whole_states=1, cached_states=1, delta_budget=0.5)  # as the learner's
    add_s, hashes = [], {}
    for version in range(versions):
        started = time.perf_counter()
        hashes[version] = store.add(version, state, owned=True)
        add_s.append(time.perf_counter() - started)
        if version + 1 < versions:
            older, state = state, next_state(state, gen)
            if baseline:
                wire_undo.append(encode_delta(state, older, base_version=version + 1, version=version))
            del older
        print(f"[version_memory] version {version}: add {add_s[-1]:.1f}s, held {store.held_bytes()}", flush=True)
    del state
    held = store.held_bytes()
    rss_held = rss_bytes() - rss_start
    rss_trimmed = trimmed_rss() - rss_start
    oldest, hot = min(store.hashes), max(store.hashes) - 1
    timings = {}
    for name, version in (("newest_but_one", hot), ("oldest", oldest)):
        store._cache.clear()  # measured cold: no rebuilt version to start from
        started = time.perf_counter()
        rebuilt = store.state(version)
        timings[name] = round(time.perf_counter() - started, 2)
        assert state_hash(rebuilt) == hashes[version], f"version {version} rebuilt wrong"
        del rebuilt
    versions_module.give_back_free_heap = untimed  # (the adds are timed; later work in this process is not)
    waits = reader_waits(store, oldest, hashes)
    timings["serving_oldest_before"] = round(timings["oldest"] + waits["encode_snapshot_s"], 2)
    if baseline:  # the old way: each wire-codec undo delta applied with its base and result hashed
        state = store.state(max(store.hashes))
        started = time.perf_counter()
        for payload in reversed(wire_undo):
            _, state, _, _ = apply_payload_verified(payload, state)
        timings["oldest_before"] = round(time.perf_counter() - started, 2)
        assert state_hash(state) == hashes[oldest]
        del state
    rss_peak = rss_bytes() - rss_start
    load_after = os.getloadavg()[0]
    tracked = held["whole"] + held["undo"] + held["deltas"]
    figures = {
        "versions": versions, "scale": scale, "layers": layers, "parameters": params, "snapshot_bytes": size, "changed_per_version": CHANGED,
        "held_bytes": held, "wire_undo_bytes_before": sum(map(len, wire_undo)), "tracked_bytes": tracked, "tracked_over_snapshot": round(tracked / size, 3),
        "old_store_over_snapshot": versions, "rss_one_state_bytes": rss_one, "rss_held_bytes": rss_held,
        "rss_held_over_snapshot": round(rss_held / size, 3), "rss_trimmed_bytes": rss_trimmed,
        "rss_trimmed_over_snapshot": round(rss_trimmed / size, 3), "rss_after_rebuilds_bytes": rss_peak,
        "add_seconds_median": round(sorted(add_s)[len(add_s) // 2], 2), "rebuild_seconds": timings,
        "heap_trim_ms_median": round(1000 * sorted(trims)[len(trims) // 2], 2), "heap_trim_ms_max": round(1000 * max(trims), 2),
        "rebuild_oldest_undo_deltas": versions - 1,
        "reader_waits": waits, "verification_wait_oldest_before_s": timings["oldest"],
        "verification_wait_oldest_after_s": waits["worst_verification_wait_s"],
        "serving_wait_oldest_before_s": timings["serving_oldest_before"], "serving_wait_oldest_after_s": waits["worst_serving_wait_s"],
        "load_average": [round(load_before, 2), round(load_after, 2)], "cpus": os.cpu_count(),
        "busy": load_before > 1.5 or load_after > 1.5,
    }
    full = scale == 1.0 and layers == 28
    shape = "Qwen3-0.6B shape" if full else f"Qwen3-0.6B shape narrowed to {scale:g} of its vocabulary and MLP, {layers} layers"
    markdown = (f"# Versions held at {shape}\n\n{__doc__.strip()}\n\n"
                + markdown_table(["measure", "value"], [
                    ["parameters", params], ["one snapshot (GB)", round(size / 1e9, 3)],
                    [f"{versions} versions, tracked bytes (GB)", round(tracked / 1e9, 3)],
                    ["... in snapshots", round(tracked / size, 3)],
                    ["... whole / undo deltas / forward deltas (GB)",
                     f"{held['whole'] / 1e9:.3f} / {held['undo'] / 1e9:.3f} / {held['deltas'] / 1e9:.3f}"],
                    [f"{versions} versions, RSS (GB)", round(rss_held / 1e9, 3)],
                    ["... in snapshots", round(rss_held / size, 3)],
                    ["... in snapshots, once freed heap is trimmed (malloc_trim)", round(rss_trimmed / size, 3)],
                    [f"the old store ({versions} whole states), in snapshots", versions],
                    ["add a version (encode delta and undo delta, hash), median s", figures["add_seconds_median"]],
                    ["... of which: freed heap handed back (malloc_trim), median / largest ms",
                     f"{figures['heap_trim_ms_median']} / {figures['heap_trim_ms_max']}"],
                    ["rebuild the newest but one, s", timings["newest_but_one"]],
                    [f"rebuild the oldest ({versions - 1} undo deltas), s", timings["oldest"]],
                    ["worst wait of a verification for the oldest, before (its whole rebuild in the asking thread), s", timings["oldest"]],
                    [f"... after (at most {waits['inline_undo']} undo deltas in the asking thread, older ones behind), s",
                     waits["worst_verification_wait_s"]],
                    ["... of which: asking for the oldest (answered at once, rebuilt behind), s", waits["ask_oldest_s"]],
                    [f"... of which: rebuilding the newest but {waits['inline_undo']} in the asking thread, cold, s", waits["inline_worst_s"]],
                    ["worst wait of a serving request for the oldest, before (rebuild and encode its snapshot), s",
                     timings["serving_oldest_before"]],
                    ["... after (answered busy at once while it is rebuilt behind; inline rebuild and encode nearer), s",
                     waits["worst_serving_wait_s"]],
                    ["... the oldest rebuilt behind: ready after, s (a deferred group's wait, not the step's)", waits["behind_ready_s"]],
                    ["... then served (snapshot encoded), s", waits["served_after_s"]],
                    *([["... before (the wire codec's undo deltas, each apply hashed), s", timings["oldest_before"]],
                       ["... speed-up", round(timings["oldest_before"] / max(timings["oldest"], 1e-9), 1)],
                       ["undo deltas before, in the wire codec (GB)", round(sum(map(len, wire_undo)) / 1e9, 3)]]
                      if baseline else []),
                ])
                + f"\nLoad average before/after: {figures['load_average']} on {os.cpu_count()} CPUs"
                + (" (the machine was busy with other work: timings are disturbed, bytes are not)" if figures["busy"] else "")
                + "\n")
    write_result("version_memory" if full else f"version_memory_scale{scale:g}_layers{layers}", figures, markdown)
    return figures
