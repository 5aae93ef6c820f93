"""Fan-out under shaped links: how long one policy version takes to reach 1, 2, 4 and 8 samplers
when every peer has a 100 Mbit/s link (up and down, tbf in network namespaces: benchmarks/wan.py),
and how many copies the learner uploads.

Every peer is its own process set (Python, hivemind's DHT process and p2pd) in its own namespace,
running the product's code (benchmarks/fanout_peer.py): the version store, the weight server with
its upload slots, the follower's holder choice and busy handling, heartbeats listing held versions.
Three strategies:
- star: every sampler fetches from the learner, which serves them all at once (no upload limit);
- relay: samplers fetch the whole version from other holders first, every holder serves at most
  2 transfers at once (the learner too), a busy holder is passed over;
- chunked: the product's default (swarm/fabric/weights/chunked_fetch.py): the samplers fetching a payload
  (in chunks of 1 MiB for the snapshot, 256 KiB for the delta: chunks.chunk_bytes_for) pass it
  along a chain (a delta's in the order the learner names them, slow links last: swarm/fabric/membership/link_judge.py;
  a snapshot's in the order of their peer ids): the first takes every chunk from whole holders
  (the learner, 2 upload slots), each of the others every chunk from the one before it, which
  passes each chunk on as its bytes arrive (cut-through; the last byte once the chunk verified).
  More than chunked_fetch.CHAIN_MAX samplers would deal the chunks out in stripes instead.

Two payloads: a snapshot of about 100 MB (bfloat16, what a new sampler fetches) and the delta of
one AdamW-sized step on it (what every sampler fetches after each step; it changes half the
weights, so the delta is about a tenth of the snapshot). Nine peers holding it peak at about 12 GB
of this machine's 24 (applying a delta takes about 20-30 bytes of memory per changed weight; it
took 85 before the delta coder's rewrite, when this benchmark had to use 50 MB). Time runs from the
learner's announcement to the last sampler holding the verified version, and to the last holding
all of the payload's bytes (what the strategy decides; applying a delta is CPU work that 8
receivers here do on two shared cores); followers poll every 0.25 s. No delay emulation (no
netem here): links add bandwidth limits, not latency. All peers share this machine's two cores,
which the table's CPU columns report: for the snapshot from its announcement to every sampler
holding it, for a delta while its payload went out (announcement to the last sampler holding all
its bytes, sampled every 0.1 s). Samplers that hold the payload start applying it while others
still receive theirs, on the same two cores.

    python -m benchmarks fanout_wan            # results in benchmarks/results/fanout_wan.{json,md,png}
    GEPO_FANOUT_MB=50 python -m benchmarks fanout_wan   # half the payload
    GEPO_FANOUT_TRANSPORT=grpc GEPO_FANOUT_STRATEGIES=chunked GEPO_FANOUT_RECEIVERS=1,8 python -m benchmarks fanout_wan
    GEPO_FANOUT_MBIT=50 python -m benchmarks fanout_wan   # half the rate: half the CPU per second of transfer
    GEPO_FANOUT_DELTAS=8 GEPO_FANOUT_STRATEGIES=chunked GEPO_FANOUT_RECEIVERS=1,8 python -m benchmarks fanout_wan
    GEPO_FANOUT_MBIT=50 GEPO_FANOUT_DELTAS=8 GEPO_FANOUT_STRATEGIES=chunked,stripes GEPO_FANOUT_RECEIVERS=8 python -m benchmarks fanout_wan
    GEPO_FANOUT_SLOW_MBIT=20 GEPO_FANOUT_DELTAS=4 GEPO_FANOUT_STRATEGIES=chunked,stripes GEPO_FANOUT_RECEIVERS=8 python -m benchmarks fanout_wan
    GEPO_FANOUT_SLOW_UP_MBIT=20 GEPO_FANOUT_DELTAS=6 GEPO_FANOUT_STRATEGIES=chunked GEPO_FANOUT_RECEIVERS=8 python -m benchmarks fanout_wan
    GEPO_FANOUT_SLOW_UP_MBIT=20 GEPO_FANOUT_SLOW_DOWN_MBIT=20 GEPO_FANOUT_DELTAS=6 GEPO_FANOUT_STRATEGIES=chunked GEPO_FANOUT_RECEIVERS=8 python -m benchmarks fanout_wan

GEPO_FANOUT_DELTAS=K publishes K deltas after the snapshot, one after the other (each once the last
reached every sampler), and reports the median over them (the `delta_*_each` columns in the json
have each one): single runs of a delta scatter by about 0.3 s, and K more deltas cost K times about
5 s where K more runs would cost K times 80 s (mostly the snapshot). GEPO_FANOUT_LINKS=1 also reads
every peer's link counters at the bridge every 50 ms and reports how full the links were while
each delta's payload went out (the learner's upload, the samplers' downloads).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from tempfile import TemporaryDirectory

from benchmarks.common import RESULTS, markdown_table, write_result
from benchmarks.wan import Wan, wan_unavailable
from benchmarks.wan_swarm import WanSwarm, records, wait_for

# every peer's link, each way; GEPO_FANOUT_MBIT sets another (results then under fanout_wan[_grpc]_<rate>mbit)
RATE_MBIT = float(os.environ.get("GEPO_FANOUT_MBIT", "100"))
RECEIVERS = (1, 2, 4, 8)
# GEPO_FANOUT_SLOW_MBIT=R: the first sampler's link runs at R Mbit/s each way, the others' at
# RATE_MBIT (unequal volunteers: how much one slow link holds the others up; results then under
# ..._slow<R>mbit, with the fast samplers' figures beside the slow one's)
SLOW_MBIT = float(os.environ.get("GEPO_FANOUT_SLOW_MBIT", "0")) or None
# GEPO_FANOUT_SLOW_UP_MBIT=R: the first sampler uploads at R Mbit/s and downloads at RATE_MBIT (a
# home line: it fetches at full pace but holds up whoever fetches from it; results ..._slowup<R>mbit)
SLOW_UP_MBIT = float(os.environ.get("GEPO_FANOUT_SLOW_UP_MBIT", "0")) or None
# GEPO_FANOUT_SLOW_PLACE=K (with GEPO_FANOUT_SLOW_MBIT or _SLOW_UP_MBIT): the slow link is the sampler's at place K by
# peer id (0 first: its place in a snapshot's chain), not the first one's: every link starts at
# RATE_MBIT and that one is reshaped once the samplers' ids are known (results ..._place<K>)
SLOW_PLACE = int(os.environ["GEPO_FANOUT_SLOW_PLACE"]) if os.environ.get("GEPO_FANOUT_SLOW_PLACE") else None
# GEPO_FANOUT_SLOW_DOWN_MBIT=R (with a slow link above): one more sampler, the next one after the slow
# one in start order, downloads at R Mbit/s (its upload at RATE_MBIT): a slow uplink behind a slow download
SLOW_DOWN_MBIT = float(os.environ.get("GEPO_FANOUT_SLOW_DOWN_MBIT", "0")) or None
# GEPO_FANOUT_SLOW_DOWN_PLACES=K,L (with GEPO_FANOUT_SLOW_DOWN_MBIT, and no other slow link needed): the
# samplers at these places by peer id download at that rate instead (two side by side in a snapshot's chain)
SLOW_DOWN_PLACES = [int(p) for p in os.environ.get("GEPO_FANOUT_SLOW_DOWN_PLACES", "").split(",") if p.strip()]
# GEPO_FANOUT_EQUAL_TOO=1 (with a slow link): each run with the slow link follows one with every link
# at RATE_MBIT, in the same process: the slow link's cost as a ratio to the same hour's equal links
EQUAL_TOO = os.environ.get("GEPO_FANOUT_EQUAL_TOO") == "1"
DELTAS = int(os.environ.get("GEPO_FANOUT_DELTAS", "1"))  # deltas published per run (the median is reported)
# GEPO_FANOUT_LINKS=1: read every peer's link counters every LINK_SAMPLE_S (one `ip` call, about 5 ms
# of CPU) and report how full the links were while each delta went out
LINKS = os.environ.get("GEPO_FANOUT_LINKS") == "1"
LINK_SAMPLE_S = 0.05
CPU_SAMPLE_S = 0.1
PROCESS_SAMPLE_S = 0.1  # every peer's processes' CPU times (about 40 processes: about 1 ms of CPU a read)
PROCESS_KINDS = ("p2pd", "peer", "helper")  # libp2p daemons; peers' main processes; their forked DHT processes
STRATEGIES = {"star": {"slots": 0, "relay": False, "chunked": False}, "relay": {"slots": 2, "relay": True, "chunked": False},
              "chunked": {"slots": 2, "relay": True, "chunked": True},
              # chunked, but the samplers deal the chunks out in stripes however few they are (the plan
              # for more than chunked_fetch.CHAIN_MAX): not run by default, a baseline for the chain
              "stripes": {"slots": 2, "relay": True, "chunked": True, "stripes": True}}
DEFAULT_STRATEGIES = ("star", "relay", "chunked")
PEER = [sys.executable, "-m", "benchmarks.fanout_peer"]


def arrival_times(dirs: list[Path], version: int, announced_at: float, *, payload: bool = False) -> list[float]:
    """Per receiver that has it, seconds from the announcement to holding the verified version (or,
    `payload`: to holding all its payload's bytes, before applying them)."""
    found = []
    for d in dirs:
        times = [e["time"] - (e["seconds"] - e["transfer_s"] if payload else 0.0)
                 for e in records(d) if e.get("event") == "version_fetched" and e["version"] >= version]
        if times:
            found.append(min(times) - announced_at)
    return found


class Counters:
    """Counters read every `every_s` on a thread of its own: `samples` are (time, *read())."""

    def __init__(self, every_s: float, name: str) -> None:
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def read(self) -> tuple:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.samples.append((time.time(), *self.read()))
            except Exception:  # noqa: BLE001  what they count is going away (the Wan is closing)
                return

    def around(self, start: float, end: float) -> tuple[tuple, tuple]:
        """The last sample before `start` and the first after `end` (the window's own first and
        last where there are none)."""
        inside = [s for s in self.samples if start <= s[0] <= end] or self.samples[-1:]
        before = max((s for s in self.samples if s[0] < start), default=inside[0], key=lambda s: s[0])
        after = min((s for s in self.samples if s[0] > end), default=inside[-1], key=lambda s: s[0])
        return before, after

    def spread(self, start: float, end: float) -> tuple[tuple, tuple, float]:
        """(before, after, scale): the samples `around` the window, and what their difference is
        multiplied by to give the window's own share (the samples overhang it by up to one interval
        a side; the rate between them is taken as even)."""
        before, after = self.around(start, end)
        return before, after, (end - start) / max(after[0] - before[0], 1e-9)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class LinkUse(Counters):
    """Every peer's link counters, read every LINK_SAMPLE_S (the kernel's byte counts at the
    bridge, not what the peers say they sent)."""

    def __init__(self, wan: Wan) -> None:
        self.wan = wan
        super().__init__(LINK_SAMPLE_S, "link-use")

    def read(self) -> tuple:
        return (self.wan.public_traffic(),)

    def use(self, start: float, end: float) -> dict[str, tuple[float, float]]:
        """Per host, (upload, download) between `start` and `end` as a share of its link's rate."""
        before, after = self.around(start, end)
        capacity = max(after[0] - before[0], 1e-9) * RATE_MBIT * 1e6 / 8
        return {name: ((after[1][name][0] - counts[0]) / capacity, (after[1][name][1] - counts[1]) / capacity)
                for name, counts in before[1].items() if name in after[1]}


class CpuUse(Counters):
    """How busy this machine's cores were (all peers share them), read every CPU_SAMPLE_S: while a
    payload goes out, a core that is always busy means the figure measures the cores as much as
    the links. Samples are (time, busy seconds, all seconds), summed over the cores."""

    def __init__(self) -> None:
        import psutil

        self._times = psutil.cpu_times
        super().__init__(CPU_SAMPLE_S, "cpu-use")

    def read(self) -> tuple:
        times = self._times()
        return sum(times) - times.idle - getattr(times, "iowait", 0.0), sum(times)

    def percent(self, start: float, end: float) -> float:
        """% of all cores busy between the samples around `start` and `end`."""
        before, after = self.around(start, end)
        return 100 * (after[1] - before[1]) / max(after[2] - before[2], 1e-9)

    def busy_seconds(self, start: float, end: float) -> float:
        """CPU seconds spent from `start` to `end` (all cores, everything: the kernel's share of
        the links too), as ProcessCpu.seconds reckons them."""
        before, after, scale = self.spread(start, end)
        return scale * (after[1] - before[1])


class ProcessCpu(Counters):
    """CPU seconds of the swarm's processes by kind (PROCESS_KINDS), summed over the peers and
    read every PROCESS_SAMPLE_S: what the shared cores were busy with. The processes are found
    once, at the first read (a peer's daemons start with it); one that ends takes its seconds with
    it (none does while a payload goes out)."""

    def __init__(self, roots: list[int]) -> None:
        import psutil

        self._psutil, self._family = psutil, None
        self.roots = list(roots)
        super().__init__(PROCESS_SAMPLE_S, "process-cpu")

    def _find(self) -> list[tuple[str, object]]:
        found = []
        for root in self.roots:
            try:
                top = self._psutil.Process(root)
                family = [top, *top.children(recursive=True)]
            except self._psutil.Error:
                continue
            for proc in family:
                try:
                    found.append(("p2pd" if proc.name() == "p2pd" else "peer" if proc.pid == root else "helper", proc))
                except self._psutil.Error:
                    continue
        return found

    def read(self) -> tuple:
        if self._family is None:
            self._family = self._find()
        seconds = dict.fromkeys(PROCESS_KINDS, 0.0)
        for kind, proc in self._family:
            try:
                times = proc.cpu_times()
            except self._psutil.Error:
                continue
            seconds[kind] += times.user + times.system
        return (seconds,)

    def seconds(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds of each kind from `start` to `end` (Counters.spread)."""
        before, after, scale = self.spread(start, end)
        return {kind: scale * (after[1][kind] - before[1][kind]) for kind in PROCESS_KINDS}


def link_figures(use: dict[str, tuple[float, float]]) -> dict:
    """How full the links were: the learner's upload, the receivers' downloads (mean and least), in %."""
    down = [d for name, (_, d) in use.items() if name.startswith("r")]
    return {"learner_up_percent": 100 * use.get("learner", (0.0, 0.0))[0],
            "down_mean_percent": 100 * sum(down) / max(1, len(down)), "down_least_percent": 100 * min(down, default=0.0)}


def fan_out(strategy: str, receivers: int, megabytes: float, transport: str, root: Path, *, slow: bool = True) -> dict:
    """One run; `slow`: with the slow link, if one is set (else every link at RATE_MBIT)."""
    import psutil

    options = STRATEGIES[strategy]
    slow_mbit = SLOW_MBIT if slow else None
    slow_up_mbit = SLOW_UP_MBIT if slow else None
    with Wan() as wan:
        slowed = slow_mbit or slow_up_mbit or (slow and SLOW_DOWN_PLACES)
        swarm = WanSwarm(wan, root / f"{strategy}-{receivers}-{'slow' if slowed else 'equal'}")
        links = cpu = processes = None
        try:
            boot = swarm.spawn(wan.host("boot"), "bootstrap", ["bootstrap", "--transport", transport, "--run-id", "fanout"])
            addr = swarm.ready(boot)["addresses"][0]
            learner_dir = swarm.root / "learner"
            swarm.spawn(wan.host("learner", rate_mbit=RATE_MBIT), "learner",
                        ["learner", "--transport", transport, "--peers", addr, "--dir", str(learner_dir),
                         "--megabytes", str(megabytes), "--slots", str(options["slots"]), "--deltas", str(DELTAS),
                         *(["--chunked"] if options["chunked"] else [])], program=PEER)
            wait_for(lambda: (learner_dir / "ready.json").exists(), 300, "the learner holding its versions", swarm)
            key = json.loads((learner_dir / "ready.json").read_text())["learner_key"]
            dirs = [swarm.root / f"r{i}" for i in range(receivers)]
            for i, d in enumerate(dirs):
                first = i == 0 and SLOW_PLACE is None
                swarm.spawn(wan.host(f"r{i}", rate_mbit=slow_mbit if slow_mbit and first else RATE_MBIT,
                                     up_mbit=slow_up_mbit if first else None), f"r{i}",
                            ["receiver", "--transport", transport, "--peers", addr, "--dir", str(d), "--key", key,
                             "--slots", str(options["slots"]), *([] if options["relay"] else ["--no-relay"]),
                             *(["--chunked"] if options["chunked"] else []),
                             *(["--stripes"] if options.get("stripes") else [])], program=PEER)
            for d in dirs:
                wait_for(lambda: (d / "ready.json").exists(), 120, f"{d.name} joined", swarm)
            row = {"strategy": strategy, "receivers": receivers, "transport": transport,
                   "links": "slow" if slow_mbit or slow_up_mbit else "equal"}
            ids = [json.loads((d / "ready.json").read_text())["peer_id"] for d in dirs]
            slow_one = 0  # the receiver with the slow link (r0, unless SLOW_PLACE picks it by peer id)
            if SLOW_PLACE is not None and receivers > 1:
                slow_one = ids.index(sorted(ids)[min(SLOW_PLACE, receivers - 1)])
                if slow_mbit:
                    wan.shape(f"r{slow_one}", slow_mbit)
                elif slow_up_mbit:
                    wan.shape(f"r{slow_one}", slow_up_mbit, download=False)
            row["slow_position"] = sorted(ids).index(ids[slow_one])  # its place by peer id (a snapshot's chain order)
            slow_dirs = dirs[slow_one:slow_one + 1]
            slow_down_dirs = []
            if SLOW_DOWN_MBIT and slow and receivers > 2 and (SLOW_DOWN_PLACES or slow_mbit or slow_up_mbit):
                picks = ([ids.index(sorted(ids)[min(p, receivers - 1)]) for p in SLOW_DOWN_PLACES] if SLOW_DOWN_PLACES
                         else [(slow_one + 1) % receivers])
                for slow_down in picks:
                    wan.shape(f"r{slow_down}", SLOW_DOWN_MBIT, upload=False)
                slow_down_dirs = [dirs[i] for i in picks]
                row["slow_down_position"] = [sorted(ids).index(ids[i]) for i in picks]
                if SLOW_DOWN_PLACES:
                    row["links"] = "slow"
            if not (slow_mbit or slow_up_mbit):
                slow_dirs = []
            fast_dirs = [d for d in dirs if d not in slow_dirs + slow_down_dirs]
            links = LinkUse(wan) if LINKS else None
            cpu = CpuUse()
            processes = ProcessCpu([p.popen.pid for p in swarm.procs])
            each = {}  # delta figures, one per delta
            uploaded = 0.0
            for version in range(DELTAS + 1):
                name = "delta" if version else "snapshot"
                psutil.cpu_percent()
                (learner_dir / f"go{version}").touch()
                wait_for(lambda: (learner_dir / f"announced{version}.json").exists(), 60, "the announcement", swarm)
                at = json.loads((learner_dir / f"announced{version}.json").read_text())["time"]
                wait_for(lambda: len(arrival_times(dirs, version, at)) == receivers, 900, f"{name} at every receiver",
                         swarm, poll_s=0.2)
                figures = {"s": max(arrival_times(dirs, version, at)),
                           "payload_s": max(arrival_times(dirs, version, at, payload=True)),
                           "cpu_percent": psutil.cpu_percent()}
                if (SLOW_MBIT or SLOW_UP_MBIT) and receivers > 1:  # the slow sampler apart from the others
                    figures["slow_payload_s"] = arrival_times(slow_dirs, version, at, payload=True)[0]
                    figures["fast_payload_s"] = max(arrival_times(fast_dirs, version, at, payload=True))
                if slow_down_dirs:
                    figures["slow_down_payload_s"] = max(arrival_times(slow_down_dirs, version, at, payload=True))
                    figures["fast_payload_s"] = max(arrival_times(fast_dirs, version, at, payload=True))
                figures["payload_cpu_percent"] = cpu.percent(at, at + figures["payload_s"])
                # what the cores did while the payload went out: CPU seconds, all and by process kind
                figures["payload_cpu_s"] = cpu.busy_seconds(at, at + figures["payload_s"])
                for kind, used in processes.seconds(at, at + figures["payload_s"]).items():
                    figures[f"payload_{kind}_cpu_s"] = used
                fetches = [e for d in dirs for e in records(d) if e.get("event") == "version_fetched" and e["version"] == version]
                figures["mb"] = max(e["bytes"] for e in fetches) / 1e6
                if links is not None:  # while the payload went out: announcement to the last holding it all
                    figures.update(link_figures(links.use(at, at + figures["payload_s"])))
                time.sleep(1.5)  # the learner writes served.json every 50 ms; a chunk may still be on its way
                served = json.loads((learner_dir / "served.json").read_text())["bytes"] / 1e6
                # copies of the payload the learner uploaded: its bytes served over the payload's size
                figures["learner_copies"] = (served - uploaded) / figures["mb"]
                uploaded = served
                if version:
                    for key, value in figures.items():
                        each.setdefault(key, []).append(value)
                else:
                    row.update({f"snapshot_{key}": value for key, value in figures.items()})
        finally:
            if links is not None:
                links.close()
            for counters in (cpu, processes):
                if counters is not None:
                    counters.close()
            swarm.stop_all()
    for key, values in each.items():
        row[f"delta_{key}"] = statistics.median(values)
        if len(values) > 1:
            row[f"delta_{key}_each"] = values
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, ("snapshot", "delta")):
        for strategy, links in dict.fromkeys((r["strategy"], r["links"]) for r in rows):
            mine = [r for r in rows if r["strategy"] == strategy and r["links"] == links]
            strategy = strategy if len({r["links"] for r in rows}) == 1 else f"{strategy}, {links} links"
            line, = ax.plot([r["receivers"] for r in mine], [r[f"{name}_s"] for r in mine], marker="o", label=strategy)
            ax.plot([r["receivers"] for r in mine], [r[f"{name}_payload_s"] for r in mine], linestyle="--",
                    color=line.get_color(), label=f"{strategy}: payload received")
        ones = [r[f"{name}_s"] for r in rows if r["receivers"] == 1]
        if ones:  # (not measured in a run of 8 receivers alone)
            ax.axhline(1.5 * min(ones), color="grey", linestyle=":", label="1.5x one receiver (goal)")
        mb = rows[0][f"{name}_mb"]
        ax.set(title=f"{name} ({mb:.1f} MB), {RATE_MBIT:g} Mbit/s links", xlabel="samplers", ylabel="seconds to the last",
               xticks=list(RECEIVERS))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def busy_note() -> str:
    """The machine's load when the run ended: others' work on the shared cores disturbs the figures."""
    load = os.getloadavg()
    return (f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min) on {os.cpu_count()} cores at "
            f"the end of the run" + ("; the machine was busy with other work" if load[1] > 0.5 * (os.cpu_count() or 1) else ""))


def run() -> dict:
    unavailable = wan_unavailable()
    if unavailable:
        print(f"  skipped: {unavailable}")
        return {}
    megabytes = float(os.environ.get("GEPO_FANOUT_MB", 100))
    transport = os.environ.get("GEPO_FANOUT_TRANSPORT", "hivemind")
    strategies = os.environ.get("GEPO_FANOUT_STRATEGIES", ",".join(DEFAULT_STRATEGIES)).split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise SystemExit(f"GEPO_FANOUT_STRATEGIES: unknown {unknown}; choose from {', '.join(STRATEGIES)}")
    rows = []
    # GEPO_FANOUT_KEEP=DIR: the runs' directories (the peers' logs among them) are kept there
    with (nullcontext(os.environ["GEPO_FANOUT_KEEP"]) if os.environ.get("GEPO_FANOUT_KEEP") else TemporaryDirectory()) as tmp:
        for strategy in strategies:
            for n in [int(x) for x in os.environ.get("GEPO_FANOUT_RECEIVERS", ",".join(map(str, RECEIVERS))).split(",")]:
                for slow in ([False, True] if EQUAL_TOO and (SLOW_MBIT or SLOW_UP_MBIT or SLOW_DOWN_PLACES) else [True]):
                    started = time.time()
                    rows.append(fan_out(strategy, n, megabytes, transport, Path(tmp), slow=slow))
                    r = rows[-1]
                    print(f"  {strategy} x{n} ({r['links']} links): snapshot {r['snapshot_s']:.1f}s "
                          f"(payload {r['snapshot_payload_s']:.1f}s"
                          + (f"; the slow one {r['snapshot_slow_payload_s']:.1f}s, the others {r['snapshot_fast_payload_s']:.1f}s"
                             if "snapshot_slow_payload_s" in r else "")
                          + f"), delta {r['delta_s']:.2f}s (payload {r['delta_payload_s']:.2f}s) "
                          f"(learner copies {r['snapshot_learner_copies']:.1f}/{r['delta_learner_copies']:.1f}; "
                          f"{time.time() - started:.0f}s)", flush=True)
    for r in rows:
        one = next((x for x in rows if x["strategy"] == r["strategy"] and x["receivers"] == 1 and x["links"] == r["links"]), r)
        r["snapshot_vs_one"], r["delta_vs_one"] = r["snapshot_s"] / one["snapshot_s"], r["delta_s"] / one["delta_s"]
        r["snapshot_payload_vs_one"] = r["snapshot_payload_s"] / one["snapshot_payload_s"]
        r["delta_payload_vs_one"] = r["delta_payload_s"] / one["delta_payload_s"]
        # the CPU seconds spread over every core: no swarm of these processes finishes sooner here
        r["delta_cores_bound_s"] = r["delta_payload_cpu_s"] / (os.cpu_count() or 1)
        r["delta_cores_bound_vs_one"] = r["delta_cores_bound_s"] / one["delta_payload_s"]
    name = "fanout_wan" + ("" if transport == "hivemind" else f"_{transport}") + \
        ("" if RATE_MBIT == 100 else f"_{RATE_MBIT:g}mbit") + ("" if DELTAS == 1 else f"_{DELTAS}deltas") + \
        ("" if not SLOW_MBIT else f"_slow{SLOW_MBIT:g}mbit") + ("" if not SLOW_UP_MBIT else f"_slowup{SLOW_UP_MBIT:g}mbit") + \
        ("" if SLOW_PLACE is None else f"_place{SLOW_PLACE}") + ("" if not SLOW_DOWN_MBIT else f"_slowdown{SLOW_DOWN_MBIT:g}mbit") + \
        ("" if not SLOW_DOWN_PLACES else "_at" + "_".join(map(str, SLOW_DOWN_PLACES))) + \
        ("_vs_equal" if EQUAL_TOO else "") + \
        ("" if set(strategies) <= set(DEFAULT_STRATEGIES) else "_" + "_".join(strategies)) + \
        (f"_{os.environ['GEPO_FANOUT_TAG']}" if os.environ.get("GEPO_FANOUT_TAG") else "")  # (a baseline's own file)
    plot(rows, RESULTS / f"{name}.png")
    figures = {"rate_mbit": RATE_MBIT, "slow_mbit": SLOW_MBIT, "slow_place": SLOW_PLACE, "busy_machine": busy_note(), "slow_up_mbit": SLOW_UP_MBIT,
               "slow_down_mbit": SLOW_DOWN_MBIT, "slow_down_places": SLOW_DOWN_PLACES, "megabytes": megabytes,
               "transport": transport,
               "deltas": DELTAS, "links": LINKS,
               "rows": rows}
    md = (f"# Fan-out of one version under {RATE_MBIT:g} Mbit/s links ({transport}, {len(rows)} runs)\n\n"
          f"Seconds from the learner's announcement to the last sampler holding the verified version (payload s: "
          f"to the last holding all the payload's bytes, before applying them); "
          f"learner copies: bytes it uploaded over the payload's size. "
          + ("" if DELTAS == 1 else f"Delta columns: the median of {DELTAS} deltas published one after the other. ")
          + f"Plot: {name}.png.\n\n" + markdown_table(
              ["strategy", "links", "samplers", "snapshot MB", "snapshot s", "x one", "payload s", "x one", "learner copies", "delta MB",
               "delta s", "x one", "payload s", "x one", "learner copies", "CPU % (snapshot)", "CPU % (delta payload)"],
              [[r["strategy"], r["links"], r["receivers"], r["snapshot_mb"], r["snapshot_s"], r["snapshot_vs_one"], r["snapshot_payload_s"],
                r["snapshot_payload_vs_one"],
                r["snapshot_learner_copies"], r["delta_mb"], r["delta_s"], r["delta_vs_one"], r["delta_payload_s"],
                r["delta_payload_vs_one"], r["delta_learner_copies"],
                r["snapshot_cpu_percent"], r["delta_payload_cpu_percent"]] for r in rows]))
    if LINKS:
        md += ("\n\nHow full the links were while the delta's payload went out (announcement to the last sampler "
               "holding it all; kernel byte counters every 50 ms; % of the link's rate; median over the deltas):\n\n"
               + markdown_table(["strategy", "samplers", "learner upload %", "downloads %, mean", "least"],
                                [[r["strategy"], r["receivers"], r["delta_learner_up_percent"], r["delta_down_mean_percent"],
                                  r["delta_down_least_percent"]] for r in rows]))
    md += ("\n\nWhat the shared cores did while the delta's payload went out (CPU seconds, median over the deltas; "
           "all: every process and the kernel's share of the links; the other columns: the swarm's processes by "
           "kind, summed over its peers; cores bound: all over the machine's cores, the least time those seconds "
           "take here, as x one's payload seconds):\n\n" + markdown_table(
               ["strategy", "samplers", "all", "p2pd", "peers", "DHT processes", "cores bound s", "x one"],
               [[r["strategy"], r["receivers"], r["delta_payload_cpu_s"], r["delta_payload_p2pd_cpu_s"],
                 r["delta_payload_peer_cpu_s"], r["delta_payload_helper_cpu_s"], r["delta_cores_bound_s"],
                 r["delta_cores_bound_vs_one"]] for r in rows]))
    if EQUAL_TOO:
        md += ("\n\nThe snapshot with one slow link against every link at the same rate, in the same process (payload "
               "seconds: announcement to the last holding all its bytes; x equal: the others' last over the equal "
               "links' last):\n\n" + markdown_table(
                   ["strategy", "samplers", "equal links s", "slow one s", "the others, last s", "x equal",
                    "its place by peer id", "learner copies (slow)"],
                   [[r["strategy"], r["receivers"], e["snapshot_payload_s"], r["snapshot_slow_payload_s"],
                     r["snapshot_fast_payload_s"], r["snapshot_fast_payload_s"] / e["snapshot_payload_s"], r["slow_position"],
                     r["snapshot_learner_copies"]]
                    for r in rows if "snapshot_slow_payload_s" in r and r["links"] == "slow"
                    for e in [x for x in rows if x["links"] == "equal" and x["strategy"] == r["strategy"]
                              and x["receivers"] == r["receivers"]][:1]]))
    md += f"\n\nMachine: {figures['busy_machine']}\n"
    slowed = [r for r in rows if "delta_slow_payload_s" in r and r["links"] == "slow"]
    if slowed:
        slow_link = (f"link at {SLOW_MBIT:g} Mbit/s" if SLOW_MBIT else
                     f"upload at {SLOW_UP_MBIT:g} Mbit/s (its download at {RATE_MBIT:g})")
        which = "the first one's" if SLOW_PLACE is None else f"the one at place {SLOW_PLACE} by peer id:"
        md += (f"\n\nOne slow sampler: {which} {slow_link}, the others' links at {RATE_MBIT:g} "
               "(delta payload seconds, median over the deltas; its place among the samplers' peer ids, 0 first: its "
               "place in a snapshot's chain; a delta's chain is in the learner's order, slow links last once judged):\n\n"
               + markdown_table(["strategy", "samplers", "slow one s", "the others, last s", "its place by peer id",
                                 "the others, each delta"],
                                [[r["strategy"], r["receivers"], r["delta_slow_payload_s"], r["delta_fast_payload_s"],
                                  r["slow_position"], ", ".join(f"{x:.2f}" for x in r.get("delta_fast_payload_s_each", []))]
                                 for r in slowed]))
    downs = [r for r in slowed if "delta_slow_down_payload_s" in r]
    if downs:
        md += (f"\n\nAnd a slow download: the next sampler downloads at {SLOW_DOWN_MBIT:g} Mbit/s (uploads at "
               f"{RATE_MBIT:g}; the others above are neither slow one). Its delta payload seconds, each delta:\n\n"
               + markdown_table(["strategy", "samplers", "its place by peer id", "slow download, each delta",
                                 "slow upload, each delta"],
                                [[r["strategy"], r["receivers"], r["slow_down_position"],
                                  ", ".join(f"{x:.2f}" for x in r.get("delta_slow_down_payload_s_each", [])),
                                  ", ".join(f"{x:.2f}" for x in r.get("delta_slow_payload_s_each", []))] for r in downs]))
    apart = [r for r in rows if SLOW_DOWN_PLACES and "snapshot_slow_down_payload_s" in r]
    if apart:
        md += (f"\n\nSlow downloads alone: the samplers at places {', '.join(map(str, SLOW_DOWN_PLACES))} by peer id download at "
               f"{SLOW_DOWN_MBIT:g} Mbit/s (their uploads, and every other link, at {RATE_MBIT:g}). Payload seconds, the "
               "last of each kind:\n\n" + markdown_table(
                   ["strategy", "samplers", "their places", "snapshot: slow ones s", "the others s", "learner copies",
                    "delta: slow ones s", "the others s"],
                   [[r["strategy"], r["receivers"], ", ".join(map(str, r["slow_down_position"])),
                     r["snapshot_slow_down_payload_s"], r["snapshot_fast_payload_s"], r["snapshot_learner_copies"],
                     r.get("delta_slow_down_payload_s"), r.get("delta_fast_payload_s")] for r in apart]))
    if DELTAS > 1:
        md += "\n\nEach delta's payload seconds, in the order published:\n\n" + markdown_table(
            ["strategy", "samplers", "payload s, each delta"],
            [[r["strategy"], r["receivers"], ", ".join(f"{x:.2f}" for x in r["delta_payload_s_each"])] for r in rows])
    write_result(name, figures, md)
    return figures
