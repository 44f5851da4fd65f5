"""The GRPO objective (docs/design.md, "GRPO"): group-relative advantages, the clipped
importance-ratio objective with the rollout's logprobs as the old policy, the k3 KL to a frozen
reference, and the per-batch sums (``Sums``) from which a data-parallel step forms global means.

A step never averages per-device means: every quantity is a sum (numerators, token and sequence
counts) that is ``psum``-ed over the data axis and divided once (``metrics``), so the loss and its
gradient are the same on 1 and on N devices.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specroll_jax.grpo.config import GRPOConfig
from specroll_jax.sampling import MASKED_LOGIT

KL_LOG_RATIO_CLAMP = 20.0  # |log(ref / pi)| is clamped here inside k3 (no exp overflow)
KL_CLAMP = 10.0  # and k3 itself to [0, 10] (as verl's low_var_kl)
OUTSIDE_SUPPORT_LOGP = MASKED_LOGIT / 10  # ``sampling.allowed_logits`` masks with MASKED_LOGIT: a
#   logprob below this is a token outside the trainer's top-k / top-p set (probability 0 under
#   the sampling rule)


def group_advantages(rewards: Float[Array, " B"], group_size: int, eps: float
                     ) -> Float[Array, " B"]:
  """(r - mean_group) / (std_group + eps) for prompt-major groups (rows p*G .. p*G+G-1).

  std with ddof = 0. A group whose rewards are all equal gets exactly 0 (not a rounding residue).
  """
  b = rewards.shape[0]
  if b % group_size:
    raise ValueError(f"rewards has {b} rows, not a multiple of group_size {group_size}")
  r = rewards.astype(jnp.float32).reshape(b // group_size, group_size)
  mean = jnp.mean(r, axis=1, keepdims=True)
  std = jnp.sqrt(jnp.mean(jnp.square(r - mean), axis=1, keepdims=True))
  const = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
  adv = jnp.where(const, 0.0, (r - mean) / (std + jnp.float32(eps)))
  return adv.reshape(b)


def k3_kl(logp: Float[Array, "*S"], ref_logp: Float[Array, "*S"]) -> Float[Array, "*S"]:
  """k3 estimator of KL(pi || ref) on tokens sampled from pi (Schulman, "Approximating KL
  divergence", 2020): ``r - log r - 1`` with ``log r = ref_logp - logp``. As verl's low_var_kl,
  ``log r`` is clamped to +-20 and k3 to <= 10: with top-k / top-p a token can leave pi's support
  (logp ~ -1e30) after an update, and its term is then bounded, with no gradient."""
  lr = jnp.clip(ref_logp - logp, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
  return jnp.minimum(jnp.exp(lr) - lr - 1.0, KL_CLAMP)


def response_mask(lengths: Int[Array, " B"], max_len: int) -> Bool[Array, "B M"]:
  """True at response positions j < lengths[b]."""
  return jnp.arange(max_len)[None, :] < lengths[:, None]


@flax.struct.dataclass
class TokenTerms:
  """Per-token terms of the objective ([B, M]; meaningless past each row's length)."""

  loss: Float[Array, "B M"]  # -min(ratio * A, clip(ratio) * A) + beta * k3
  ratio: Float[Array, "B M"]  # exp(logp - old_logp)
  clipped: Bool[Array, "B M"]  # the clipped branch is the minimum (no gradient through ratio)
  ref_kl: Float[Array, "B M"]  # k3 to the reference (0 when beta == 0 or no reference)


def token_terms(logp: Float[Array, "B M"], old_logp: Float[Array, "B M"],
                advantages: Float[Array, " B"], cfg: GRPOConfig,
                ref_logp: Float[Array, "B M"] | None = None) -> TokenTerms:
  """PPO/GRPO clipped surrogate per token (old policy = the rollout's logprobs, docs/design.md,
  "GRPO"):
  ``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * k3(logp, ref_logp)``."""
  ratio = jnp.exp(logp - old_logp)
  a = advantages[:, None]
  unclipped = ratio * a
  clipped_obj = jnp.clip(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * a
  loss = -jnp.minimum(unclipped, clipped_obj)
  if cfg.beta > 0 and ref_logp is not None:
    kl = k3_kl(logp, ref_logp)
    loss = loss + jnp.float32(cfg.beta) * kl
  else:
    kl = jnp.zeros_like(logp)
  return TokenTerms(loss=loss, ratio=ratio, clipped=clipped_obj < unclipped, ref_kl=kl)


def token_weights(lengths: Int[Array, " B"], max_len: int, aggregation: str
                  ) -> Float[Array, "B M"]:
  """Weight of each token in the objective's numerator: 1 (token_mean) or 1 / length (seq_mean)
  inside the response, 0 past it. The denominator (``Sums.denominator``) is global."""
  mask = response_mask(lengths, max_len).astype(jnp.float32)
  if aggregation == "seq_mean":
    return mask / jnp.maximum(lengths, 1).astype(jnp.float32)[:, None]
  return mask


@flax.struct.dataclass
class Sums:
  """Sums over a (micro-)batch: add them up across micro-batches and ``psum`` them over devices,
  then ``metrics`` divides once. ``logp_gap_max`` combines by max."""

  objective: Float[Array, ""]  # sum of token_weights * loss (the numerator)
  ratio: Float[Array, ""]  # over response tokens
  clipped: Float[Array, ""]
  logp_gap: Float[Array, ""]  # |logp - rollout logp| over tokens inside the trainer's support
  logp_gap_max: Float[Array, ""]
  rollout_kl: Float[Array, ""]  # k3 between trainer and rollout logprobs (same tokens)
  outside: Float[Array, ""]  # tokens outside the trainer's top-k / top-p set
  ref_kl: Float[Array, ""]
  entropy: Float[Array, ""]
  reward: Float[Array, ""]  # over sequences
  tokens: Int[Array, ""]
  sequences: Int[Array, ""]

  @classmethod
  def zeros(cls) -> Sums:
    f, i = jnp.float32(0), jnp.int32(0)
    return cls(objective=f, ratio=f, clipped=f, logp_gap=f, logp_gap_max=f, rollout_kl=f,
               outside=f, ref_kl=f, entropy=f, reward=f, tokens=i, sequences=i)

  def combine(self, other: Sums) -> Sums:
    out = jax.tree.map(jnp.add, self, other)
    return out.replace(logp_gap_max=jnp.maximum(self.logp_gap_max, other.logp_gap_max))

  def psum(self, axis_name) -> Sums:
    out = jax.lax.psum(self, axis_name)
    return out.replace(logp_gap_max=jax.lax.pmax(self.logp_gap_max, axis_name))

  def denominator(self, aggregation: str) -> Float[Array, ""]:
    """Global token count (token_mean) or sequence count (seq_mean), as f32."""
    return (self.sequences if aggregation == "seq_mean" else self.tokens).astype(jnp.float32)


def batch_sums(terms: TokenTerms, logp, old_logp, entropy, lengths, rewards,
               aggregation: str) -> Sums:
  """The ``Sums`` of one (micro-)batch: ``objective`` is differentiable in ``logp``; every other
  field is a metric (gradient stopped)."""
  m = logp.shape[1]
  mask = response_mask(lengths, m)
  w = token_weights(lengths, m, aggregation)
  sg = jax.lax.stop_gradient
  msum = lambda x, mk=mask: jnp.sum(jnp.where(mk, sg(x), 0.0)).astype(jnp.float32)
  outside = logp < OUTSIDE_SUPPORT_LOGP
  inside = mask & ~outside
  gap = jnp.abs(logp - old_logp)
  return Sums(objective=jnp.sum(w * terms.loss), ratio=msum(terms.ratio),
              clipped=msum(terms.clipped.astype(jnp.float32)), logp_gap=msum(gap, inside),
              logp_gap_max=jnp.max(jnp.where(inside, sg(gap), 0.0)),
              rollout_kl=msum(k3_kl(old_logp, logp), inside),
              outside=msum(outside.astype(jnp.float32)), ref_kl=msum(terms.ref_kl),
              entropy=msum(entropy), reward=jnp.sum(rewards).astype(jnp.float32),
              tokens=mask.sum().astype(jnp.int32),
              sequences=jnp.int32(lengths.shape[0]))


@flax.struct.dataclass
class Metrics:
  """One step's metrics (global over all devices and micro-batches; token means over response
  tokens). ``logp_gap_*`` and ``rollout_kl`` compare the trainer's logprobs (before the update)
  with the rollout's: the no-mismatch check of docs/design.md (0 up to float rounding at ratio
  1)."""

  loss: Float[Array, ""]  # the objective (token_mean or seq_mean)
  ratio_mean: Float[Array, ""]
  clip_fraction: Float[Array, ""]  # tokens whose clipped branch is active
  logp_gap_mean: Float[Array, ""]  # mean |trainer logp - rollout logp| (tokens in support)
  logp_gap_max: Float[Array, ""]
  rollout_kl: Float[Array, ""]  # k3 estimate of KL(rollout || trainer) on the rollout's tokens
  outside_support: Float[Array, ""]  # fraction of tokens the trainer's top-k / top-p excludes
  #   (ratio 0; never at step 0 of a batch: that would be a rollout/trainer mismatch)
  ref_kl: Float[Array, ""]  # k3 estimate of KL(trainer || reference) (0 when beta == 0)
  entropy: Float[Array, ""]  # mean entropy of the (tempered, restricted) sampling distribution
  reward_mean: Float[Array, ""]
  grad_norm: Float[Array, ""]  # global norm before clipping
  tokens: Int[Array, ""]
  sequences: Int[Array, ""]


def metrics(s: Sums, aggregation: str, grad_norm) -> Metrics:
  """Global means from global sums."""
  nt = jnp.maximum(s.tokens, 1).astype(jnp.float32)
  ns = jnp.maximum(s.sequences, 1).astype(jnp.float32)
  den = jnp.maximum(s.denominator(aggregation), 1.0)
  ni = jnp.maximum(s.tokens.astype(jnp.float32) - s.outside, 1.0)  # tokens inside the support
  return Metrics(loss=s.objective / den, ratio_mean=s.ratio / nt, clip_fraction=s.clipped / nt,
                 logp_gap_mean=s.logp_gap / ni, logp_gap_max=s.logp_gap_max,
                 rollout_kl=s.rollout_kl / ni, outside_support=s.outside / nt,
                 ref_kl=s.ref_kl / nt, entropy=s.entropy / nt, reward_mean=s.reward / ns,
                 grad_norm=jnp.asarray(grad_norm, jnp.float32), tokens=s.tokens,
                 sequences=s.sequences)


def grpo_loss(logp: Float[Array, "B M"], old_logp: Float[Array, "B M"],
              advantages: Float[Array, " B"], lengths: Int[Array, " B"], cfg: GRPOConfig, *,
              ref_logp: Float[Array, "B M"] | None = None) -> Float[Array, ""]:
  """The GRPO loss of one whole batch on one device (token_mean or seq_mean over this batch),
  masked past each row's length. The data-parallel steps use ``batch_sums`` instead."""
  terms = token_terms(logp, old_logp, advantages, cfg, ref_logp)
  w = token_weights(lengths, logp.shape[1], cfg.aggregation)
  den = (lengths.shape[0] if cfg.aggregation == "seq_mean"
         else jnp.maximum(response_mask(lengths, logp.shape[1]).sum(), 1))
  return jnp.sum(w * terms.loss) / jnp.asarray(den, jnp.float32)
