"""Where a learner encodes its versions by default: a process of its own on a GPU, its thread on a CPU."""

import torch

from peers.learner_setup import publish_isolation
from swarm.config import LearnerConfig


def test_auto_encodes_in_a_process_for_a_gpu_learner_and_in_the_thread_for_a_cpu_learner():
    assert LearnerConfig.model_fields["publish_isolation"].default == "auto"
    assert publish_isolation("auto", torch.device("cuda", 0)) == "process"
    assert publish_isolation("auto", torch.device("cpu")) == "thread"
    assert publish_isolation("process", torch.device("cpu")) == "process"
    assert publish_isolation("thread", "cuda") == "thread"
