"""Progress of long steps (swarm.progress): plain, rate-limited lines with counts where output is not
a terminal, a rich bar where it is; and the steps that report it (evaluation, checkpoint writes,
a chunked version download) do."""

import io


from swarm.progress import LineProgress, RichProgress, amount, progress_for


class Clock:
    """Time as the test sets it; with `tick`, it moves on that much at every reading."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_are_rate_limited_carry_counts_and_end_with_done():
    clock, lines = Clock(), []
    progress = LineProgress(lines.append, every_s=5.0, clock=clock)
    with progress.task("eval", total=200, unit="problems") as task:
        for _ in range(20):  # 10 problems a second
            clock.now += 1.0
            task.advance(10)
    assert lines == ["eval: 50/200 problems, 5 s", "eval: 100/200 problems, 10 s", "eval: 150/200 problems, 15 s",
                     "eval: 200/200 problems, done in 20 s"]


def test_a_step_shorter_than_the_interval_or_its_delay_prints_nothing():
    clock, lines = Clock(), []
    progress = LineProgress(lines.append, every_s=5.0, clock=clock)
    with progress.task("eval", total=10, unit="problems") as task:
        clock.now = 4.0
        task.advance(10)
    with progress.task("fetching version 3", None, unit="bytes", delay_s=30.0) as task:
        clock.now += 20.0
        task.advance(5_000_000)
    assert lines == []
    with progress.task("fetching version 4", None, unit="bytes", delay_s=30.0) as task:
        clock.now += 31.0
        task.advance(12_500_000)
    assert lines == ["fetching version 4: 12.5 MB, 31 s", "fetching version 4: 12.5 MB, done in 31 s"]


def test_amounts():
    assert amount(120, 200, "problems") == "120/200 problems"
    assert amount(40e6, 120e6, "bytes") == "40.0/120.0 MB"
    assert amount(7, None, "runs") == "7 runs"


def test_a_terminal_gets_a_rich_bar_and_a_pipe_plain_lines():
    assert isinstance(progress_for(Terminal()), RichProgress) and progress_for(Terminal()).terminal
    piped = io.StringIO()
    progress = progress_for(piped)
    assert isinstance(progress, LineProgress) and not progress.terminal
    progress.echo("a line")
    assert piped.getvalue() == "a line\n"


def test_the_rich_bar_draws_on_a_terminal_and_lines_print_above_it():
    from rich.console import Console

    out = Terminal()
    progress = RichProgress(Console(file=out, force_terminal=True, width=100))
    with progress.task("eval, greedy", total=4, unit="problems") as task:
        task.advance(4)
        progress.echo("printed above the bar")
        assert progress.bar.live.is_started
    assert not progress.bar.live.is_started and not progress.bar.tasks  # gone once the last task ends
    text = out.getvalue()
    assert "\x1b[" in text and "━" in text and "eval, greedy" in text and "printed above the bar" in text


def test_evaluation_reports_problems_done():
    from swarm.evaluation import evaluate_policy
    from swarm.generation.transformers_backend import TransformersBackend
    from swarm.model.loading import load_policy
    from swarm.rewards import RewardScorer
    from swarm.tasks import load_problems

    model, tokenizer = load_policy(None)
    problems = load_problems("arithmetic", {}, tokenizer=tokenizer, split="test")[:6]
    clock, lines = Clock(), []
    progress = LineProgress(lines.append, every_s=0.0, clock=clock)
    scorer = RewardScorer([("accuracy", 1.0)])
    try:
        evaluate_policy(TransformersBackend(model, tokenizer), scorer, problems, samples=2, temperature=1.0,
                        max_completion_length=4, seed=0, progress=progress, label="eval at step 3")
    finally:
        scorer.close()
    # (every_s 0: a line at every change, the start included)
    assert lines == ["eval at step 3, 2 samples per problem: 0/6 problems, 0 s",
                     "eval at step 3, 2 samples per problem: 6/6 problems, done in 0 s",
                     "eval at step 3, greedy: 0/6 problems, 0 s", "eval at step 3, greedy: 6/6 problems, done in 0 s"]


def test_a_checkpoint_reports_the_bytes_it_wrote(tmp_path):
    import torch

    from swarm.checkpoint import save_checkpoint
    from swarm.model.loading import load_policy

    model, tokenizer = load_policy(None)
    optimizer = torch.optim.AdamW(model.parameters())
    clock, lines = Clock(tick=5.0), []  # a slow disk: 5 s between readings, past the checkpoint's delay at once
    progress = LineProgress(lines.append, every_s=0.0, clock=clock)
    path = save_checkpoint(tmp_path, model, tokenizer, optimizer, version=3, digest="0" * 64, config={}, progress=progress)
    written = sum(p.stat().st_size for p in path.iterdir())
    assert written > 1e6
    assert lines[-1].startswith(f"checkpoint of version 3: {written / 1e6:.1f}/{written / 1e6:.1f} MB, done in ")
    assert lines[-1].endswith(" s (flushing to disk)")
    assert [line for line in lines if line.endswith("(weights written)")]
    # quick on a quick disk: nothing said
    quiet = []
    save_checkpoint(tmp_path, model, tokenizer, optimizer, version=4, digest="0" * 64, config={},
                    progress=LineProgress(quiet.append, every_s=0.0))
    assert quiet == []


def test_a_chunked_download_reports_every_verified_chunk():
    import random

    from swarm.fabric.weights.chunked_fetch import ChunkedFetch, ChunkSources
    from swarm.fabric.weights.chunks import MIN_CHUNK_BYTES, ChunkBook, spec_of

    data = random.Random(0).randbytes(5 * MIN_CHUNK_BYTES + 7)
    spec, manifest = spec_of("snapshot", 3, data, MIN_CHUNK_BYTES)

    class Holder:  # holds the whole payload
        def piece(self, holder, spec, index, wait_s=0.0, **flags):
            if index is None:
                return manifest
            start, end = spec.bounds(index)
            return data[start:end]

    heard = []
    fetch = ChunkedFetch(Holder(), ChunkBook(lambda kind, version: None, MIN_CHUNK_BYTES), spec,
                         ChunkSources(["127.0.0.1:8000"], ["me"]), "me",  # a holder id a record could name (dialable_peer_id)
                         unreachable=(ConnectionError,),
                         on_corrupt=lambda peer, exc: None, on_chunk=heard.append)
    assert bytes(fetch.run().buffer) == data
    assert len(heard) == spec.count == 6 and sum(heard) == len(data)


def test_a_whole_version_download_reports_its_bytes_as_they_arrive(make_fabric):
    """Over both transports: the weight client hears every piece of a whole snapshot (1 MiB pieces
    over hivemind, the gRPC stream's messages), adding up to what the fetch reports."""
    import torch

    from swarm.fabric.weights.versions import VersionStore

    torch.manual_seed(0)
    state = {"w": torch.randn(3072, 1536).to(torch.bfloat16)}  # 9 MiB: several pieces over either transport
    holder, receiver = make_fabric(), make_fabric()
    store = VersionStore()
    store.add(0, state)
    server = holder.weight_server(store)
    client = receiver.weight_client(timeout_s=60)
    try:
        heard = []
        client.on_received = heard.append
        result = client.fetch(holder.peer_id, 0, store.hashes[0], VersionStore())
        assert len(heard) >= 3 and sum(heard) == result.bytes > 9 * 2**20
        heard.clear()
        client.on_received = None  # not following: nothing heard
        client.fetch(holder.peer_id, 0, store.hashes[0], VersionStore())
        assert heard == []
    finally:
        client.close()
        server.close()
