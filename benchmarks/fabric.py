"""Swarm-fabric figures:
- bytes on the wire per policy version (delta) as a fraction of a full snapshot, for the embedded
  policy published in bf16 after real GEPO steps at two learning rates;
- rollout-group throughput over hivemind p2p streams and over gRPC, against a raw loopback TCP
  socket carrying the same frames with the same per-frame acknowledgement.
The fan-out of a ~100 MB version to 1/2/4/8 receivers is in fanout.py.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import torch

from benchmarks.common import markdown_table, write_result


def delta_fractions(steps: int = 4) -> list[dict]:
    from swarm.generation import SamplingParams
    from swarm.generation.transformers_backend import TransformersBackend
    from swarm.fabric.weights.delta import encode_delta, encode_snapshot
    from swarm.model.loading import load_policy
    from swarm.rewards import RewardScorer
    from swarm.sampling import produce_rollouts
    from swarm.tasks.synthetic import ArithmeticTask
    from swarm.training import LearnerCore

    rows = []
    scorer = RewardScorer()
    problems = ArithmeticTask(2).problems("train")
    for lr in (1e-4, 1e-5):
        torch.manual_seed(0)
        model, tok = load_policy("embedded")
        backend = TransformersBackend(model, tok)
        learner = LearnerCore(model, tok.pad_token_id, learning_rate=lr, lr_warmup_steps=0)  # the rate as labelled
        prev = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        snapshot = len(encode_snapshot(prev, 0))
        sizes, changed = [], []
        for step in range(steps):
            model.eval()
            groups = produce_rollouts(backend, scorer, problems[step * 16:(step + 1) * 16],
                                      SamplingParams(num_completions=8, max_new_tokens=16, seed=step), version=step, sampler_id="b")
            learner.step(groups)
            new = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
            sizes.append(len(encode_delta(prev, new, base_version=step, version=step + 1)))
            total = sum(t.numel() for t in new.values())
            changed.append(sum(int((prev[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in new) / total)
            prev = new
        rows.append({"lr": lr, "snapshot_bytes": snapshot, "mean_delta_bytes": sum(sizes) / len(sizes),
                     "fraction_of_snapshot": sum(sizes) / len(sizes) / snapshot, "elements_changed": sum(changed) / len(changed)})
    scorer.close()
    return rows


def _frames(n: int) -> list[bytes]:
    from swarm.fabric.rollouts.wire import encode_group
    from swarm.rollouts import RolloutGroup

    g = RolloutGroup("arith-d2-12+34", list(range(3, 40)), [list(range(3, 19))] * 8, [[-0.1] * 16] * 8,
                     [1.0] * 8, version=0, sampler_id="bench", completion_texts=["\\boxed{46}"] * 8)
    return [encode_group(g) for _ in range(n)]


def transport_throughput(transport: str, frames: list[bytes]) -> float:
    """Groups per second from one sampler to one learner's inbox over `transport`."""
    from swarm.fabric.local import LocalFabrics

    with LocalFabrics(transport, f"bench-{transport}") as fabrics:
        learner, sampler = fabrics.make(), fabrics.make()
        inbox = learner.rollout_inbox(vocab_size=99, capacity=len(frames) + 1)
        sender = sampler.rollout_sender(timeout_s=300)
        try:
            sender.send_frames(learner.peer_id, frames[:5])  # warm-up: open the connection
            started = time.perf_counter()
            acks = sender.send_frames(learner.peer_id, frames[5:])
            elapsed = time.perf_counter() - started
            assert all(a["ok"] for a in acks), acks[:3]
            return (len(frames) - 5) / elapsed
        finally:
            sender.close()
            inbox.close()


def raw_tcp_throughput(frames: list[bytes]) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve():
        conn, _ = server.accept()
        with conn:
            while True:
                header = conn.recv(8, socket.MSG_WAITALL)
                if len(header) < 8:
                    return
                size = struct.unpack("<Q", header)[0]
                conn.recv(size, socket.MSG_WAITALL)
                conn.sendall(struct.pack("<Q", 11) + b"\x81\xa2ok\xc3" + b"\x00" * 6)  # an ack of similar size

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    started = time.perf_counter()
    for frame in frames:
        client.sendall(struct.pack("<Q", len(frame)) + frame)
        header = client.recv(8, socket.MSG_WAITALL)
        client.recv(struct.unpack("<Q", header)[0], socket.MSG_WAITALL)
    elapsed = time.perf_counter() - started
    client.close()
    server.close()
    return len(frames) / elapsed


def run() -> dict:
    deltas = delta_fractions()
    frames = _frames(305)
    hm = transport_throughput("hivemind", frames)
    grpc_rate = transport_throughput("grpc", frames)
    raw = raw_tcp_throughput(frames[5:])
    figures = {"weight_deltas": deltas, "rollout_frame_bytes": len(frames[0]), "hivemind_groups_per_s": hm,
               "grpc_groups_per_s": grpc_rate, "raw_tcp_groups_per_s": raw, "hivemind_over_raw": hm / raw,
               "grpc_over_raw": grpc_rate / raw}
    md = "# Swarm fabric\n\n## Bytes per policy version (embedded policy, bf16, GEPO steps)\n\n" + markdown_table(
        ["learning rate", "snapshot bytes", "mean delta bytes", "delta / snapshot", "elements changed"],
        [[d["lr"], d["snapshot_bytes"], round(d["mean_delta_bytes"]), d["fraction_of_snapshot"], d["elements_changed"]] for d in deltas],
    ) + "\n## Rollout groups over the wire (one group of 8 completions per frame, acked)\n\n" + markdown_table(
        ["transport", "groups / s", "/ raw TCP"],
        [["hivemind p2p stream", hm, hm / raw], ["gRPC stream", grpc_rate, grpc_rate / raw], ["raw loopback TCP", raw, 1.0]],
    ) + f"\nframe size {len(frames[0])} bytes. The fan-out of a ~100 MB version is in fanout.md.\n"
    write_result("fabric", figures, md)
    return figures
