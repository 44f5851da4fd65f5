"""tunix's Qwen2 / Llama3 and our decoder: the model config and the parameter mapping, both ways.

``model_config_from_tunix`` and ``tunix_source`` / ``params_from_tunix`` read a tunix nnx module as
our ``ModelConfig`` and parameter tree (no copy: the attention kernels' reshapes are bitcasts inside
``jax.jit``); ``tunix_qwen2_config`` / ``tunix_qwen2_params`` / ``tunix_qwen2_from_pretrained`` go
the other way, from our config and a Hugging Face folder to tunix's Qwen2. Public names are
re-exported by ``specroll_jax.integrations.tunix``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.llama3 import model as _llama3
from tunix.models.qwen2 import model as _qwen2

from specroll_jax.models.config import ModelConfig

__all__ = ["SUPPORTED_MODELS", "TunixLayer", "TunixSource", "model_config_from_tunix",
           "params_from_tunix", "tunix_qwen2_config", "tunix_qwen2_from_pretrained",
           "tunix_qwen2_params", "tunix_source"]

# tunix model class -> our architecture name
SUPPORTED_MODELS = {_qwen2.Qwen2: "qwen2", _llama3.Llama3: "llama"}
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _supported_names() -> list[str]:
  return [f"{c.__module__}.{c.__qualname__}" for c in SUPPORTED_MODELS]


def _family(model) -> str:
  for cls, arch in SUPPORTED_MODELS.items():
    if isinstance(model, cls):
      return arch
  raise ValueError(f"rollout_actor: cannot map {type(model).__module__}.{type(model).__qualname__} "
                   f"onto specroll_jax's decoder; supported model families: {_supported_names()}")


def _dtype_name(dtype, field: str) -> str:
  try:
    name = jnp.dtype(dtype).name
  except TypeError as e:
    raise ValueError(f"{field}={dtype!r} is not a dtype; supported: {list(_DTYPE_NAMES)}") from e
  if name not in _DTYPE_NAMES:
    raise ValueError(f"{field}={name} is outside our limits; supported: {list(_DTYPE_NAMES)}")
  return name


@functools.cache
def _llama3_block_passes_theta() -> bool:
  try:
    return "rope_theta" in inspect.getsource(_llama3.Attention.block)
  except (OSError, TypeError):  # no source: assume a fixed tunix
    return True


def _llama3_rope_theta(configured) -> float:
  """The rope base tunix's Llama3 actually applies. In tunix 0.1.7 ``Attention.block`` calls
  ``apply_rope`` without ``rope_theta``, so its default (1e6) is used whatever
  ``ModelConfig.rope_theta`` says; we decode what tunix's model computes (and trains)."""
  if _llama3_block_passes_theta():
    return float(configured)
  return float(inspect.signature(_llama3.apply_rope).parameters["rope_theta"].default)


def model_config_from_tunix(model, *, dtype=None, max_position_embeddings: int = 32768,
                            eos_token_ids: Sequence[int] = (),
                            bos_token_id: int | None = None) -> ModelConfig:
  """Our ``ModelConfig`` of a tunix Qwen2 or Llama3 model (an nnx module). ``dtype``: the compute
  dtype (default: the model's). tunix's models have no position limit of their own, so
  ``max_position_embeddings`` is ours to set. ValueError for any other model family."""
  arch = _family(model)
  c = model.config
  if arch == "qwen2":
    dt = c.dtype
    tied, qkv_bias = bool(c.use_tied_embedding), True
  else:  # tunix's Llama3 computes in its parameters' dtype and applies no rope scaling
    dt = model.embedder.input_embedding.get_value().dtype
    tied, qkv_bias = bool(c.weight_tying), False
  theta = _llama3_rope_theta(c.rope_theta) if arch == "llama" else c.rope_theta
  if nnx.state(model, nnx.LoRAParam):
    raise ValueError("rollout_actor: LoRA parameters (nnx.LoRAParam) are not supported; merge "
                     "the adapters into the base weights first")
  name = _dtype_name(dtype if dtype is not None else dt, "dtype")
  return ModelConfig(
      vocab_size=int(c.vocab_size), hidden_size=int(c.embed_dim),
      intermediate_size=int(c.hidden_dim), num_layers=int(c.num_layers),
      num_heads=int(c.num_heads), num_kv_heads=int(c.num_kv_heads), head_dim=int(c.head_dim),
      rope_theta=float(theta), rms_norm_eps=float(c.norm_eps), tie_word_embeddings=tied,
      qkv_bias=qkv_bias, max_position_embeddings=int(max_position_embeddings), architecture=arch,
      dtype=name, eos_token_ids=tuple(int(e) for e in eos_token_ids), bos_token_id=bos_token_id)


# ---------------------------------------------------------------------------------------------
# Parameters: tunix nnx state -> our parameter tree (no copy)


def _pure(state) -> dict:
  """A nested dict of arrays from an nnx module, ``nnx.State`` or nested dict of Variables."""
  if isinstance(state, nnx.Module):
    state = nnx.state(state, nnx.Param)
  if isinstance(state, nnx.State):
    state = nnx.to_pure_dict(state)
  return jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, state,
                      is_leaf=lambda v: isinstance(v, nnx.Variable))


def _get(tree, path: tuple, shape: tuple[int, ...]):
  node = tree
  for k in path:
    if not isinstance(node, dict) or k not in node:
      raise ValueError(f"params: no leaf {'.'.join(map(str, path))} (expected shape {shape})")
    node = node[k]
  if tuple(getattr(node, "shape", ())) != tuple(shape):
    raise ValueError(f"params: {'.'.join(map(str, path))} has shape "
                     f"{tuple(getattr(node, 'shape', ()))}, expected {tuple(shape)}")
  return node


class TunixLayer(TypedDict):
  """One layer's tunix arrays, in tunix's layout (``tunix_source``)."""
  attn_norm: jax.Array  # [D]
  q: jax.Array  # [D, H, Dh]
  k: jax.Array  # [D, Hkv, Dh]
  v: jax.Array  # [D, Hkv, Dh]
  o: jax.Array  # [H, Dh, D]
  mlp_norm: jax.Array  # [D]
  gate: jax.Array  # [D, F] (F: intermediate_size)
  up: jax.Array  # [D, F]
  down: jax.Array  # [F, D]
  q_bias: NotRequired[jax.Array]  # [H*Dh] (when config.qkv_bias)
  k_bias: NotRequired[jax.Array]  # [Hkv*Dh]
  v_bias: NotRequired[jax.Array]  # [Hkv*Dh]


class TunixSource(TypedDict):
  """The tunix arrays our decoder reads (``tunix_source``; a plain dict at run time)."""
  embed: jax.Array  # [V, D]
  final_norm: jax.Array  # [D]
  lm_head: NotRequired[jax.Array]  # [D, V] (untied embeddings only)
  layers: tuple[TunixLayer, ...]


def tunix_source(config: ModelConfig, state) -> TunixSource:
  """The tunix arrays our decoder needs, in tunix's layout (the same array objects: no copy),
  shape-checked against ``config`` (``TunixSource``: ``{"embed", "final_norm", "lm_head"?,
  "layers": (per-layer dicts,)}``). ``state``: a tunix Qwen2/Llama3 module, its
  ``nnx.state(model, nnx.Param)`` or that state as a nested dict. ValueError naming a missing
  leaf or a wrong shape."""
  s = _pure(state)
  d, v, f = config.hidden_size, config.vocab_size, config.intermediate_size
  n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
  embed = _get(s, ("embedder", "input_embedding"), (v, d))
  final_norm = _get(s, ("final_norm", "w"), (d,))
  lm_head = None if config.tie_word_embeddings else _get(s, ("lm_head", "w"), (d, v))
  layers: list[TunixLayer] = []
  for i in range(config.num_layers):
    p = ("layers", i)
    lay: TunixLayer = {
        "attn_norm": _get(s, p + ("input_layernorm", "w"), (d,)),
        "q": _get(s, p + ("attn", "q_proj", "w"), (d, n, h)),
        "k": _get(s, p + ("attn", "k_proj", "w"), (d, k, h)),
        "v": _get(s, p + ("attn", "v_proj", "w"), (d, k, h)),
        "o": _get(s, p + ("attn", "o_proj", "w"), (n, h, d)),
        "mlp_norm": _get(s, p + ("post_attention_layernorm", "w"), (d,)),
        "gate": _get(s, p + ("mlp", "gate_proj", "kernel"), (d, f)),
        "up": _get(s, p + ("mlp", "up_proj", "kernel"), (d, f)),
        "down": _get(s, p + ("mlp", "down_proj", "kernel"), (f, d))}
    if config.qkv_bias:
      lay.update(q_bias=_get(s, p + ("attn", "q_bias"), (n * h,)),
                 k_bias=_get(s, p + ("attn", "k_bias"), (k * h,)),
                 v_bias=_get(s, p + ("attn", "v_bias"), (k * h,)))
    layers.append(lay)
  extra = sorted(str(key) for key in s.get("layers", {}) if key not in range(config.num_layers))
  if extra:
    raise ValueError(f"params: layers {extra} beyond the model's num_layers={config.num_layers}")
  src: TunixSource = {"embed": embed, "final_norm": final_norm, "layers": tuple(layers)}
  if lm_head is not None:
    src["lm_head"] = lm_head
  return src


def params_from_tunix(config: ModelConfig, src: TunixSource) -> dict:
  """Our parameter tree (``models.decoder``; layers as a tuple of per-layer dicts, which the
  decoder takes as is) from ``tunix_source``. Traceable: inside ``jax.jit`` the reshapes are
  bitcasts and the casts vanish when the dtype already matches, so nothing is copied."""
  dt = config.jnp_dtype
  c = lambda a: a.astype(dt)
  d = config.hidden_size
  out = {"embed": {"embedding": c(src["embed"])}, "final_norm": {"scale": c(src["final_norm"])}}
  if not config.tie_word_embeddings:
    out["lm_head"] = {"kernel": c(src["lm_head"])}
  layers = []
  for s in src["layers"]:
    lay = {"attn_norm": {"scale": c(s["attn_norm"])},
           "q_proj": {"kernel": c(s["q"]).reshape(d, -1)},
           "k_proj": {"kernel": c(s["k"]).reshape(d, -1)},
           "v_proj": {"kernel": c(s["v"]).reshape(d, -1)},
           "o_proj": {"kernel": c(s["o"]).reshape(-1, d)},
           "mlp_norm": {"scale": c(s["mlp_norm"])},
           "gate_proj": {"kernel": c(s["gate"])}, "up_proj": {"kernel": c(s["up"])},
           "down_proj": {"kernel": c(s["down"])}}
    if config.qkv_bias:
      for name in ("q", "k", "v"):
        lay[f"{name}_proj"]["bias"] = c(s[f"{name}_bias"])
    layers.append(lay)
  out["layers"] = tuple(layers)
  return out


# ---------------------------------------------------------------------------------------------
# A Hugging Face folder -> tunix's Qwen2 (the inverse of tunix_source / params_from_tunix)


def tunix_qwen2_config(config: ModelConfig, *, dtype=None) -> _qwen2.ModelConfig:
  """tunix's Qwen2 ``ModelConfig`` of our ``config`` (the inverse of ``model_config_from_tunix``:
  embed_dim = hidden_size, hidden_dim = intermediate_size, use_tied_embedding =
  tie_word_embeddings, ...). ``dtype``: parameter and compute dtype (default: the config's).
  ValueError naming the field tunix's Qwen2 cannot express (architecture, rope_scaling)."""
  if config.architecture != "qwen2" or not config.qkv_bias:
    raise ValueError(f"ModelConfig.architecture={config.architecture!r} (qkv_bias="
                     f"{config.qkv_bias}) is not Qwen2: tunix's Qwen2 has q/k/v biases; "
                     "supported: architecture='qwen2' with qkv_bias=True")
  if config.rope_scaling is not None:
    raise ValueError(f"ModelConfig.rope_scaling={config.rope_scaling!r}: tunix's Qwen2 applies no "
                     "rope scaling; supported: None")
  dt = jnp.dtype(_dtype_name(dtype if dtype is not None else config.dtype, "dtype"))
  return _qwen2.ModelConfig(
      num_layers=config.num_layers, vocab_size=config.vocab_size, embed_dim=config.hidden_size,
      hidden_dim=config.intermediate_size, num_heads=config.num_heads, head_dim=config.head_dim,
      num_kv_heads=config.num_kv_heads, rope_theta=config.rope_theta,
      norm_eps=config.rms_norm_eps, use_tied_embedding=config.tie_word_embeddings, dtype=dt,
      param_dtype=dt)


def tunix_qwen2_params(config: ModelConfig, params) -> dict:
  """Our parameter tree (``models.decoder``: layers stacked [Ly, ...] or a tuple of per-layer
  dicts) as the pure dict of tunix's Qwen2 ``Param`` state: the inverse of ``params_from_tunix``
  (attention kernels [D, N*H] -> [D, N, H] and [N*H, D] -> [N, H, D]; embedding, norms, biases,
  MLP kernels and ``lm_head`` as they are). Values keep their dtype."""
  d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
  stacked = params["layers"]
  layer = ((lambda i: stacked[i]) if isinstance(stacked, (tuple, list))
           else (lambda i: jax.tree.map(lambda a: a[i], stacked)))
  out: dict[str, Any] = {"embedder": {"input_embedding": params["embed"]["embedding"]},
                         "final_norm": {"w": params["final_norm"]["scale"]}, "layers": {}}
  if not config.tie_word_embeddings:
    out["lm_head"] = {"w": params["lm_head"]["kernel"]}
  for i in range(config.num_layers):
    p = layer(i)
    out["layers"][i] = {
        "input_layernorm": {"w": p["attn_norm"]["scale"]},
        "attn": {"q_proj": {"w": p["q_proj"]["kernel"].reshape(d, n, h)},
                 "k_proj": {"w": p["k_proj"]["kernel"].reshape(d, k, h)},
                 "v_proj": {"w": p["v_proj"]["kernel"].reshape(d, k, h)},
                 "o_proj": {"w": p["o_proj"]["kernel"].reshape(n, h, d)},
                 "q_bias": p["q_proj"]["bias"], "k_bias": p["k_proj"]["bias"],
                 "v_bias": p["v_proj"]["bias"]},
        "post_attention_layernorm": {"w": p["mlp_norm"]["scale"]},
        "mlp": {"gate_proj": {"kernel": p["gate_proj"]["kernel"]},
                "up_proj": {"kernel": p["up_proj"]["kernel"]},
                "down_proj": {"kernel": p["down_proj"]["kernel"]}}}
  return out


def tunix_qwen2_from_pretrained(path, *, dtype=None) -> _qwen2.Qwen2:
  """tunix's ``Qwen2`` (an nnx module, what ``RLCluster`` trains and ``SpecRollRollout`` decodes)
  holding the weights of a local Hugging Face Qwen2 folder (``config.json`` +
  ``model.safetensors``, read by ``models.load_pretrained``; nothing is downloaded), e.g. the
  embedded model's ``assets.path()``. ``dtype``: parameter and compute dtype
  (default: config.json's). The module is built abstractly (``nnx.eval_shape``: no random init)
  and every ``Param`` then set from ``tunix_qwen2_params``, shape-checked. ValueError naming the
  file or field: a missing or unreadable file, a model that is not Qwen2."""
  from pathlib import Path

  from specroll_jax.models import hf

  if dtype is not None:
    _dtype_name(dtype, "dtype")
  path = Path(path)
  if not path.is_dir():
    raise ValueError(f"path={str(path)!r} is not a folder (expected a Hugging Face model folder "
                     "with config.json and model.safetensors)")
  config = hf.load_config(path)  # ValueError: config.json missing or invalid
  try:
    tcfg = tunix_qwen2_config(config, dtype=dtype)
  except ValueError as e:
    raise ValueError(f"{path / 'config.json'}: {e}") from None
  config, params = hf.load_pretrained(path)  # ValueError naming a missing file or tensor
  model = nnx.eval_shape(lambda: _qwen2.Qwen2(tcfg, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  want = nnx.to_pure_dict(state)
  got = tunix_qwen2_params(config, params)

  def put(kp, spec, value):
    if tuple(value.shape) != tuple(spec.shape):  # a mapping bug, never the user's input
      raise ValueError(f"params: {jax.tree_util.keystr(kp)} has shape {tuple(value.shape)}, "
                       f"expected {tuple(spec.shape)}")
    return jnp.asarray(value, tcfg.param_dtype)

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(put, want, got))
  nnx.update(model, state)
  return model
