"""Verifiable rewards: GSM8K final-answer correctness, plus an optional format bonus."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specroll_jax._fields import float_arg
from specroll_jax.data import gsm8k


def gsm8k_reward(
  completion: str, gold: str, *, format_weight: float = 0.0, mode: str = "strict"
) -> float:
  """1.0 if the final number of ``completion`` equals ``gold`` numerically, else 0.0.

  The number is found by ``gsm8k.extract_answer(completion, mode)``; both sides are compared in
  ``gsm8k.normalize_number`` form ("5" == "5.0", "1,234" == "1234"). ``format_weight`` is added
  when the completion has a well-formed "#### N" line, so the maximum is ``1 + format_weight``.
  """
  format_weight = float_arg(format_weight, "format_weight", 0)
  if mode not in gsm8k.EXTRACT_MODES:
    raise ValueError(f"mode must be one of {gsm8k.EXTRACT_MODES}, got {mode!r}")
  gold_norm = gsm8k.normalize_number(gold)
  if gold_norm is None:
    raise ValueError(f"gold must be a number, got {gold!r}")
  pred = gsm8k.extract_answer(completion, mode)
  reward = 1.0 if pred == gold_norm else 0.0
  if format_weight and gsm8k.has_answer_line(completion):
    reward += format_weight
  return reward


def batch_rewards(completions: Sequence[str], golds: Sequence[str], **kw) -> np.ndarray:
  """float32 [B] array of ``gsm8k_reward(completions[i], golds[i], **kw)``."""
  if len(completions) != len(golds):
    raise ValueError(
      f"completions and golds must have equal lengths, got {len(completions)} and {len(golds)}"
    )
  return np.asarray(
    [gsm8k_reward(c, g, **kw) for c, g in zip(completions, golds, strict=True)], dtype=np.float32
  )
