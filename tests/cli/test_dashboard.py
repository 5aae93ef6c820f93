"""The live dashboard (`swarm dashboard`, swarm/dashboard/): its JSON state from hand-made readings
and run directories, the read-only server, and the page in a real headless Chromium (Debian's
`chromium` and `chromium-driver`, driven by Selenium) against a real local swarm with a hostile
peer whose record carries markup."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from benchmarks.waiting import wait_until
from swarm.dashboard import DashboardServer, Poller, Reading, SwarmView
from swarm.dashboard.runs import RunDirs
from swarm.dashboard.state import KEEP_STEPS, MAX_POINTS, MAX_VERSIONS, StepSeries
from swarm.fabric.hivemind.dht import free_port

SWARM = [sys.executable, "-m", "swarm.cli"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")
STATIC = Path(__file__).resolve().parents[2] / "swarm" / "dashboard" / "static"
SCRIPT = "<script>window.__pwned=1</script>"
IMG = '<img src=x onerror="window.__pwned=2">'
SVG = '<svg onload="window.__pwned=3">'


def row(peer_id, role="sampler", version=0, rollouts=0, holds=(), heartbeat_s=0.5, model="embedded", fetch=None):
    """A member's row as `read_swarm` makes it (status_rows plus model and relay)."""
    return {"role": role, "peer_id": peer_id, "version": version, "staleness": None, "rollouts": rollouts,
            "tokens_per_s": 10.0, "last_heartbeat_s": heartbeat_s, "software": "0.1.0", "holds": list(holds),
            "last_fetch": fetch, "model": model, "relay": True}


def view(**kwargs):
    return SwarmView(run_id="r", transport="hivemind", peers=["/ip4/127.0.0.1/tcp/1/p2p/Qm"], poll_s=1.0,
                     announcements_from="test", **kwargs)


def state_of(v: SwarmView) -> dict:
    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    return json.loads(v.document(), parse_constant=no_constants)


def test_peer_strings_are_data_verbatim_and_the_document_is_strict_json():
    v = view()
    fetch = {"version": 1, "source": SVG, "bytes": 10, "seconds": 0.5}
    v.observe(Reading(time=100.0, swarm_time=100.0, announcement={"version": 1, "hash": "ab" * 32, "peer_id": IMG},
                      peers=[row("QmLearner", role="learner", version=1, holds=[0, 1]),
                             row(IMG, model=SCRIPT, fetch=fetch)]))
    v.step_records([{"step": 1, "version": 1.0, "reward_mean": 0.5, "fresh_logprob_gap": float("nan"), "time": 99.0,
                     "dropped": {"too stale": 2}, "staleness_hist": {"0": 1, "1": 0, "2-3": 1}}])
    state = state_of(v)  # NaN in steps.jsonl became null: the document is strict JSON
    hostile = next(p for p in state["peers"] if p["role"] == "sampler")
    assert hostile["peer_id"] == IMG and hostile["model"] == SCRIPT and hostile["last_fetch"]["source"] == SVG
    assert state["announcement"]["peer_id"] == IMG
    series = {s["name"]: s["values"] for s in state["steps"]["series"]}
    assert series["fresh_logprob_gap"] == [None] and series["reward_mean"] == [0.5] and series["dropped/too stale"] == [2.0]
    # the histogram's buckets keep the learner's order (youngest first), not an alphabetical one
    assert [s for s in series if s.startswith("staleness_hist/")] == ["staleness_hist/0", "staleness_hist/1", "staleness_hist/2-3"]


def test_lag_rates_propagation_and_departures_from_readings():
    v = view()
    learner = lambda version, rollouts: row("L", role="learner", version=version, rollouts=rollouts,  # noqa: E731
                                            holds=range(max(0, version - 3), version + 1))
    v.observe(Reading(100.0, 100.0, [learner(5, 10), row("S", version=4, rollouts=0, holds=[3, 4]), row("gone")],
                      {"version": 5, "hash": "0" * 64, "peer_id": "L"}))
    v.observe(Reading(110.0, 110.0, [learner(6, 20), row("S", version=4, rollouts=20, holds=[3, 4, 6])],
                      {"version": 6, "hash": "1" * 64, "peer_id": "L"}))
    v.observe(Reading(112.0, 112.0, [learner(6, 20), row("S", version=6, rollouts=30, holds=[4, 6])],
                      {"version": 6, "hash": "1" * 64, "peer_id": "L"}))
    state = state_of(v)
    sampler = next(p for p in state["peers"] if p["peer_id"] == "S")
    assert sampler["lag"] == 0 and sampler["rollouts_per_s"] == pytest.approx(30 / 12)
    assert [d["peer_id"] for d in state["departed"]] == ["gone"]
    lag = {r["peer_id"]: r["cells"] for r in state["lag"]["rows"]}
    assert [c for c in lag["S"] if c is not None] == [1, 2, 0]  # 5-4 at t=100, 6-4 at t=110, 6-6 at t=112
    prop = state["propagation"]
    # versions held before the dashboard first looked are not timed; a learner is no column (it announces)
    assert prop["peers"] == ["S"] and [r["version"] for r in prop["versions"]] == [6]
    cell = prop["versions"][0]["cells"][0]
    assert cell["held_s"] == pytest.approx(0.0) and cell["used_s"] == pytest.approx(2.0)  # announced at 110
    # a failed reading is shown until the next one succeeds
    v.failed("could not read the swarm: TimeoutError", at=113.0)
    assert state_of(v)["error"].endswith("TimeoutError")
    v.observe(Reading(114.0, 114.0, [learner(6, 20)], None))
    assert state_of(v)["error"] is None


def test_versions_a_record_claims_from_the_future_are_bounded():
    """Records are the peers' own: a peer claiming to be a learner at version 10**12 costs nothing,
    does not move the newest version while a learner's announcement says otherwise, and a sampler
    listing versions far ahead does not push real ones off the page."""
    announced = {"version": 3, "hash": "0" * 64, "peer_id": "L"}
    v = view()
    v.observe(Reading(1.0, 1.0, [row("L", role="learner", version=2), row("S", version=2)], dict(announced, version=2)))
    v.observe(Reading(2.0, 2.0, [row("L", role="learner", version=3), row("S", version=3, holds=[3, 10**9])], announced))
    v.observe(Reading(3.0, 3.0, [row("L", role="learner", version=3), row("X", role="learner", version=10**12),
                                 row("S", version=3, holds=[3, 10**9])], announced))
    state = state_of(v)
    assert state["newest_version"] == 3 and [r["version"] for r in state["propagation"]["versions"]] == [3]
    assert 10**9 not in v.trails and 10**12 not in v.trails  # far ahead: forgotten at once
    started = time.time()  # with no announcement to go by, records are all there is: bounded work
    v.observe(Reading(4.0, 4.0, [row("X", role="learner", version=10**12)], None))
    assert time.time() - started < 1.0 and len(v.trails) <= 4 * MAX_VERSIONS
    many = StepSeries()
    for i in range(KEEP_STEPS + 10):
        many.add({"step": i, "reward_mean": 0.5})
    document = many.document()
    assert document["count"] == KEEP_STEPS + 10 and len(document["step"]) <= MAX_POINTS
    assert document["step"][-1] == KEEP_STEPS + 9 and len(many.step) <= KEEP_STEPS


def test_run_directories_are_read_as_they_grow(tmp_path):
    learner, sampler = tmp_path / "learner", tmp_path / "sampler-0"
    learner.mkdir()
    sampler.mkdir()
    (learner / "ready.json").write_text(json.dumps({"role": "learner", "peer_id": "L"}))
    (sampler / "ready.json").write_text(json.dumps({"role": "sampler", "peer_id": "S"}))
    steps = learner / "steps.jsonl"
    steps.write_text("".join(json.dumps({"step": i, "version": float(i), "reward_mean": i / 10, "time": 100.0 + i}) + "\n"
                             for i in (1, 2)) + '{"step": 3, "rew')  # a line being written
    (sampler / "events.jsonl").write_text(
        json.dumps({"time": 102.5, "event": "version_fetched", "version": 2}) + "\n"
        + json.dumps({"time": 103.0, "event": "version_used", "version": 2}) + "\n"
        + json.dumps({"time": 103.5, "event": "progress", "behind": 1}) + "\n")
    v = view()
    poller = Poller(v, lambda: Reading(200.0, 200.0, [row("S", version=2)], None), run_dirs=RunDirs([tmp_path]),
                    interval_s=3600)  # polls once at start; the test polls by hand after that
    try:
        deadline = time.time() + 10
        while not v.run_dirs and time.time() < deadline:  # set as its first poll ends
            time.sleep(0.05)
        state = state_of(v)
        assert state["steps"]["step"] == [1.0, 2.0]
        with steps.open("a") as f:
            f.write('ard_mean": 0.3, "time": 103.0}\n')
        poller.poll()
        state = state_of(v)
    finally:
        poller.close()
    assert state["steps"]["step"] == [1.0, 2.0, 3.0]
    assert {d["name"]: d["role"] for d in state["run_dirs"]} == {"learner": "learner", "sampler-0": "sampler"}
    v2 = next(r for r in state["propagation"]["versions"] if r["version"] == 2)
    assert v2["announced_at"] == 102.0 and v2["cells"][0]["held_s"] == pytest.approx(0.5)
    assert v2["cells"][0]["used_s"] == pytest.approx(1.0)
    assert next(p for p in state["peers"] if p["peer_id"] == "S")["run_dir"] == "sampler-0"


def get(url, host=None, method="GET"):
    request = urllib.request.Request(url, method=method, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_server_is_read_only_local_and_forbids_inline_scripts():
    v = view()
    v.observe(Reading(1.0, 1.0, [row(SCRIPT)], None))
    server = DashboardServer(v, host="127.0.0.1", port=0)
    try:
        base = server.url
        status, headers, body = get(base)
        assert status == 200 and b'<script src="/static/dashboard.js"' in body
        assert "script-src 'self'" in headers["Content-Security-Policy"] and headers["X-Content-Type-Options"] == "nosniff"
        status, headers, body = get(base + "api/state")
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert json.loads(body)["peers"][0]["peer_id"] == SCRIPT
        assert get(base + "static/dashboard.js")[0] == 200 and get(base + "static/dashboard.css")[0] == 200
        assert get(base + "static/../../state.py")[0] == 404
        assert get(base + "api/state", method="POST")[0] == 501  # nothing can be changed through it
        assert get(base + "api/state", host="attacker.example:80")[0] == 403  # DNS rebinding
        assert get(base + "api/state", host=f"localhost:{server.port}")[0] == 200  # an SSH tunnel's
    finally:
        server.close()


def test_the_page_builds_its_document_from_text_only():
    """Peer strings reach the page only through textContent / createTextNode: no API that parses
    markup appears in the script, and the page has no inline script or handler."""
    script = (STATIC / "dashboard.js").read_text()
    for api in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function", "srcdoc"):
        assert api not in script, api
    page = (STATIC / "index.html").read_text()
    assert page.count("<script") == 1 and '<script src="/static/dashboard.js"' in page
    assert re.search(r"\son[a-z]+\s*=", page) is None  # no inline event handler


@pytest.mark.parametrize("transport", ["hivemind", "grpc"])
def test_read_swarm_counts_only_learners_announcements(transport):
    """`swarm dashboard`'s look at a real swarm (the observer `swarm status` uses): rows with model and
    relay, and the newest announcement under the key given; without a key none (a record's role is
    its writer's word); a sampler announcing a version from the future counts only under its key."""
    from swarm.dashboard import read_swarm
    from swarm.fabric.local import LocalFabrics
    from swarm.fabric.membership.records import Heartbeat
    from swarm.fabric.transports import observe

    with LocalFabrics(transport, "swarm") as fabrics:
        learner, sampler = fabrics.make(), fabrics.make()
        assert learner.heartbeat(Heartbeat(role="learner", model="embedded", version=3, holds=(2, 3)))
        assert sampler.heartbeat(Heartbeat(role="sampler", model=SCRIPT, version=2, relay=True))
        assert learner.announce(3, "ab" * 32) and sampler.announce(99, "cd" * 32)
        observer = observe(transport, run_id="swarm", peers=fabrics.bootstrap.addresses())
        try:
            assert read_swarm(observer, []).announcement is None
            reading = read_swarm(observer, [learner.public_key])
            assert reading.announcement["version"] == 3 and reading.announcement["peer_id"] == learner.peer_id
            assert read_swarm(observer, [sampler.public_key]).announcement["version"] == 99
        finally:
            observer.shutdown()
    rows = {r["role"]: r for r in reading.peers}
    assert rows["sampler"]["model"] == SCRIPT and rows["sampler"]["relay"] is True
    assert rows["learner"]["holds"] == [2, 3] and rows["learner"]["peer_id"] == learner.peer_id


def test_dashboard_fails_fast_when_the_swarm_cannot_be_reached():
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"
    out = subprocess.run([*SWARM, "dashboard", "--peers", dead, "--port", "0"], capture_output=True, text=True, env=ENV,
                         timeout=120)
    assert out.returncode == 1 and "could not join the swarm through" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


# --- the page in a real browser, against a real swarm


def browser_or_skip():
    """Headless Chromium driven through Debian's chromedriver (no browser is downloaded)."""
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("no chromium / chromedriver on PATH: apt-get install chromium chromium-driver (.ci/run does, as root)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: pip install -e '.[dev]'")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,2200"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


class HostilePeer:
    """A peer that heartbeats a record of its own whose peer id, model and fetch source are markup
    (the schema allows any string there: only the owner key is checked)."""

    def __init__(self, addr: str) -> None:
        import threading

        from swarm.fabric.membership.records import Heartbeat, members_key
        from swarm.fabric.transports import join

        self.fabric = join("hivemind", run_id="swarm", peers=[addr], role="sampler")
        beat = Heartbeat(role="sampler", model=SCRIPT, version=0, fetch_version=0, fetch_from=SVG, fetch_bytes=1)
        self.stop = threading.Event()

        def run():
            while not self.stop.is_set():
                now = self.fabric.now()
                self.fabric.dht.store(members_key("swarm", self.fabric.public_key), subkey=self.fabric.public_key,
                                      value=beat.record(IMG, now).dict(), expiration_time=now + 3)
                self.stop.wait(1.0)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def leave(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def close(self) -> None:
        self.leave()
        self.fabric.shutdown()


@pytest.mark.slow
def test_dashboard_in_a_real_browser_against_a_real_swarm(tmp_path):
    """Bootstrap, learner and sampler as processes, a hostile peer in this process, `swarm dashboard`
    as a process, the page in headless Chromium: the peer rows appear, the reward curve gains points
    as the learner steps, the markup in the hostile record is shown as text and runs nothing, and a
    peer that leaves moves to the "left" line."""

    from swarm.runlog import wait_ready

    driver = browser_or_skip()
    procs, hostile = [], None
    log = (tmp_path / "peers.log").open("w")

    def spawn(*args):
        procs.append(subprocess.Popen([*SWARM, *args], stdout=log, stderr=subprocess.STDOUT, env=ENV, text=True))
        return procs[-1]

    def ready(run_dir, proc):
        found = wait_ready(run_dir, timeout_s=120, alive=lambda: proc.poll() is None)
        assert found is not None, (tmp_path / "peers.log").read_text()[-3000:]
        return found

    def js(script):
        return driver.execute_script(script)

    try:
        boot = spawn("bootstrap", "--host", "127.0.0.1", "--port", "0", "--run-dir", str(tmp_path / "boot"))
        addr = ready(tmp_path / "boot", boot)["addresses"][0]
        learner = spawn("learner", "--peers", addr, "--steps", "400", "--groups-per-step", "2", "--heartbeat-s", "1",
                        "--run-dir", str(tmp_path / "learner"), "--identity-dir", str(tmp_path / "ids"))
        ready(tmp_path / "learner", learner)
        spawn("sampler", "--peers", addr, "--learner-key-file", str(tmp_path / "learner" / "learner.key"),
              "--prompts-per-round", "2", "--num-generations", "4", "--heartbeat-s", "1", "--progress-every-s", "2",
              "--identity-dir", str(tmp_path / "ids"), "--run-dir", str(tmp_path / "sampler-0"))
        hostile = HostilePeer(addr)
        port = free_port()
        dashboard = spawn("dashboard", "--peers", addr, "--port", str(port), "--poll-s", "1",
                          "--run-dir", str(tmp_path / "learner"), "--run-dir", str(tmp_path / "sampler-0"))
        url = f"http://127.0.0.1:{port}/"

        def serving():
            assert dashboard.poll() is None, (tmp_path / "peers.log").read_text()[-3000:]
            try:
                return get(url)[0] == 200
            except OSError:
                return False

        wait_until(serving, 120, "the dashboard to serve", every=0.5)
        driver.get(url)

        def peer_rows():
            return js("return [...document.querySelectorAll('#peers tbody tr')].map("
                      "r => [r.dataset.role, ...[...r.cells].map(c => c.textContent)])")

        rows = wait_until(lambda: (lambda r: r if len(r) >= 3 else None)(peer_rows()), 120, "three peer rows", every=0.5)
        assert sorted(r[0] for r in rows) == ["learner", "sampler", "sampler"]
        hostile_row = next(r for r in rows if r[2] == IMG)  # the peer id, as text
        assert hostile_row[3] == SCRIPT  # the model, as text
        assert hostile_row[9].startswith("v0 from \u2026" + SVG[-12:])  # the fetch source, shortened, as text
        # nothing the peer wrote became an element, and nothing ran
        assert js("return document.querySelectorAll('main script, main img, #peers svg').length") == 0
        assert js("return typeof window.__pwned") == "undefined"

        def reward_points():
            return int(js("const c = document.querySelector('svg[data-chart=reward]'); return c ? c.dataset.points : 0"))

        first = wait_until(reward_points, 120, "the reward curve", every=0.5)
        wait_until(lambda: reward_points() >= first + 2, 120, f"the reward curve to grow past {first} points", every=0.5)
        assert int(js("return document.querySelector('svg[data-heatmap=lag]').dataset.rows")) >= 1
        assert js("return document.querySelectorAll('#propagation tbody tr').length") >= 1

        hostile.leave()  # its record expires; the page goes on and lists it as gone
        wait_until(lambda: IMG in js("return document.getElementById('departed').textContent"), 60,
                   "the hostile peer to leave", every=0.5)
        # the two others listed (on a loaded machine a record can lapse for a poll between two beats)
        rows = wait_until(lambda: (lambda r: r if len(r) == 2 else None)(peer_rows()), 30, "the two other peers' rows", every=0.5)
        assert all(IMG not in r for r in rows) and js("return typeof window.__pwned") == "undefined"
        driver.set_window_size(1400, int(js("return document.body.scrollHeight")) + 40)
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 20_000
    finally:
        driver.quit()
        if hostile is not None:
            hostile.close()
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        log.close()


# --- a peer's own dashboard (--dashboard-port)


def state_at(url: str, host: str | None = None) -> dict | None:
    try:
        status, _, body = get(url + "api/state", host=host)
    except OSError:
        return None
    return json.loads(body) if status == 200 else None


@pytest.mark.timeout(400)
def test_peers_serve_the_dashboard_themselves(tmp_path):
    """`--dashboard-port 0` on a bootstrap node, a learner and a sampler (processes): each serves the
    dashboard from its own process on a free loopback port, named in its ready.json; each page lists
    the swarm's peers, shows the peer's own run directory beside its row, the learner's page its
    announcement and the curves of its own steps.jsonl; a page asked for under another host name
    refuses (loopback semantics, as `swarm dashboard`); every peer stops cleanly."""
    from swarm.runlog import read_jsonl, wait_ready

    procs = {}
    log = (tmp_path / "peers.log").open("w")

    def spawn(name, *args):
        procs[name] = subprocess.Popen([*SWARM, *args, "--run-dir", str(tmp_path / name), "--dashboard-port", "0"],
                                       stdout=log, stderr=subprocess.STDOUT, env=ENV)
        found = wait_ready(tmp_path / name, timeout_s=120, alive=lambda: procs[name].poll() is None)
        assert found is not None, (tmp_path / "peers.log").read_text()[-3000:]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", found["dashboard"]), found
        return found

    def page_where(url, condition, what):
        def check():
            state = state_at(url)
            return state if state is not None and condition(state) else None

        return wait_until(check, 120, what, every=0.5)

    def roles(state):
        return {p["peer_id"]: p["role"] for p in state["peers"]}

    try:
        boot = spawn("boot", "bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp_path / "boot.key"))
        addr = boot["addresses"][0]
        learner = spawn("learner", "learner", "--peers", addr, "--steps", "400", "--groups-per-step", "2",
                        "--heartbeat-s", "1", "--checkpoint-every", "0", "--identity-dir", str(tmp_path / "ids"))
        sampler = spawn("sampler", "sampler", "--peers", addr, "--learner-key-file", str(tmp_path / "learner" / "learner.key"),
                        "--prompts-per-round", "2", "--num-generations", "4", "--heartbeat-s", "1",
                        "--identity-dir", str(tmp_path / "ids"))
        both = {learner["peer_id"]: "learner", sampler["peer_id"]: "sampler"}

        state = page_where(boot["dashboard"], lambda s: both.items() <= roles(s).items(), "the bootstrap's page to list both")
        assert state["run_id"] == "swarm" and state["joined_through"] == boot["addresses"][-1:]
        assert [(d["role"], d["peer_id"]) for d in state["run_dirs"]] == [("bootstrap", boot["peer_id"])]

        state = page_where(learner["dashboard"], lambda s: s["steps"] is not None and both.items() <= roles(s).items(),
                           "the learner's page to list both peers and show its first step")
        own = next(p for p in state["peers"] if p["peer_id"] == learner["peer_id"])
        assert own["run_dir"] == "learner"  # its own run directory, matched through its ready.json
        assert state["announcement"]["peer_id"] == learner["peer_id"]
        assert state["announcements_from"] == "this run's learner key"
        steps = read_jsonl(tmp_path / "learner" / "steps.jsonl")
        series = {s["name"]: s["values"] for s in state["steps"]["series"]}
        assert state["steps"]["step"] == [r["step"] for r in steps][:len(state["steps"]["step"])]
        assert series["reward_mean"][0] == pytest.approx(steps[0]["reward_mean"])

        state = page_where(sampler["dashboard"], lambda s: both.items() <= roles(s).items(), "the sampler's page to list both")
        assert next(p for p in state["peers"] if p["peer_id"] == sampler["peer_id"])["run_dir"] == "sampler"
        assert state_at(sampler["dashboard"], host="evil.example") is None  # 403: only requests to localhost
        assert get(sampler["dashboard"] + "api/state", host="evil.example")[0] == 403
    finally:
        for proc in reversed(procs.values()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
                codes[name] = "hung"
        log.close()
    assert codes == {"boot": 0, "learner": 0, "sampler": 0}, (tmp_path / "peers.log").read_text()[-3000:]


def test_dashboard_settings_are_checked_and_a_taken_port_fails_at_start_up(tmp_path):
    import socket

    from click.testing import CliRunner

    from swarm.cli import main
    from swarm.config import BootstrapConfig, LearnerConfig, SamplerConfig

    assert BootstrapConfig().dashboard_port is None  # off unless asked for
    for model in (LearnerConfig, SamplerConfig):
        assert model.model_fields["dashboard_port"].default is None
        assert model.model_fields["dashboard_host"].default == "127.0.0.1"
    result = CliRunner().invoke(main, ["bootstrap", "--dashboard-host", "localhost"])
    assert result.exit_code == 2 and "'localhost' is not an IP address" in result.output, result.output
    result = CliRunner().invoke(main, ["bootstrap", "--dashboard-port", "70000"])
    assert result.exit_code == 2 and "--dashboard-port" in result.output, result.output

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        out = subprocess.run([*SWARM, "bootstrap", "--host", "127.0.0.1", "--port", "0", "--run-dir", str(tmp_path / "boot"),
                              "--identity", str(tmp_path / "boot.key"), "--dashboard-port", str(taken_port)],
                             capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    said = " ".join(out.stderr.split())  # at once, naming the option (it said only "[Errno 98] Address already in use")
    assert f"--dashboard-port {taken_port}: the port is taken on 127.0.0.1" in said and "Traceback" not in said, said[-2000:]
    assert not (tmp_path / "boot" / "ready.json").exists()  # it never said it was up
