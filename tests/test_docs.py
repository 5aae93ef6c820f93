"""The README and the docs site (issue 47): the README stays a short first hour that starts with the
two commands and whose relative links resolve; the site builds with `mkdocs build --strict` (a broken
link, anchor or nav entry fails); the command reference matches the code's options."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 200
TWO_COMMANDS = """```bash
bash dev.sh demo    # first use: sets up .venv (CPU torch), then runs the main job on the embedded default
bash dev.sh test    # first use: sets up .venv, then runs the test suite
```"""


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move detail to docs/"
    first_block = text[text.index("```"):]
    assert first_block.startswith(TWO_COMMANDS), "README.md must open with the `bash dev.sh demo` / `bash dev.sh test` block"
    assert text[:text.index("```")].strip() == "# GEPO Swarm", "nothing but the title may come before the two commands"


def test_every_relative_link_of_the_readme_resolves():
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'(?:src|href)="([^"]+)"', text)
    relative = [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    assert relative, "the README links to no file of the repository: the check would pass vacuously"
    missing = [t for t in relative if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_command_reference_matches_the_options():
    from swarm.cli.reference import REGENERATE, differing

    stale = differing()
    assert not stale, f"docs/reference/ is out of date ({', '.join(stale)}): run `{REGENERATE}` and commit the pages"


def test_docs_site_builds_strictly(tmp_path):
    import importlib.util

    for module in ("mkdocs", "material"):
        assert importlib.util.find_spec(module), f"{module} is missing: pip install -e '.[dev]' (mkdocs, mkdocs-material)"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, not a warning of ours
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    for page in ("index.html", "benchmarks/index.html", "security/index.html", "reference/learner/index.html"):
        assert page in pages, f"{page} missing from the built site: {sorted(pages)[:20]}"
    assert (tmp_path / "site" / "results" / "fanout_wan.png").is_file(), "the benchmark figures did not reach the site"
