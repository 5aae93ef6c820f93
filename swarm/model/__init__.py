"""The policy model: the embedded tiny default and loading of any causal LM.

- tokenizer.py  - the embedded character-level tokenizer.
- embedded.py   - the tiny Qwen3 policy: architecture, deterministic warm start, on-disk cache
                  (under swarm.paths.models_cache()).
- paths.py      - `check_local_model`: a local --model that does not exist, named without torch.
- loading.py    - `load_policy(name_or_dir)`: embedded default, a local directory, or a hub id (the hub
                  checks are swarm/hub.py's).
"""
