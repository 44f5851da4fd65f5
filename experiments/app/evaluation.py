"""Greedy accuracy of a model on a task's held-out examples (strict "#### N" and flexible
last-number answers)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Accuracy:
  """n examples; accuracy_strict: the share whose "#### N" line holds the gold answer;
  accuracy_flexible: the share whose last number is the gold answer."""

  n: int
  accuracy_strict: float
  accuracy_flexible: float

  def to_dict(self) -> dict:
    """Plain values for a JSON file."""
    return dataclasses.asdict(self)


def accuracy(config, params, tok, examples, *, max_new_tokens: int = 192,
             batch_size: int = 32, sampling=None, seed: int = 0, mesh=None) -> Accuracy:
  """Accuracy on ``examples`` (objects with ``question`` and ``gold``), one response each: greedy,
  or sampled with ``sampling`` (a ``SamplingConfig``; sample id = the example's index, ``seed``,
  so the same call gives the same responses). Prompts padded to one width (one compile).
  ``mesh``: decode on it (``rollout.DecodeOptions.mesh``; ``params`` placed for it)."""
  from specroll_jax import rewards, rollout
  from specroll_jax.data import gsm8k
  exs = list(examples)
  if not exs:
    raise ValueError("accuracy: no examples")
  ids = [tok.encode(gsm8k.format_prompt(e.question)) for e in exs]
  padded, lens = rollout.pad_prompts(ids)
  strict = flexible = 0.0
  rule = rollout.SamplingConfig(temperature=0.0) if sampling is None else sampling
  for i in range(0, len(exs), batch_size):
    sl = slice(i, i + batch_size)
    toks, ln = padded[sl], lens[sl]
    if len(toks) < batch_size:  # pad the last batch with copies (one shape: one compile)
      extra = batch_size - len(toks)
      toks, ln = np.concatenate([toks, toks[:1].repeat(extra, 0)]), np.concatenate(
          [ln, ln[:1].repeat(extra)])
    r = rollout.generate(config, params, toks, prompt_lengths=ln, sampling=rule, seed=seed,
                         max_new_tokens=max_new_tokens, eos_ids=tok.eos_ids,
                         sample_ids=np.arange(i, i + len(toks)),
                         options=rollout.DecodeOptions(
                             cache_length=padded.shape[1] + max_new_tokens, mesh=mesh))
    out, out_lens = np.asarray(r.tokens), np.asarray(r.lengths)
    for row, e in enumerate(exs[sl]):
      text = tok.decode(out[row, : out_lens[row]].tolist())
      strict += rewards.gsm8k_reward(text, e.gold)
      flexible += rewards.gsm8k_reward(text, e.gold, mode="flexible")
  return Accuracy(n=len(exs), accuracy_strict=strict / len(exs),
                  accuracy_flexible=flexible / len(exs))


def gsm8k_accuracy(config, params, tok, *, n: int = 64, max_new_tokens: int = 192,
                   batch_size: int = 32) -> Accuracy:
  """Greedy GSM8K test accuracy (strict '#### N' and flexible last-number) on the first n."""
  from specroll_jax.data import gsm8k
  return accuracy(config, params, tok, gsm8k.load("test")[:n], max_new_tokens=max_new_tokens,
                  batch_size=batch_size)


__all__ = ["Accuracy", "accuracy", "gsm8k_accuracy"]
