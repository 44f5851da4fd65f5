"""Training tasks in GSM8K's format: GSM8K itself, the synthetic problems (``synthetic.py``) a
2M-parameter model can learn, or a mix of both. Every task's examples have ``question``,
``answer`` (the solution, ending ``#### N``) and ``gold``, so the prompt template
(``gsm8k.format_prompt``) and the reward (``rewards.gsm8k_reward``) are the same for all."""

from __future__ import annotations

import dataclasses
import functools

from app import synthetic
from specroll_jax._fields import check_int
from specroll_jax.data import gsm8k

TASKS = ("gsm8k", "synthetic", "mix")


@dataclasses.dataclass(frozen=True)
class Task:
  """name: "gsm8k", "synthetic" or "mix" (synthetic and GSM8K problems alternating).
  level: the synthetic difficulty (``synthetic.Difficulty.from_level``). train_size / test_size:
  synthetic problems per split (GSM8K brings its own). seed: the synthetic problems' seed (train
  and test are disjoint for any seed)."""

  name: str = "gsm8k"
  level: int = 1
  train_size: int = 20_000
  test_size: int = 512
  seed: int = 0

  def __post_init__(self):
    if self.name not in TASKS:
      raise ValueError(f"Task.name must be one of {TASKS}, got {self.name!r}")
    check_int(self, "level", 0, synthetic.NUM_LEVELS - 1)
    check_int(self, "train_size", 1)
    check_int(self, "test_size", 1)
    check_int(self, "seed", 0)

  def examples(self, split: str) -> list[gsm8k.Example]:
    """The task's examples of ``split`` ("train" or "test"), in a fixed order."""
    if split not in gsm8k.SPLITS:
      raise ValueError(f"split must be one of {gsm8k.SPLITS}, got {split!r}")
    return list(_examples(self, split))


@functools.cache
def _examples(task: Task, split: str) -> tuple[gsm8k.Example, ...]:
  if task.name == "gsm8k":
    return tuple(gsm8k.load(split))
  n = task.train_size if split == "train" else task.test_size
  syn = synthetic.generate(n, seed=task.seed, split=split,
                           difficulty=synthetic.Difficulty.from_level(task.level))
  syn = [p.example for p in syn]
  if task.name == "synthetic":
    return tuple(syn)
  real = gsm8k.load(split)
  out = []
  for i in range(max(len(syn), len(real))):  # alternate while both last
    if i < len(syn):
      out.append(syn[i])
    if i < len(real):
      out.append(real[i])
  return tuple(out)


__all__ = ["TASKS", "Task"]
