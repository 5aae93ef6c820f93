"""Run every benchmark (or those named): `python -m benchmarks [name ...]`. Figures are written to
benchmarks/results/ as JSON and Markdown (plus PNG plots), and a summary is printed."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

BENCHMARKS = ["is_variance", "learner_overhead", "generation_throughput", "generation_memory", "learner_step", "learner_breakdown", "length_buckets", "fabric", "fanout", "fanout_wan", "logprob_tolerance", "ban_rate", "flood_memory", "member_flood", "learner_memory", "delta_scale", "delta_speed", "publish_overlap", "version_memory", "snapshot_offload", "midsize_peers", "vllm_throughput", "learners", "learner_stalls", "slow_holder", "lora"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    import torch

    torch.set_num_threads(int(os.environ.get("GEPO_BENCH_THREADS", min(2, os.cpu_count() or 1))))
    from benchmarks.common import WRITTEN

    for name in args.names or BENCHMARKS:
        started = time.time()
        print(f"[bench] {name} ...", flush=True)
        before = len(WRITTEN)
        importlib.import_module(f"benchmarks.{name}").run()
        written = WRITTEN[before:]
        print(f"[bench] {name} done in {time.time() - started:.0f}s -> "
              f"{', '.join(map(str, written)) or 'nothing written'}", flush=True)
        for path in written:
            sys.stdout.write(path.read_text().split("\n", 2)[-1] + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
