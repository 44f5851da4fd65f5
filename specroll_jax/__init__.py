"""specroll-jax: exact speculative GRPO rollouts in JAX (SpecRoll).

Dimension legend (used in shape suffixes, field comments and jaxtyping annotations):
  B batch rows, G group size (responses per prompt), T time / new tokens in one decoder step,
  M response width (max new tokens), P prompt width, E EOS ids, N tree nodes (besides the root),
  N1 = N + 1 (with the root), D1 = max depth + 1 (path slots), K future-token heads, V vocab,
  D model width, Dff an MLP's inner width, H query heads, Hkv kv heads, Dh head width,
  L cache length, Ly decoder layers, R rows of a flattened batch (or of a bucket), F target
  forwards of a rollout.
Any other letter is local to one module and declared in its docstring or beside the field (for
example C records and S support ids in ``records`` / ``slow_path``).
"""

__version__ = "0.1.0"
__all__ = ["SpecRoll", "SpecRollState"]


def __getattr__(name):
  # ``specroll_jax.SpecRoll``: the one object (imported on first use, so ``import specroll_jax``
  # stays light)
  if name in ("SpecRoll", "SpecRollState"):
    from specroll_jax import specroll
    return getattr(specroll, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
