"""Hugging Face checkpoint I/O: ``config.json`` + ``model.safetensors`` (or a sharded index).

Tensor names follow transformers' Qwen2ForCausalLM / LlamaForCausalLM; HF stores dense weights
[out, in], our params store kernels [in, out] with layers stacked on a leading axis.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from specroll_jax.models.config import ModelConfig

_LAYER = "model.layers.{i}."
# (our module, our leaf, HF suffix, transpose)
_LAYER_MAP = [
    ("attn_norm", "scale", "input_layernorm.weight", False),
    ("q_proj", "kernel", "self_attn.q_proj.weight", True),
    ("k_proj", "kernel", "self_attn.k_proj.weight", True),
    ("v_proj", "kernel", "self_attn.v_proj.weight", True),
    ("q_proj", "bias", "self_attn.q_proj.bias", False),
    ("k_proj", "bias", "self_attn.k_proj.bias", False),
    ("v_proj", "bias", "self_attn.v_proj.bias", False),
    ("o_proj", "kernel", "self_attn.o_proj.weight", True),
    ("mlp_norm", "scale", "post_attention_layernorm.weight", False),
    ("gate_proj", "kernel", "mlp.gate_proj.weight", True),
    ("up_proj", "kernel", "mlp.up_proj.weight", True),
    ("down_proj", "kernel", "mlp.down_proj.weight", True),
]


def _layer_shapes(c: ModelConfig) -> dict[tuple[str, str], tuple[int, ...]]:
  """Expected HF-layout ([out, in]) shapes per layer tensor."""
  d, q, kv, f = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
      c.intermediate_size
  shapes = {
      ("attn_norm", "scale"): (d,), ("q_proj", "kernel"): (q, d), ("k_proj", "kernel"): (kv, d),
      ("v_proj", "kernel"): (kv, d), ("o_proj", "kernel"): (d, q), ("mlp_norm", "scale"): (d,),
      ("gate_proj", "kernel"): (f, d), ("up_proj", "kernel"): (f, d),
      ("down_proj", "kernel"): (d, f),
  }
  if c.qkv_bias:
    shapes.update({("q_proj", "bias"): (q,), ("k_proj", "bias"): (kv,), ("v_proj", "bias"): (kv,)})
  return shapes


def _open(file: Path):
  """safe_open, with a ValueError naming the file when it is not a readable safetensors file."""
  try:
    return safe_open(str(file), framework="numpy")
  except Exception as e:  # SafetensorError (truncated / garbage header), OSError
    raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from e


def _tensor_files(path: Path) -> dict[str, Path]:
  """Map tensor name -> safetensors file."""
  single = path / "model.safetensors"
  index = path / "model.safetensors.index.json"
  if single.exists():
    with _open(single) as f:
      return {k: single for k in f.keys()}
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as e:
      raise ValueError(f"{index}: not a valid safetensors index ({e})") from e
    out = {}
    for name, shard in weight_map.items():
      p = path / shard
      if not p.exists():
        raise ValueError(f"{index}: shard {shard!r} (for tensor {name!r}) not found in {path}")
      out[name] = p
    return out
  raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json found")


def load_config(path) -> ModelConfig:
  path = Path(path)
  cfg_file = path / "config.json"
  if not cfg_file.exists():
    raise ValueError(f"{cfg_file}: config.json not found (expected a Hugging Face model folder)")
  try:
    d = json.loads(cfg_file.read_text())
  except ValueError as e:
    raise ValueError(f"{cfg_file}: invalid JSON ({e})") from e
  try:
    return ModelConfig.from_hf_dict(d, source=str(cfg_file))
  except KeyError as e:
    raise ValueError(f"{cfg_file}: missing required field {e}") from e


def load_pretrained(path) -> tuple[ModelConfig, dict]:
  """Load ``(config, params)`` from a local Hugging Face folder; params are cast to the
  config.json dtype."""
  path = Path(path)
  config = load_config(path)
  files = _tensor_files(path)
  dtype = config.jnp_dtype
  handles: dict[Path, object] = {}

  def get(name: str, expected: tuple[int, ...]):
    if name not in files:
      raise ValueError(f"{path}: tensor {name!r} missing (expected shape {expected})")
    fp = files[name]
    if fp not in handles:
      handles[fp] = _open(fp).__enter__()
    try:
      arr = handles[fp].get_tensor(name)  # numpy (bf16 via ml_dtypes): layout work stays on host
    except Exception as e:  # data past the end of a truncated file
      raise ValueError(f"{fp}: tensor {name!r} is unreadable ({type(e).__name__}: {e})") from e
    if tuple(arr.shape) != tuple(expected):
      raise ValueError(
          f"{fp}: tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(expected)}")
    return np.asarray(arr).astype(dtype)

  try:
    v, d = config.vocab_size, config.hidden_size
    params: dict = {"embed": {"embedding": get("model.embed_tokens.weight", (v, d))},
                    "final_norm": {"scale": get("model.norm.weight", (d,))}}
    params = {k: {kk: jnp.asarray(vv) for kk, vv in v.items()} for k, v in params.items()}
    layers: dict = {}
    shapes = _layer_shapes(config)
    for (mod, leaf, suffix, transpose) in _LAYER_MAP:
      if (mod, leaf) not in shapes:
        continue
      per_layer = []
      for i in range(config.num_layers):
        t = get(_LAYER.format(i=i) + suffix, shapes[(mod, leaf)])
        per_layer.append(t.T if transpose else t)
      layers.setdefault(mod, {})[leaf] = jnp.asarray(np.stack(per_layer))
    params["layers"] = layers
    if not config.tie_word_embeddings:
      params["lm_head"] = {"kernel": jnp.asarray(get("lm_head.weight", (v, d)).T)}
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)
  return config, params


def save_pretrained(path, config: ModelConfig, params) -> None:
  """Write ``config.json`` + ``model.safetensors`` (transformers layout). Files are replaced
  atomically (written to a temporary name, then renamed)."""
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  params = jax.tree.map(np.asarray, params)  # layout work on host (no per-shape compiles)
  tensors = {"model.embed_tokens.weight": params["embed"]["embedding"],
             "model.norm.weight": params["final_norm"]["scale"]}
  layers = params["layers"]
  for (mod, leaf, suffix, transpose) in _LAYER_MAP:
    if mod not in layers or leaf not in layers[mod]:
      continue
    stacked = layers[mod][leaf]
    for i in range(config.num_layers):
      t = stacked[i]
      tensors[_LAYER.format(i=i) + suffix] = t.T if transpose else t
  if not config.tie_word_embeddings:
    tensors["lm_head.weight"] = params["lm_head"]["kernel"].T
  tensors = {k: np.ascontiguousarray(t.astype(config.jnp_dtype)) for k, t in tensors.items()}
  atomic_write(path / "model.safetensors", lambda tmp: save_file(tensors, tmp,
                                                                  metadata={"format": "pt"}))
  atomic_write(path / "config.json",
                lambda tmp: Path(tmp).write_text(json.dumps(config.to_hf_dict(), indent=2)))


def atomic_write(target: Path, write) -> None:
  """``write(tmp)`` into a uniquely named sibling of ``target``, then renamed onto it: readers see
  the old file or the new one, concurrent writers do not clash, a failed write leaves nothing."""
  fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
  os.close(fd)
  try:
    write(tmp)
    os.replace(tmp, target)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
