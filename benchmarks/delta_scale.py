"""Weight deltas at a scale that says something about real models: the mid-size Qwen3 policy
(swarm/model/midsize.py, ~49M parameters) trained by real LearnerCore steps (the default loss,
GEPO) at RL learning rates, its versions published as the bf16 cast of the float32 master weights.

Figures, per learning rate and step:
- the fraction of published bf16 elements that change;
- delta bytes against the bf16 snapshot: the previous format (2: uint32 gaps and new bits per
  tensor, zlib; re-implemented here), format 3's steps and gaps in index order (an ablation), and
  format 3 as shipped (positions listed per exponent class);
- bits per changed element against entropy bounds: positions log2 C(n, k) per tensor (no context)
  or per tensor and exponent class (what the receiver knows from the base), plus the entropy of
  the steps (pooled, or per class);
- encode and apply times; and the sampler's pause for a version swap
  (TransformersBackend.load_state_dict of the new version's state);
- each figure extrapolated to Qwen3-0.6B and a 7B model (formulas in the .md).
"""

from __future__ import annotations

import time
import zlib

import msgpack
import numpy as np
import torch

from benchmarks.common import markdown_table, write_result

LEARNING_RATES = {1e-6: 8, 1e-5: 3}  # learning rate -> optimizer steps measured
GRID_STEPS = 3  # steps at 1e-6 from masters on the bf16 grid (a run that starts from a bf16 checkpoint)
GROUP_SIZE, GROUPS_PER_STEP, MAX_NEW_TOKENS = 4, 2, 16
GROUPS = GROUPS_PER_STEP * max(LEARNING_RATES.values())  # each step of a run on groups of its own
SCALES = {"Qwen3-0.6B": 0.6e9, "7B": 7.6e9}  # parameters published (0.6B: 596M with tied embeddings; Qwen2.5-7B: 7.6B)


# ---------------------------------------------------------------------------------------------
# the previous format (2), for comparison: per tensor, sorted changed indices as uint32 gaps plus
# the new bits, or the whole tensor when that is smaller; msgpack, zlib level 6

def encode_format2(base: dict, new: dict) -> bytes:
    from swarm.fabric.weights.delta import _bits, state_hash

    tensors = []
    for name in sorted(new):
        old_bits, new_bits = _bits(base[name]), _bits(new[name])
        width = new[name].element_size()
        changed = np.flatnonzero(old_bits != new_bits)
        entry = {"n": name, "d": str(new[name].dtype), "s": list(new[name].shape)}
        if changed.size == 0:
            entry["k"] = "same"
        elif changed.size * (4 + width) < new_bits.size * width:
            entry.update(k="sparse", i=np.diff(changed, prepend=0).astype(np.uint32).tobytes(), b=new_bits[changed].tobytes())
        else:
            entry.update(k="dense", b=new_bits.tobytes())
        tensors.append(entry)
    body = {"v": 2, "kind": "delta", "version": 1, "base": 0, "base_hash": state_hash(base), "hash": state_hash(new),
            "tensors": tensors}
    return b"Z" + zlib.compress(msgpack.packb(body, use_bin_type=True), 6)


def apply_format2(payload: bytes, base: dict) -> dict:
    from swarm.fabric.weights.delta import DTYPES, _UINT, _bits, _from_bits, state_hash

    body = msgpack.unpackb(zlib.decompress(payload[1:]), raw=False)
    assert state_hash(base) == body["base_hash"]
    state = {}
    for entry in body["tensors"]:
        dtype, shape = DTYPES[entry["d"]], tuple(entry["s"])
        width = torch.empty(0, dtype=dtype).element_size()
        if entry["k"] == "dense":
            state[entry["n"]] = _from_bits(np.frombuffer(entry["b"], dtype=_UINT[width]), dtype, shape)
            continue
        bits = _bits(base[entry["n"]]).copy()
        if entry["k"] == "sparse":
            bits[np.cumsum(np.frombuffer(entry["i"], dtype=np.uint32).astype(np.int64))] = np.frombuffer(entry["b"], dtype=_UINT[width])
        state[entry["n"]] = _from_bits(bits, dtype, shape, copy=False)
    assert state_hash(state) == body["hash"]
    return state


def encode_index_order(base: dict, new: dict) -> bytes:
    """Format 3's coding without the classes (ablation): varint gaps in index order, then the steps."""
    from swarm.fabric.weights.delta import FLOATS, ZLIB_LEVEL, ZLIB_STRATEGY, _bits
    from swarm.fabric.weights.value_classes import ordered
    from swarm.fabric.weights.varints import varint_encode, zigzag

    gaps, steps = [], []
    for name in sorted(new):
        old_bits, new_bits = _bits(base[name]), _bits(new[name])
        changed = np.flatnonzero(old_bits != new_bits)
        is_float = new[name].dtype in FLOATS
        gaps.append(varint_encode(np.diff(changed, prepend=-1) - 1))
        steps.append(varint_encode(zigzag(ordered(new_bits[changed], is_float) - ordered(old_bits[changed], is_float))))
    packer = zlib.compressobj(ZLIB_LEVEL, zlib.DEFLATED, zlib.MAX_WBITS, 9, ZLIB_STRATEGY)
    return packer.compress(b"".join(gaps) + b"".join(steps)) + packer.flush()


# ---------------------------------------------------------------------------------------------

def entropy_bounds(base: dict, new: dict) -> dict:
    """Bits per changed element: positions without context (log2 C(n, k) per tensor) and given the
    base's exponent class (per tensor and class), steps pooled and per class."""
    from swarm.fabric.weights.value_classes import local_classes, ordered
    from swarm.fabric.weights.delta import FLOATS, _bits, entropy_bits, log2_binomial

    changed_total = 0
    positions_iid = positions_class = 0.0
    all_steps, all_classes = [], []
    for name in sorted(new):
        old_bits, new_bits = _bits(base[name]), _bits(new[name])
        changed = old_bits != new_bits
        k = int(changed.sum())
        if not k:
            continue
        changed_total += k
        positions_iid += log2_binomial(changed.size, k)
        local = local_classes(old_bits, new[name].dtype)
        local = np.zeros(changed.size, np.uint8) if local is None else local
        members, hits = np.bincount(local, minlength=256), np.bincount(local[changed], minlength=256)
        positions_class += sum(log2_binomial(int(n), int(h)) for n, h in zip(members, hits) if h)
        is_float = new[name].dtype in FLOATS
        width = old_bits.dtype.itemsize
        step = (ordered(new_bits[changed], is_float) - ordered(old_bits[changed], is_float)).view(f"i{width}").astype(np.int64)
        all_steps.append(step)
        all_classes.append(local[changed].astype(np.int64) + 1000 * width)
    steps, classes = np.concatenate(all_steps), np.concatenate(all_classes)
    steps_class = sum((classes == c).sum() * entropy_bits(steps[classes == c]) for c in np.unique(classes)) / steps.size
    steps_pooled = entropy_bits(steps)
    one_ulp = float(np.mean(np.abs(steps) == 1))
    return {"changed": changed_total, "positions_iid_bits": positions_iid / changed_total,
            "positions_class_bits": positions_class / changed_total, "steps_bits": steps_pooled, "steps_class_bits": steps_class,
            "bound_iid_bits": positions_iid / changed_total + steps_pooled,
            "bound_class_bits": positions_class / changed_total + steps_class, "one_ulp_share": one_ulp}


def published(model) -> dict:
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


def timed(fn, *args, repeat: int = 1, **kwargs):
    best, out = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        best = min(best, time.perf_counter() - started)
    return out, best


def measure_step(prev: dict, new: dict, step: int) -> dict:
    from swarm.fabric.weights.delta import apply_payload, encode_delta, state_hash

    elements = sum(t.numel() for t in new.values())
    snapshot = sum(t.numel() * t.element_size() for t in new.values())
    payload, encode_s = timed(encode_delta, prev, new, base_version=step, version=step + 1)
    (_, state), apply_s = timed(apply_payload, payload, prev)
    assert state_hash(state) == state_hash(new)
    old, old_encode_s = timed(encode_format2, prev, new)
    rebuilt, old_apply_s = timed(apply_format2, old, prev)
    assert state_hash(rebuilt) == state_hash(new)
    _, hash_s = timed(state_hash, new)
    index_order = len(encode_index_order(prev, new))
    bounds = entropy_bounds(prev, new)
    k = bounds["changed"]
    return {"step": step + 1, "elements": elements, "changed_fraction": k / elements, "snapshot_bytes": snapshot,
            "delta_bytes": len(payload), "delta_fraction": len(payload) / snapshot,
            "format2_bytes": len(old), "format2_fraction": len(old) / snapshot,
            "index_order_bytes": index_order, "index_order_fraction": index_order / snapshot,
            "bits_per_changed": len(payload) * 8 / k, "format2_bits_per_changed": len(old) * 8 / k,
            "index_order_bits_per_changed": index_order * 8 / k, **bounds,
            "encode_s": encode_s, "apply_s": apply_s, "format2_encode_s": old_encode_s, "format2_apply_s": old_apply_s,
            "state_hash_s": hash_s}


def make_groups(backend, tok) -> list:
    from swarm.generation import SamplingParams
    from swarm.rollouts import RolloutGroup
    from swarm.tasks.synthetic import ArithmeticTask

    problems = ArithmeticTask(2).problems("train")[:GROUPS]
    gens = backend.generate([p.prompt for p in problems], SamplingParams(num_completions=GROUP_SIZE, max_new_tokens=MAX_NEW_TOKENS, seed=0))
    rng = np.random.default_rng(0)
    groups = []
    for problem, gen in zip(problems, gens):
        rewards = np.zeros(GROUP_SIZE)
        rewards[rng.choice(GROUP_SIZE, GROUP_SIZE // 2, replace=False)] = 1.0  # varied within the group: advantages +-1
        groups.append(RolloutGroup(problem.problem_id, gen.prompt_ids, gen.completion_ids, gen.completion_logprobs,
                                   rewards.tolist(), version=0, sampler_id="bench", answer=problem.answer,
                                   completion_texts=gen.texts))
    return groups


def train_run(model, tok, initial: dict, groups: list, lr: float, steps: int, *, on_grid: bool) -> list[dict]:
    from swarm.training import LearnerCore

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial[name].to(torch.bfloat16).float() if on_grid else initial[name])
    learner = LearnerCore(model, tok.pad_token_id, learning_rate=lr, lr_warmup_steps=0)  # the rate as labelled
    prev = published(model)
    rows = []
    for step in range(steps):
        chosen = [groups[(step * GROUPS_PER_STEP + i) % len(groups)] for i in range(GROUPS_PER_STEP)]
        for g in chosen:
            g.version = learner.version  # on-policy as far as the loss is concerned
        started = time.perf_counter()
        metrics = learner.step(chosen)
        step_s = time.perf_counter() - started
        new = published(model)
        row = measure_step(prev, new, step)
        row.update(lr=lr, on_grid=on_grid, optimizer_step_s=step_s, loss=metrics.get("loss"), grad_norm=metrics.get("grad_norm"))
        rows.append(row)
        print(f"  lr {lr:g}{' (on grid)' if on_grid else ''} step {step + 1}: {row['changed_fraction']:.3%} changed, "
              f"delta {row['delta_fraction']:.3%} of snapshot (format 2: {row['format2_fraction']:.3%})", flush=True)
        prev = new
    return rows


def swap_times(model_dir: str, state: dict) -> dict:
    """Seconds of TransformersBackend.load_state_dict(state) for a bf16 sampler (what GPU samplers run)
    and a float32 one (CPU samplers: the load casts), best of 3, and the bytes per second copied."""
    from swarm.generation.transformers_backend import TransformersBackend
    from swarm.model.loading import load_policy

    out = {}
    for dtype in ("bfloat16", "float32"):
        model, tok = load_policy(model_dir, dtype=dtype)
        backend = TransformersBackend(model, tok)
        _, seconds = timed(backend.load_state_dict, state, repeat=3)
        written = sum(t.numel() for t in state.values()) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        out[dtype] = {"seconds": seconds, "bytes_written": written, "bytes_per_s": written / seconds}
        del backend, model
    return out


def mean(rows: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in rows]))


def run() -> dict:
    from swarm.generation.transformers_backend import TransformersBackend
    from swarm.model.loading import load_policy
    from swarm.model.midsize import build_info, midsize_model_dir

    started = time.perf_counter()
    model_dir = str(midsize_model_dir())
    info = build_info(model_dir)
    print(f"  model {model_dir}: {info['parameters'] / 1e6:.1f}M parameters (built in {info['seconds']['total']} s)", flush=True)
    torch.manual_seed(0)
    model, tok = load_policy(model_dir)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen_started = time.perf_counter()
    groups = make_groups(TransformersBackend(model, tok), tok)
    generate_s = time.perf_counter() - gen_started

    runs = {}
    for lr, steps in LEARNING_RATES.items():
        runs[f"{lr:g}"] = train_run(model, tok, initial, groups, lr, steps, on_grid=False)
    runs["1e-06 on grid"] = train_run(model, tok, initial, groups, 1e-6, GRID_STEPS, on_grid=True)
    last = published(model)
    del model
    swap = swap_times(model_dir, last)

    summary = {}
    for label, rows in runs.items():
        summary[label] = {key: mean(rows, key) for key in (
            "changed_fraction", "delta_fraction", "format2_fraction", "index_order_fraction", "bits_per_changed",
            "format2_bits_per_changed", "index_order_bits_per_changed", "bound_iid_bits", "bound_class_bits",
            "positions_iid_bits", "positions_class_bits", "steps_bits", "steps_class_bits", "one_ulp_share", "encode_s",
            "apply_s", "format2_encode_s", "format2_apply_s", "state_hash_s", "optimizer_step_s")}
    elements = runs["1e-06"][0]["elements"]
    snapshot = runs["1e-06"][0]["snapshot_bytes"]

    # extrapolation: per published element
    extrapolated = {}
    for name, params in SCALES.items():
        scale = {}
        for label in ("1e-06", "1e-05"):
            s = summary[label]
            scale[label] = {
                "delta_bytes": s["changed_fraction"] * params * s["bits_per_changed"] / 8,
                "format2_delta_bytes": s["changed_fraction"] * params * s["format2_bits_per_changed"] / 8,
                "encode_s": s["encode_s"] / elements * params,
                "apply_s": s["apply_s"] / elements * params,
            }
        scale["snapshot_bytes"] = 2 * params
        scale["swap_bf16_s"] = 2 * params / swap["bfloat16"]["bytes_per_s"]
        extrapolated[name] = scale

    figures = {"model": {"dir": model_dir, "parameters": info["parameters"], "published_elements": elements,
                         "snapshot_bytes": snapshot, "tokenizer_size": info["tokenizer_size"],
                         "architecture": info["architecture"], "build_seconds": info["seconds"]["total"]},
               "setup": {"groups": GROUPS, "group_size": GROUP_SIZE, "groups_per_step": GROUPS_PER_STEP,
                         "max_new_tokens": MAX_NEW_TOKENS, "generate_s": generate_s},
               "steps": runs, "summary": summary, "swap": swap, "extrapolated": extrapolated,
               "seconds": time.perf_counter() - started}
    write_result("delta_scale", figures, markdown(figures))
    return figures


def summary_lines(f: dict) -> str:
    s, ex, swap = f["summary"], f["extrapolated"], f["swap"]
    low, high, grid = s["1e-06"], s["1e-05"], s["1e-06 on grid"]
    rows = f["steps"]["1e-06"]
    over = [r["step"] for r in rows if r["delta_fraction"] > 0.01]
    under_from = next((r["step"] for r in rows if all(q["delta_fraction"] <= 0.01 for q in rows[r["step"] - 1:])), None)
    goal = ("met on average" if low["delta_fraction"] <= 0.01 else "not met on average") + (
        f", and at every step from step {under_from} on" if under_from and under_from > 1 else
        (", and at every step" if under_from == 1 else ""))
    return (
        f"- lr 1e-6: {low['changed_fraction']:.2%} of bf16 elements change per step (mean of {len(rows)} steps: "
        f"{rows[0]['changed_fraction']:.2%} at the first, {rows[-1]['changed_fraction']:.2%} at the last); the delta is "
        f"{low['delta_fraction']:.2%} of the snapshot (per step: "
        + ", ".join(f"{r['delta_fraction']:.2%}" for r in rows)
        + f"), against {low['format2_fraction']:.2%} with format 2. Goal (<= 1%) {goal}"
        + (f" (over 1% at step{'s' if len(over) > 1 else ''} {', '.join(map(str, over))})" if over else "")
        + f". From a bf16 checkpoint (masters on the grid): {grid['delta_fraction']:.2%}.\n"
        f"- lr 1e-5: {high['changed_fraction']:.1%} change; delta {high['delta_fraction']:.2%} of the snapshot "
        f"(format 2: {high['format2_fraction']:.2%}).\n"
        f"- bits per changed element at lr 1e-6: {low['bits_per_changed']:.2f} (format 2: {low['format2_bits_per_changed']:.1f}); "
        f"entropy bound {low['bound_iid_bits']:.2f} without context, {low['bound_class_bits']:.2f} given each element's "
        f"exponent (format 3 is {low['bits_per_changed'] / low['bound_class_bits'] - 1:.0%} above the latter).\n"
        f"- version swap (load_state_dict, bf16 sampler, CPU): {swap['bfloat16']['seconds'] * 1000:.0f} ms "
        f"(float32 sampler: {swap['float32']['seconds'] * 1000:.0f} ms).\n"
        f"- extrapolated, lr 1e-6: Qwen3-0.6B {ex['Qwen3-0.6B']['1e-06']['delta_bytes'] / 1e6:.0f} MB per step (TRL: 20-35 MB), "
        f"7B {ex['7B']['1e-06']['delta_bytes'] / 1e6:.0f} MB (PULSE: 108 MB).\n")


def markdown(f: dict) -> str:
    m, s, swap, ex = f["model"], f["summary"], f["swap"], f["extrapolated"]
    arch = m["architecture"]
    mb = 1024 ** 2
    lines = [
        "# Weight deltas at scale (mid-size Qwen3, bf16 versions)\n",
        f"Model: `swarm/model/midsize.py` (`python -m swarm.model.midsize DIR`): Qwen3 architecture, "
        f"{m['parameters'] / 1e6:.1f}M parameters (hidden {arch['hidden_size']}, {arch['num_hidden_layers']} layers, "
        f"{arch['num_attention_heads']} query / {arch['num_key_value_heads']} key-value heads, MLP {arch['intermediate_size']}, "
        f"tied embeddings), byte-level BPE tokenizer of {m['tokenizer_size']} tokens trained on 3 MB of generated text; "
        f"built in {m['build_seconds']:.1f} s on this machine. Published versions: {m['published_elements'] / 1e6:.2f}M "
        f"bf16 elements (the state dict lists the tied embedding twice), a {m['snapshot_bytes'] / mb:.1f} MiB snapshot.\n",
        f"Steps: `LearnerCore` with its default loss (GEPO), AdamW (betas 0.9/0.99), no warm-up, on "
        f"{f['setup']['groups_per_step']} groups of {f['setup']['group_size']} completions per step ({f['setup']['max_new_tokens']} "
        f"new tokens, sampled once from the untrained model; {f['setup']['groups']} prompts, no group used twice in a run). "
        "The model is a random initialisation, so no completion earns a reward; each group is given rewards 1 for half its completions and 0 for the rest (drawn at random), so that "
        "advantages are +-1 and every step moves the weights as a real RL step does. Published weights are the bf16 cast of "
        "the float32 masters. The masters start off the bf16 grid (a fresh float32 initialisation, as masters are after a "
        "few hundred steps of training); the last row starts them on the grid, as a run from a bf16 checkpoint does.\n",
        "## Summary\n",
        summary_lines(f),
        "## Fraction changed and delta size\n",
        markdown_table(
            ["learning rate", "steps", "bf16 elements changed", "one-ulp moves", "format 2 (before) / snapshot",
             "steps + gaps in index order / snapshot", "format 3 (classes) / snapshot"],
            [[label, len(f["steps"][label]), f"{v['changed_fraction']:.3%}", f"{v['one_ulp_share']:.1%}",
              f"{v['format2_fraction']:.3%}", f"{v['index_order_fraction']:.3%}", f"{v['delta_fraction']:.3%}"]
             for label, v in s.items()]),
        "\nPer step (the fraction changed falls after the first step: Adam's first update is lr x sign(gradient) "
        "for every element, later ones are smaller where gradients disagree from step to step):\n",
        markdown_table(["learning rate", "step", "changed", "format 2 / snapshot", "format 3 / snapshot", "format 3 bytes"],
                       [[label, r["step"], f"{r['changed_fraction']:.3%}", f"{r['format2_fraction']:.3%}",
                         f"{r['delta_fraction']:.3%}", r["delta_bytes"]] for label, rows in f["steps"].items() for r in rows]),
        "\n## Bits per changed element against the entropy bound\n",
        "Positions: log2 C(n, k) per tensor (no context), or summed over the exponent classes of each tensor (the "
        "receiver knows each element's exponent from the base, and an element's chance of changing is about "
        "update / ulp, so the exponent is worth knowing). Steps: entropy of the moves in representable values, pooled "
        "or per class. A bound for a coder that treats changes as independent given that context.\n",
        markdown_table(
            ["learning rate", "format 2", "index order", "format 3", "bound: positions + steps (no context)",
             "bound given the exponent class", "positions (no context / class)", "steps (pooled / class)"],
            [[label, f"{v['format2_bits_per_changed']:.2f}", f"{v['index_order_bits_per_changed']:.2f}",
              f"{v['bits_per_changed']:.2f}", f"{v['bound_iid_bits']:.2f}", f"{v['bound_class_bits']:.2f}",
              f"{v['positions_iid_bits']:.2f} / {v['positions_class_bits']:.2f}", f"{v['steps_bits']:.2f} / {v['steps_class_bits']:.2f}"]
             for label, v in s.items()]),
        "\n## Times (2 CPU cores, shared)\n",
        markdown_table(
            ["learning rate", "encode (format 3)", "apply (format 3)", "encode (format 2)", "apply (format 2)",
             "one state hash"],
            [[label, f"{v['encode_s']:.2f} s", f"{v['apply_s']:.2f} s", f"{v['format2_encode_s']:.2f} s",
              f"{v['format2_apply_s']:.2f} s", f"{v['state_hash_s']:.2f} s"]
             for label, v in s.items()]),
        "\nEncode hashes both versions and apply hashes the base and the result (the checks every receiver makes); "
        "format 3 adds a stable sort of each tensor's exponents on both sides.\n",
        "\n## The sampler's pause for a version swap\n",
        markdown_table(["sampler dtype", "load_state_dict", "bytes written", "GB/s"],
                       [[d, f"{v['seconds'] * 1000:.0f} ms", f"{v['bytes_written'] / mb:.0f} MiB", f"{v['bytes_per_s'] / 1e9:.2f}"]
                        for d, v in swap.items()]),
        "\n(`TransformersBackend.load_state_dict` with the whole new version, on CPU, best of 3; a float32 sampler also "
        "casts. Goal: under 1 s at this size.)\n",
        "\n## Extrapolated to larger models\n",
        "Formulas (P = parameters, each published once: 0.6B for Qwen3-0.6B, 7.6B for a Qwen2.5-7B-sized model; f, b, "
        "t, B measured above at lr 1e-6 and 1e-5, means over the steps):\n",
        "- delta bytes = f x P x b / 8, with f the fraction changed and b the bits per changed element. Both are taken as "
        "they are here: f is set by lr against the ulps of the weights (their magnitudes), not by P, and b grows only "
        "with log(1/f). Delta / snapshot = f x b / 16, independent of P;\n",
        "- encode and apply time = (seconds per element here) x P, one process on 2 cores (both are linear: a compare, "
        "a sort of one byte per element, two sha256 passes; the pieces and the hashes run on weights.delta.THREADS "
        "threads, zlib on one: `python -m benchmarks delta_speed` measures them against the single-threaded code);\n",
        "- swap time = 2 P bytes / B, with B the bf16 load_state_dict rate measured here (host memory; on a GPU the "
        "copy runs at the host-to-device rate instead, ~25 GB/s pinned on PCIe 5, less from pageable memory).\n",
        markdown_table(
            ["model", "snapshot", "delta at 1e-6 (format 3)", "delta at 1e-6 (format 2)", "delta at 1e-5 (format 3)",
             "encode / apply at 1e-6", "swap (bf16, host)"],
            [[name, f"{v['snapshot_bytes'] / 1e9:.1f} GB", f"{v['1e-06']['delta_bytes'] / 1e6:.0f} MB",
              f"{v['1e-06']['format2_delta_bytes'] / 1e6:.0f} MB", f"{v['1e-05']['delta_bytes'] / 1e6:.0f} MB",
              f"{v['1e-06']['encode_s']:.0f} s / {v['1e-06']['apply_s']:.0f} s", f"{v['swap_bf16_s']:.2f} s"]
             for name, v in ex.items()]),
        "\nPublished anchors: TRL's delta weight sync reports 20-35 MB per step for Qwen3-0.6B (about 2-3% of its "
        "bf16 snapshot); PULSE reports 108 MB per step for a 7B model (14 GB snapshot, 0.77%). The issue's goal: "
        "delta <= 1% of the bf16 snapshot at lr 1e-6.\n",
        "\nCaveats: the weights are a fresh initialisation (normal, std 0.02; RMSNorm weights 1.0), not a trained model's. "
        "An element changes with probability about update / ulp, and its ulp is proportional to its magnitude, so f is "
        "set mostly by how many weights lie near zero: a trained model's distribution gives another f. The fraction "
        "changed also depends on Adam's state: it falls over the first steps (measured here) as gradients that disagree "
        "from step to step shrink the normalised update. A run that starts from a bf16 checkpoint has its masters on the "
        "grid: at first only elements whose ulp is below about twice the update change (the smallest weights, often by "
        "several ulps), which the exponent classes predict well (the last row: 0.2-0.4% of the snapshot).\n",
    ]
    return "\n".join(lines)
