"""SFT: ``sft.build_test_model`` rebuilds the model the suite's ``trained_model`` fixture loads
(``tests/assets/test-model``): the same tokenizer and architecture, a training loss that falls,
and a held-out loss equal to the shipped copy's within what another CPU's float rounding moves it.
Marked slow: the build trains for 35-45 s on 2 CPU cores."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TEST_MODEL

from app import sft
from specroll_jax import models

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_build_test_model_reproduces_the_shipped_fixture(tmp_path):
  built, shipped = sft.build_test_model(tmp_path / "model"), Path(TEST_MODEL)
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    assert (built / name).read_text() == (shipped / name).read_text(), name
  new = json.loads((built / "metrics.json").read_text())
  old = json.loads((shipped / "metrics.json").read_text())
  assert new["sft_config"] == old["sft_config"] and new["steps"] == old["steps"] == 200
  curve = np.asarray(new["train_loss_curve"])
  assert curve[-20:].mean() < curve[:10].mean() - 2.0  # it learns (about 7 -> 3.4 nats)
  assert abs(new["test_loss"] - old["test_loss"]) < 0.1, (new["test_loss"], old["test_loss"])
  config, params = models.load_pretrained(built)
  config0, params0 = models.load_pretrained(shipped)
  assert config == config0
  assert jax.tree.structure(params) == jax.tree.structure(params0)
  assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params0),
                                                strict=True))
