"""tunix's ``RolloutConfig`` read as our settings: the sampling rule and the seed, with ValueErrors
naming the field outside our limits. Public names are re-exported by
``specroll_jax.integrations.tunix``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl.rollout import base_rollout

from specroll_jax.sampling import SamplingConfig

__all__ = ["sampling_from_rollout_config"]


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _number(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool,
                                                                                       np.bool_))


def sampling_from_rollout_config(rc: base_rollout.RolloutConfig) -> SamplingConfig:
  """``SamplingConfig`` of tunix's ``RolloutConfig``, read as tunix's sampler reads it: greedy when
  ``top_p`` is None or ``temperature`` is 0; ``top_k`` None, 0 or -1 is off. ValueError naming the
  field, its value and the limit."""
  t, p, k = rc.temperature, rc.top_p, rc.top_k
  if not _number(t) or not math.isfinite(float(t)) or float(t) < 0:
    raise ValueError(f"RolloutConfig.temperature={t!r} is outside our limits: a finite number >= 0")
  if p is not None and (not _number(p) or not 0.0 < float(p) <= 1.0):
    raise ValueError(f"RolloutConfig.top_p={p!r} is outside our limits: None (greedy) or in (0, 1]")
  if k is not None and (not _is_int(k) or int(k) < -1):
    raise ValueError(f"RolloutConfig.top_k={k!r} is outside our limits: None, -1 or 0 (off), or an "
                     "int >= 1")
  if p is None or float(t) == 0.0:
    return SamplingConfig(temperature=0.0)
  return SamplingConfig(temperature=float(t), top_k=max(int(k or 0), 0), top_p=float(p))


def _seed(value, default: int) -> int:
  """A uint32 seed from ``RolloutConfig.seed``: None (the engine's), an int, an integer array
  scalar, or a jax PRNG key (``PRNGKey(s)`` for s < 2**32 gives s)."""
  if value is None:
    return default
  if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  arr = np.asarray(value)
  if arr.shape == () and np.issubdtype(arr.dtype, np.integer):
    s = int(arr)
  elif arr.shape == (2,) and arr.dtype == np.uint32:  # a raw threefry key [hi, lo]
    s = ((int(arr[0]) * 0x9E3779B1) ^ int(arr[1])) & 0xFFFFFFFF
  else:
    raise ValueError(f"RolloutConfig.seed={value!r} is outside our limits: None, an int in "
                     "[0, 2**32) or a jax PRNG key")
  if not 0 <= s < 2**32:
    raise ValueError(f"RolloutConfig.seed={s} is outside our limits: [0, 2**32)")
  return s
