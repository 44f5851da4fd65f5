"""Experiment glue: GRPO batches (each prompt G times; sample id = prompt index * G + member)."""

import numpy as np
import pytest

from specroll_jax import pipeline


def test_grpo_batch_sample_ids():
  rep, sids = pipeline.grpo_batch([[1], [2, 3]], 3, first_prompt_index=5)
  assert rep == [[1], [1], [1], [2, 3], [2, 3], [2, 3]]
  np.testing.assert_array_equal(sids, [15, 16, 17, 18, 19, 20])  # prompt index * G + member
  assert len(set(sids.tolist())) == len(sids)  # unique: generate refuses duplicates


def test_grpo_batch_rejects_bad_group_size():
  with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
    pipeline.grpo_batch([[1]], 0)


def test_run_config_vanilla_buckets():
  from specroll_jax.grpo.loop import RunConfig
  assert RunConfig().vanilla_buckets is None  # the engine's default buckets
  assert RunConfig(vanilla_buckets=[1.0, 0.5]).vanilla_buckets == (1.0, 0.5)
  for bad in ((0.5,), (1.0, 2.0), ()):
    with pytest.raises(ValueError, match=r"RunConfig.vanilla_buckets must start at 1.0"):
      RunConfig(vanilla_buckets=bad)
