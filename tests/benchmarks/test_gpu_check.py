"""The GPU check (benchmarks/gpu_check.py) at its tiny size on CPU: every section runs the code the
GPU run does, each in its own process, so that only the CUDA-only calls are new on a GPU."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"demo", "sampler", "learner", "delta", "verification_gap", "publish", "vllm_sampler"}


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def failed_sections(ended: str, stdout: str, stderr: str, results: Path) -> str:
    """Which sections failed and why, then the ends of the output, as lines: an assertion's message in a
    tuple was cut to one line in CI's log, which hid the failing section."""
    path = results / "gpu_check_small.json"
    sections = json.loads(path.read_text())["sections"] if path.exists() else {}
    errors = [f"{name}: {r['error'][-2000:]}" for name, r in sections.items() if "error" in r] or [f"no results in {path}"]
    return "\n".join([f"gpu_check {ended}", *errors, "--- stdout ends:", stdout[-3000:], "--- stderr ends:", stderr[-3000:]])


def text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


@pytest.mark.slow
def test_small_gpu_check_runs_every_section_on_cpu(tmp_path):
    # the check ends itself by its total_s (330 s), each section killed past its budget; the timeout here is for a hang
    try:
        out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--small", "--device", "cpu", "--out", str(tmp_path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(failed_sections("ran past 400 s", text(hung.stdout), text(hung.stderr), tmp_path), pytrace=False)
    if out.returncode != 0:
        pytest.fail(failed_sections(f"exited with {out.returncode}", out.stdout, out.stderr, tmp_path), pytrace=False)
    result = json.loads((tmp_path / "gpu_check_small.json").read_text())
    sections = result["sections"]
    assert set(sections) == SECTIONS
    assert not [name for name, r in sections.items() if "error" in r], sections
    assert result["size"] == "small" and result["device"] == "cpu"

    demo = sections["demo"]
    assert demo["returncode"] == 0 and demo["learner_steps"] == 2 and 0 <= demo["after"]["pass_at_1"] <= 1

    sampler = sections["sampler"]
    assert positive(sampler["tokens_per_s"]) and positive(sampler["sample_s"]) and positive(sampler["completion_tokens"]) and positive(sampler["weights_bytes"])
    assert sampler["static_kv_cache"] is False  # CUDA only
    assert sampler["peak_bytes_above_weights"] is None or sampler["peak_bytes_above_weights"] >= 0

    learner = sections["learner"]
    configs = {(c["micro_batch_groups"], c["gradient_checkpointing"]): c for c in learner["configs"]}
    assert set(configs) == {(m, ckpt) for m in (1, 2, 4) for ckpt in (False, True)}
    for config in configs.values():
        assert positive(config["tokens_per_s"]) and positive(config["step_s"]), config
        assert config["model_flops_share"] is None and config["hardware_flops_share"] is None  # no GPU: no peak to share
    assert learner["peak_tflops"] is None and learner["gpu"] is None
    ran = [v for v in learner["variants"] if "tokens_per_s" in v]  # the eager ones; compiling is left to a GPU
    assert [v["variant"] for v in ran] == ["eager", "fused_adamw"] and [v["fused_adamw"] for v in ran] == [False, True]
    assert all("compiling is judged on a GPU" in v["skipped"] for v in learner["variants"] if v not in ran)
    for v in ran:  # where the step's time went: phases by LearnerCore's marks, and a profiled step
        b = v["breakdown"]
        assert positive(b["step_s"]) and {"forward", "loss", "backward", "optimizer"} <= set(b["phases_s"]), b
        assert positive(b["profile"]["aten_calls"]) and b["profile"]["top"], b
        assert {"learner/forward", "learner/backward", "logprobs/head_forward", "logprobs/head_backward"} <= set(b["profile"]["ranges"])
        assert b["profile"]["casts"] >= 0 and b["profile"]["item_reads"] >= 1  # float(grad_norm) at least

    delta = sections["delta"]
    for key in ("delta_bytes", "snapshot_bytes", "encode_s", "apply_verify_s", "state_hash_s", "changed_fraction"):
        assert positive(delta[key]), key
    assert delta["delta_bytes"] < delta["snapshot_bytes"]

    for dtype, gap in sections["verification_gap"]["by_sampler_dtype"].items():
        assert gap["completions"] == 6 and positive(gap["tokens"]), dtype
        assert all(math.isfinite(gap[k]) and gap[k] >= 0 for k in ("gap_max", "gap_p999", "gap_p50", "token_gap_max")), gap
        assert gap["gap_p50"] <= gap["gap_p999"] <= gap["gap_max"] <= gap["token_gap_max"]
    assert set(sections["verification_gap"]["by_sampler_dtype"]) == {"bfloat16", "float16"}

    publish = sections["publish"]
    assert set(publish["median_step_s"]) == {"off", "thread", "process"} and all(map(positive, publish["median_step_s"].values()))
    assert positive(publish["thread_over_off"]) and positive(publish["process_over_off"])
    for mode in ("thread", "process"):  # the first version, and at least one a block (the last is waited for)
        assert publish["published"][mode] >= 1 and positive(publish["first_version_s"][mode]), mode
        assert positive(publish["snapshot_and_submit_s_median"][mode]), mode

    vllm = sections["vllm_sampler"]
    assert "CUDA" in vllm["skipped"]  # the model directory it would serve is still built and loaded back
    assert positive(vllm["model_dir_checked"]["bytes"]) and vllm["model_dir_checked"]["tokenizer_size"] == 512

    markdown = (tmp_path / "gpu_check_small.md").read_text()
    assert "| learner | ok |" in markdown and "| vllm_sampler | skipped |" in markdown
    assert "| section | status | seconds | figures |" in out.stdout  # the summary printed


def test_unknown_section_is_refused():
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--small", "--sections", "sampler,warp"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown section(s) warp" in out.stderr


@pytest.mark.slow
def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (where --device cuda fails)")
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--small", "--device", "cuda", "--sections",
                          "sampler,delta", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1  # a section failed
    sections = json.loads((tmp_path / "gpu_check_small.json").read_text())["sections"]
    assert set(sections) == {"sampler", "delta"}
    assert all("error" in r and "Traceback" in r["traceback"] for r in sections.values()), sections
    assert "| sampler | error |" in out.stdout and "| delta | error |" in out.stdout
