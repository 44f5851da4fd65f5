"""Model configuration for the Qwen2 / Qwen2.5 / Llama-3 decoder family."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from specroll_jax._fields import check_int

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder of the Qwen2/Llama family. Frozen and hashable: it is a static jit argument.

  rope_scaling: None, or a tuple of sorted (key, value) pairs of a Llama-3 style rope scaling dict.
  dtype: parameter and compute dtype name ("float32" on CPU, "bfloat16" on GPU/TPU).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  max_position_embeddings: int = 32768
  architecture: str = "qwen2"
  dtype: str = "float32"
  rope_scaling: tuple | None = None
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      check_int(self, name, 1)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
          f"({self.num_kv_heads})")
    if self.dtype not in _DTYPES:
      raise ValueError(f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
    if self.architecture not in ARCHITECTURES.values():
      raise ValueError(
          f"ModelConfig.architecture must be one of {sorted(ARCHITECTURES.values())}, "
          f"got {self.architecture!r}")

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  @classmethod
  def tiny(cls, vocab_size: int = 512, **kw) -> ModelConfig:
    """A model small enough for unit tests: compiles and runs in about a second on CPU."""
    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, qkv_bias=True,
                tie_word_embeddings=True, max_position_embeddings=2048)
    base.update(kw)
    return cls(**base)

  @classmethod
  def embedded_default(cls, vocab_size: int) -> ModelConfig:
    """The embedded default model of ``experiments/gsm8k.py``: trains in minutes on 2 CPU cores."""
    return cls(vocab_size=vocab_size, hidden_size=192, intermediate_size=512, num_layers=4,
               num_heads=3, num_kv_heads=1, head_dim=64, rope_theta=10000.0, qkv_bias=True,
               tie_word_embeddings=True, max_position_embeddings=2048)

  # --- Hugging Face config.json ---------------------------------------------------------------

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Parse a transformers ``config.json`` (old top-level ``rope_theta``/``torch_dtype`` style or
    the transformers-5 ``rope_parameters``/``dtype`` style). Raises ValueError naming what is
    wrong."""
    archs = d.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
      mt = {"qwen2": "qwen2", "llama": "llama"}.get(d.get("model_type", ""))
      if mt is None:
        raise ValueError(
            f"{source}: unknown architecture {archs or d.get('model_type')!r}; expected one of "
            f"{sorted(ARCHITECTURES)}")
      arch = mt
    rope = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling")
    if scaling:
      rope.update(scaling)
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    rope_scaling = None
    if rope_type == "llama3":
      need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
      missing = [k for k in need if k not in rope]
      if missing:
        raise ValueError(f"{source}: rope_scaling of type 'llama3' lacks {missing}")
      rope_scaling = tuple(sorted((k, float(rope[k])) for k in need))
    elif rope_type != "default":
      raise ValueError(
          f"{source}: unsupported rope scaling type {rope_type!r}; supported: 'default', 'llama3'")
    dtype = d.get("dtype", d.get("torch_dtype", "float32")) or "float32"
    if dtype not in _DTYPES:
      raise ValueError(f"{source}: unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if arch == "llama" and (d.get("attention_bias") or d.get("mlp_bias")):
      # transformers' Llama puts attention_bias on o_proj too (and mlp_bias on gate/up/down); our
      # decoder has no such biases, so loading would silently drop them.
      raise ValueError(
          f"{source}: unsupported Llama biases attention_bias={d.get('attention_bias')!r}, "
          f"mlp_bias={d.get('mlp_bias')!r}; expected both false")
    qkv_bias = arch == "qwen2"
    return cls(
        vocab_size=d["vocab_size"], hidden_size=hidden, intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"], num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads, rope_theta=float(theta),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)), architecture=arch,
        dtype=dtype, rope_scaling=rope_scaling, bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids)

  def to_hf_dict(self) -> dict[str, Any]:
    """The transformers-5 style ``config.json`` of this model."""
    arch = {v: k for k, v in ARCHITECTURES.items()}[self.architecture]
    if self.qkv_bias != (self.architecture == "qwen2"):
      # transformers' Qwen2 always has q/k/v biases; its Llama has none (attention_bias=True
      # would also add an o_proj bias, which this decoder lacks).
      raise ValueError(
          f"ModelConfig: architecture {self.architecture!r} with qkv_bias={self.qkv_bias} has no "
          f"transformers equivalent (expected qkv_bias={self.architecture == 'qwen2'})")
    rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
    if self.rope_scaling:
      rope.update(dict(self.rope_scaling))
      rope["rope_type"] = "llama3"
      rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    d = {
        "architectures": [arch], "model_type": self.architecture, "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
        "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings, "rope_parameters": rope,
        "dtype": self.dtype, "hidden_act": "silu",
        "bos_token_id": self.bos_token_id,
        "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) != 1
                         else self.eos_token_ids[0]) if self.eos_token_ids else None,
    }
    if self.architecture == "llama":
      d["attention_bias"] = False
      d["mlp_bias"] = False
    return d
