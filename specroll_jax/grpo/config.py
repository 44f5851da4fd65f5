"""``GRPOConfig``: every GRPO hyperparameter and its default, in one frozen validated dataclass
(docs/design.md, "GRPO"). Hashable, so it is a static jit argument; ``optimizer()`` builds the optax
transform."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import optax

from specroll_jax._fields import check_int
from specroll_jax.sampling import SamplingConfig

AGGREGATIONS = ("token_mean", "seq_mean")
OLD_POLICIES = ("rollout", "trainer")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """GRPO objective, optimiser and batching.

  group_size: G responses per prompt (rows p*G .. p*G+G-1 of a batch are prompt p's group).
  clip_eps_low, clip_eps_high: the ratio is clipped to [1 - low, 1 + high] (asymmetric, as DAPO).
  beta: weight of the k3 KL to the frozen reference policy (0 = off, no reference forward).
  aggregation: "token_mean" (mean over all response tokens of the whole batch) or "seq_mean"
    (mean over sequences of each sequence's token mean).
  adv_eps: advantage = (r - mean_group) / (std_group + adv_eps), std with ddof = 0.
  learning_rate, weight_decay, adam_b1, adam_b2, adam_eps: AdamW (``optax.adamw``).
  warmup_steps: the learning rate ramps linearly over the first n updates (update i, counting
    from 0, uses learning_rate * min(1, (i + 1) / n)); 0 = constant. Adam's first updates are
    about lr * sign(gradient) on every parameter, whatever the gradient's signal-to-noise: a short
    ramp keeps a few noisy GRPO batches from moving a small policy far.
  max_grad_norm: clip the global gradient norm to this (``optax.clip_by_global_norm``; inf = off).
  micro_batches: gradient-accumulation chunks per device and step (a ``lax.scan``).
  old_policy: the ratio's old logprobs. "rollout": the rollout's own (they differ from the
    trainer's by float rounding between forward shapes; the clip bounds what that mismatch can
    do). "trainer": the trainer's, under ``stop_gradient`` (one update per batch, so the ratio is
    exactly 1 and the update is A * grad logp): the update no longer depends on which engine
    rolled out, so a speculative and a vanilla run give bit-identical parameters. The gap to the
    rollout's logprobs is reported either way.
  sampling: how the policy samples; the trainer's logprobs use the same (temperature, top-k,
    top-p), docs/design.md, "No rollout/trainer mismatch".
  """

  group_size: int = 8
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.28
  beta: float = 0.0
  aggregation: str = "token_mean"
  adv_eps: float = 1e-4
  learning_rate: float = 1e-6
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  adam_eps: float = 1e-8
  micro_batches: int = 1
  warmup_steps: int = 0
  old_policy: str = "rollout"
  sampling: SamplingConfig = SamplingConfig()

  def __post_init__(self):
    check_int(self, "group_size", 1)
    check_int(self, "micro_batches", 1)
    check_int(self, "warmup_steps", 0)
    _float(self, "clip_eps_low", 0.0, 1.0, hi_open=True)
    _float(self, "clip_eps_high", 0.0, math.inf)
    _float(self, "beta", 0.0, math.inf)
    _float(self, "adv_eps", 0.0, math.inf)
    _float(self, "learning_rate", 0.0, math.inf)
    _float(self, "weight_decay", 0.0, math.inf)
    _float(self, "max_grad_norm", 0.0, math.inf, lo_open=True, allow_inf=True)
    _float(self, "adam_b1", 0.0, 1.0, hi_open=True)
    _float(self, "adam_b2", 0.0, 1.0, hi_open=True)
    _float(self, "adam_eps", 0.0, math.inf)
    if self.old_policy not in OLD_POLICIES:
      raise ValueError(f"GRPOConfig.old_policy must be one of {OLD_POLICIES}, got "
                       f"{self.old_policy!r}")
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"GRPOConfig.aggregation must be one of {AGGREGATIONS}, got "
                       f"{self.aggregation!r}")
    if not isinstance(self.sampling, SamplingConfig):
      raise ValueError(f"GRPOConfig.sampling must be a SamplingConfig, got "
                       f"{type(self.sampling).__name__}")

  def learning_rate_schedule(self):
    """The learning rate: a float (constant) or, with ``warmup_steps``, an optax schedule."""
    if self.warmup_steps == 0:
      return self.learning_rate
    lr, n = self.learning_rate, float(self.warmup_steps)
    return lambda count: lr * jnp.minimum(1.0, (count + 1) / n)

  def optimizer(self) -> optax.GradientTransformation:
    """``clip_by_global_norm(max_grad_norm)`` then ``adamw``; weight decay on every parameter."""
    return optax.chain(
        optax.clip_by_global_norm(self.max_grad_norm),
        optax.adamw(self.learning_rate_schedule(), b1=self.adam_b1, b2=self.adam_b2,
                    eps=self.adam_eps, weight_decay=self.weight_decay))


def _float(cfg, name: str, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
           allow_inf: bool = False) -> None:
  v = getattr(cfg, name)
  ok = not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))
  if ok:
    v = float(v)
    finite = math.isfinite(v) or (allow_inf and v == math.inf)
    ok = finite and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
  if not ok:
    lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
    raise ValueError(f"GRPOConfig.{name} must be a number in {lb}{lo}, {hi}{rb}, got "
                     f"{getattr(cfg, name)!r}")
  object.__setattr__(cfg, name, v)
