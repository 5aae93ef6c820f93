"""The swarm's peers.

- generation/ (package) - generation backends behind one interface: transformers (CPU/GPU) and
                          vLLM (GPU, optional extra, imported only when chosen).
"""
