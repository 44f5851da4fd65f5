"""``GRPOConfig``: every GRPO hyperparameter and its default, in one frozen validated dataclass
(docs/design.md, "GRPO"). Hashable, so it is a static jit argument; ``optimizer()`` builds the optax
transform."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax

from specroll_jax._fields import check_float, check_int, check_type
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
    for name in ("clip_eps_high", "beta", "adv_eps", "learning_rate", "weight_decay", "adam_eps"):
      check_float(self, name, 0.0)
    for name in ("clip_eps_low", "adam_b1", "adam_b2"):
      check_float(self, name, 0.0, 1.0, hi_open=True)
    check_float(self, "max_grad_norm", 0.0, lo_open=True, allow_inf=True)  # inf: no clipping
    if self.old_policy not in OLD_POLICIES:
      raise ValueError(f"GRPOConfig.old_policy must be one of {OLD_POLICIES}, got "
                       f"{self.old_policy!r}")
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"GRPOConfig.aggregation must be one of {AGGREGATIONS}, got "
                       f"{self.aggregation!r}")
    check_type(self, "sampling", SamplingConfig)

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
