"""Policy models and engines (docs/design.md §6).

- ``tokenizer.py`` / ``tiny.py``: the tiny random-init Qwen2 model and its tokenizer (a byte-level BPE
  with one token per word it saw)
- ``models.py``: loading any local HF causal-LM directory (safetensors only), calling it with a KV cache
- ``choice.py``: ``choose``-mode scoring with KV-cache reuse (the convention the update stage mirrors)
- ``sampling.py``: seeds (SeedSequence) and the choice sampler
- ``engine.py``: the engine interface; ``hf_engine.py`` (transformers) and ``vllm_engine.py`` (vLLM)
- ``live_engine.py``: building an engine by kind, and the run's engine from the config (kept, reloaded,
  released for the update)
- ``quiet.py``: no progress bars from transformers
"""
