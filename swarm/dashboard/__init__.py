"""The live swarm dashboard (`swarm dashboard`): a read-only web page of what the swarm publishes.

- state.py   - class SwarmView: readings of the swarm and run-directory records folded into the
               JSON document the page polls (peer table, curves, lag heat-map, propagation).
- runs.py    - class RunDirs / JsonlTail: run directories on this machine, read as they grow.
- poller.py  - class Poller: the background thread that reads the swarm and the run directories.
- server.py  - class DashboardServer: http.server serving the page and /api/state, read-only.
- live.py    - class LiveDashboard (view, poller and server over a fabric), peer_dashboard (a
               peer's own, with --dashboard-port), read_swarm, and status_rows (the rows
               `swarm status` prints).
- static/    - the page: index.html, dashboard.js (hand-written SVG charts, no library, no CDN),
               dashboard.css. Peer-controlled strings enter the page as text nodes only.

The `swarm dashboard` command (swarm/cli/dashboard.py) joins the swarm as an observer and runs a
`LiveDashboard` over it; a peer started with `--dashboard-port` runs one in its own process (over
its own fabric; a bootstrap node over an observer). Nothing here imports the CLI or the peers.
"""

from swarm.dashboard.live import LiveDashboard, peer_dashboard, read_swarm, status_rows
from swarm.dashboard.poller import Poller
from swarm.dashboard.server import DashboardServer
from swarm.dashboard.state import Reading, SwarmView, announcement_fields

__all__ = ["DashboardServer", "LiveDashboard", "Poller", "Reading", "SwarmView", "announcement_fields", "peer_dashboard",
           "read_swarm", "status_rows"]
