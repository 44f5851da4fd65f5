"""The embedded default model, shipped in the package (``gsm8k-tiny``, described in the README.md
beside it): ``path()`` is its Hugging Face folder, ``load()`` reads the model, its tokenizer and its
root-conditioned heads."""

from __future__ import annotations

from pathlib import Path

from specroll_jax import models
from specroll_jax.heads import conditioned as cond_heads
from specroll_jax.models.tokenizer import Tokenizer

EMBEDDED = "gsm8k-tiny"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "cond_heads.safetensors")


def path() -> Path:
  """The embedded model's folder, ``specroll_jax/assets/gsm8k-tiny`` (Hugging Face layout:
  ``config.json``, ``model.safetensors``, ``tokenizer.json``, plus ``cond_heads.safetensors``
  and ``heads.safetensors``)."""
  return Path(__file__).resolve().parent / EMBEDDED


def load() -> tuple[models.ModelConfig, dict, Tokenizer, cond_heads.CondHeads]:
  """(config, params, tokenizer, heads) of the embedded model: its ``ModelConfig``, parameters and
  tokenizer (``Tokenizer.from_pretrained``), and the root-conditioned heads shipped beside it
  (``cond_heads.safetensors``, checked against the config). Raises ``FileNotFoundError`` naming
  the file when the package lacks one (``experiments/build_default_model.py`` rebuilds them)."""
  folder = path()
  for name in _FILES:
    if not (folder / name).is_file():
      raise FileNotFoundError(
          f"the embedded model's {name} is missing from {folder} (it ships with the package; "
          f"`python experiments/build_default_model.py --out {folder}` rebuilds the folder)")
  config, params = models.load_pretrained(folder)
  heads = cond_heads.load(folder / "cond_heads.safetensors")
  cond_heads.validate(config, heads)
  return config, params, Tokenizer.from_pretrained(folder), heads
