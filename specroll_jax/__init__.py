"""specroll-jax: exact speculative GRPO rollouts in JAX (SpecRoll).

Dimension legend (used in shape suffixes, field comments and jaxtyping annotations):
  B batch rows, G group size (responses per prompt), T time / new tokens, N tree nodes (besides the
  root), K future-token heads, V vocab, D model width, H query heads, Hkv kv heads, Dh head width,
  L cache length, Ly decoder layers, R rows of a flattened batch.
"""

__version__ = "0.1.0"
