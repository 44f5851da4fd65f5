"""GRPO on top of the rollouts (docs/design.md, "GRPO" and "No rollout/trainer mismatch").

``GRPOConfig`` (every default), ``group_advantages`` and the clipped objective (``loss``), the
trainer's teacher-forced logprobs under the rollout's own decoder and sampling rule
(``trainer_logprobs``), the data-parallel step over finished rollouts (``make_train_step``) and the
fully on-device step that samples, rewards and trains in one jitted program
(``make_rollout_train_step``).
"""

from specroll_jax.grpo.config import AGGREGATIONS, OLD_POLICIES, GRPOConfig
from specroll_jax.grpo.logprobs import TokenScores, trainer_hidden, trainer_logprobs
from specroll_jax.grpo.loss import (
  Metrics,
  Sums,
  TokenTerms,
  group_advantages,
  grpo_loss,
  k3_kl,
  token_terms,
)
from specroll_jax.grpo.on_device import (
  RolloutTrainStep,
  StepPrompts,
  StepRollouts,
  make_rollout_train_step,
  rollout_train_step,
)
from specroll_jax.grpo.step import (
  Batch,
  TrainState,
  TrainStep,
  init_train_state,
  make_train_step,
  train_step,
)

__all__ = ["AGGREGATIONS", "OLD_POLICIES", "Batch", "GRPOConfig", "Metrics", "RolloutTrainStep",
           "StepPrompts", "StepRollouts", "Sums", "TokenScores", "TokenTerms", "TrainState",
           "TrainStep", "group_advantages", "grpo_loss", "init_train_state", "k3_kl",
           "make_rollout_train_step", "make_train_step", "rollout_train_step", "token_terms",
           "train_step", "trainer_hidden", "trainer_logprobs"]

