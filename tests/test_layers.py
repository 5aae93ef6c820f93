"""The structure the layers rest on: the import contracts hold (import-linter, as CI runs it), no
circle among modules, no module imports another module's private names, and `--help` is grouped,
with choices and the TRL-style names and their aliases."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("swarm", "peers", "bootstrap")


def test_import_contracts_hold():
    out = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "4 kept, 0 broken" in out.stdout


def test_no_contract_layer_lets_its_modules_import_each_other():
    """A `:` layer lets its modules import each other, so a circle among them would pass unseen."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert [layer for c in contracts for layer in c.get("layers", []) if ":" in layer] == []


def test_pyflakes_finds_nothing():
    """Unused imports, undefined names and the like (ruff's F rules, as pyproject.toml selects)."""
    out = subprocess.run([str(Path(sys.executable).with_name("ruff")), "check", "--no-cache", *PACKAGES, "tests", "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]


def test_no_module_imports_private_names_of_another():
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                    found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_no_import_circle():
    """No circle among the project's modules (benchmarks/import_graph.py: every import counted, those
    inside functions and under TYPE_CHECKING too): each module can be read, and moved, on its own."""
    from benchmarks.import_graph import circles, graph, module_graph, read_project

    project = read_project()
    assert circles(module_graph(project)) == []
    for package in ("swarm", "swarm.fabric"):  # nor among the library's parts, nor the fabric's rooms
        assert circles(graph(project, package)) == [], package


# Where the project's own modules may still be imported inside a function: the CLI's commands load
# what pulls in torch only when they run (`swarm --help` stays fast), and transports.py is the one
# place a transport is imported, when it is chosen.
LAZY_IMPORTERS = ("swarm.cli", "swarm.fabric.transports")


def test_the_project_imports_its_own_modules_at_the_top_of_each_file():
    from benchmarks.import_graph import read_project

    inside = [f"{i.source}:{i.line} imports {i.target}" for i in read_project().imports
              if i.in_function and not i.source.startswith(LAZY_IMPORTERS)]
    assert inside == []


def swarm_help(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "swarm.cli", *args, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_learner_help_is_grouped_with_choices_and_trl_names():
    text = swarm_help("learner")
    sections = [line for line in text.splitlines() if line.endswith("options:")]
    assert sections == ["Swarm options:", "Task options:", "Loss options:", "Optimizer options:", "Lora options:", "Training options:", "Generation options:", "Device options:",
                        "Evaluation options:", "Output options:", "Other options:"]
    assert "--loss [gepo|grpo|dr_grpo|bnpo|gspo|gmpo|topr|cispo|m2po|decoupled_ppo|tis_mis|opsm]" in text
    assert "--transport [hivemind|grpc]" in text
    for option in ("--learning-rate, --lr", "--beta, --kl-coef", "--epsilon, --eps-low", "--max-grad-norm", "--seed"):
        assert option in text, option
    assert "[default: 0.0001]" in text  # defaults shown one way, the config's own


def test_the_same_setting_is_spelled_the_same_in_every_command():
    learner, sampler, demo = swarm_help("learner"), swarm_help("sampler"), swarm_help("demo")
    for option in ("--learning-rate", "--groups-per-step", "--loss", "--beta", "--steps", "--run-dir", "--seed"):
        assert option in learner and option in demo, option
    for option in ("--num-generations", "--pickup-delay", "--transport"):
        assert option in sampler and option in demo, option
    for option in ("--max-completion-length", "--temperature", "--top-k", "--top-p"):  # the run's: the learner announces them
        assert option in learner and option in demo and option not in sampler, option


# Code names are British (normalise, authorise, behaviour); the words of the libraries we build on
# keep their own spelling (transformers' tokenizer, torch's optimizer, gRPC's serializer).
LIBRARY_WORDS = ("tokeniz", "optimiz", "serializ", "deserializ", "utiliz")


def test_code_names_have_one_spelling():
    import re

    american = re.compile(r"[a-z]{2,}(?<!s)iz(?:e|ed|es|ing|ation|er)s?$|behavior|^color")  # normalize, not size
    found = []
    for package in (*PACKAGES, "tests", "benchmarks"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else []
                names += [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
                names += [a.arg for a in node.args.args + node.args.kwonlyargs] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
                for name in names:
                    words = [w for w in name.lower().split("_") if american.search(w) and not w.startswith(LIBRARY_WORDS)]
                    found += [f"{path.relative_to(ROOT)}: {name}" for _ in words[:1]]
    assert found == []
