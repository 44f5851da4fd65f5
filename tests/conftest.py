"""Shared fixtures: a tiny trained GSM8K model (built once per session) and a random tiny model."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

from specroll_jax import models, sft  # noqa: E402
from specroll_jax.data import gsm8k  # noqa: E402
from specroll_jax.models.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def trained_model(tmp_path_factory):
  """(config, params, tokenizer) of the tiny SFT-trained GSM8K model (about 30 s to build)."""
  path = os.environ.get("SPECROLL_TEST_MODEL")
  if not path:
    path = sft.build_test_model(tmp_path_factory.mktemp("tiny_model") / "model")
  config, params = models.load_pretrained(path)
  return config, params, Tokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def gsm8k_prompts(trained_model):
  """Token ids of the first 16 GSM8K test prompts (ragged)."""
  tok = trained_model[2]
  return [tok.encode(gsm8k.format_prompt(e.question)) for e in gsm8k.load("test")[:16]]


@pytest.fixture(scope="session")
def random_model():
  config = models.ModelConfig.tiny(vocab_size=256, max_position_embeddings=256)
  return config, models.init_params(jax.random.key(0), config)
