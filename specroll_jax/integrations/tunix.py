"""SpecRoll as a rollout engine of google/tunix (``tunix.rl.rollout.base_rollout.BaseRollout``).

tunix's RL cluster builds a custom engine itself::

    cluster_config = rl_cluster.ClusterConfig(
        ..., rollout_engine=functools.partial(SpecRollRollout, heads=heads, num_generations=G))

and calls it with ``rollout_actor=`` (the trainer's own nnx model: tunix shares it with a custom
engine), ``tokenizer=``, ``mesh=`` and ``rollout_config=``. ``SpecRollRollout`` then decodes
through ``specroll_jax.SpecRoll`` (``heads=``: the object's defaults, its state carried from call
to call; ``proposer=`` with ``proposer_params=``: your proposer in the same object; ``specroll=``:
settings of the object, e.g. ``{"budget": "fixed"}``), or through the vanilla engine without
heads or a proposer (``experiments/tunix_grpo.py`` is a whole run).
Either way every token is the target's own sample under the counter-based noise
u(seed, sample id, position, token) (docs/design.md, "The central invariant"), so speculation
changes the cost of a rollout, never its tokens.

Parameters. Decoding reads ``model()``'s current ``nnx.Param`` state at every call. The tunix
arrays go into the jitted rollout as they are and are mapped onto our parameter tree inside the
compiled program (``params_from_tunix``): embedding, norms, biases, MLP kernels and ``lm_head``
have our layout already; the attention kernels ``[D, N, H]`` / ``[N, H, D]`` become ``[D, N*H]`` /
``[N*H, D]`` by a reshape XLA does as a bitcast (the compiled forward holds no weight-shaped
copy). No weight is copied (a cast to another
``RolloutConfig.data_type`` is the one exception). ``update_params`` writes new ``Param`` state
into ``model()``; tunix skips that call when ``model()`` is the trainer's module, and decoding then
follows the trainer directly.

Sampling. ``RolloutConfig`` maps onto ``SamplingConfig`` as tunix's own sampler reads it: greedy
when ``top_p`` is None or ``temperature`` is 0, else temperature with ``top_k`` (None, 0 or -1: off)
and ``top_p``. The logprobs returned are ours: the chosen token's under the tempered, top-k/top-p
restricted, renormalised distribution (tunix's sampler reports the unrestricted tempered one).
``get_per_token_logps`` scores tokens with the same decoder and rule (``grpo.trainer_logprobs``)
under the ``rollout_config`` the engine was built with.

Sample ids (docs/design.md, "The sample-id rule for GRPO"). tunix repeats each prompt G times,
prompt-major (``np.repeat(prompts, G)``), and its rollout micro-batches hold whole groups, so the
k-th row this engine decodes (counting across calls) is member ``k % G`` of global prompt
``k // G``. That row gets sample id k, which is ``sampling.group_sample_ids(prompt, G)``: GRPO
members differ, ids never repeat, and a response does not depend on how tunix splits the batch
into micro-batches. ``num_generations=G`` also checks that layout; ``next_sample_id`` (settable)
moves the counter, e.g. after a restart.

Outputs follow tunix's conventions: prompts are tokenized as its sampler does (BOS added unless
already there), left-padded with ``pad_id`` to ``max_prompt_length`` (to the next power of two when
a prompt is longer); completions are unpadded and end before a sampled EOS, as tunix's own
(vanilla) engine cuts it (``keep_eos=True`` keeps it, as its vLLM engine does).
``RolloutOutput.logits`` is empty (no [M, V] logits are kept), as tunix's vanilla engine returns
it.

Not covered: LoRA models, sharding the decode over ``mesh`` (the rollout runs under ``jax.jit``
with whatever sharding the parameters carry), multimodal prompts, beam search.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.models.llama3 import model as _llama3
from tunix.models.qwen2 import model as _qwen2
from tunix.rl.rollout import base_rollout

from specroll_jax import executables as _exe
from specroll_jax import head_kinds
from specroll_jax import sampling as _sampling
from specroll_jax.config import DecodeSettings, SpecConfig
from specroll_jax.engines import VanillaEngine
from specroll_jax.grpo.logprobs import trainer_logprobs
from specroll_jax.kernels import Kernels
from specroll_jax.models.config import ModelConfig
from specroll_jax.proposers import Proposer
from specroll_jax.results import Rollout
from specroll_jax.rollout import prepare_batch
from specroll_jax.sampling import SamplingConfig
from specroll_jax.specroll import Mapped, SpecRoll

__all__ = ["SUPPORTED_MODELS", "SpecRollRollout", "model_config_from_tunix", "params_from_tunix",
           "sampling_from_rollout_config", "tunix_source"]

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


def tunix_source(config: ModelConfig, state) -> dict:
  """The tunix arrays our decoder needs, in tunix's layout (the same array objects: no copy),
  shape-checked against ``config``: ``{"embed", "final_norm", "lm_head"?, "layers": (per-layer
  dicts,)}``. ``state``: a tunix Qwen2/Llama3 module, its ``nnx.state(model, nnx.Param)`` or that
  state as a nested dict. ValueError naming a missing leaf or a wrong shape."""
  s = _pure(state)
  d, v, f = config.hidden_size, config.vocab_size, config.intermediate_size
  n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
  src: dict[str, Any] = {"embed": _get(s, ("embedder", "input_embedding"), (v, d)),
                         "final_norm": _get(s, ("final_norm", "w"), (d,))}
  if not config.tie_word_embeddings:
    src["lm_head"] = _get(s, ("lm_head", "w"), (d, v))
  layers = []
  for i in range(config.num_layers):
    p = ("layers", i)
    lay = {"attn_norm": _get(s, p + ("input_layernorm", "w"), (d,)),
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
  src["layers"] = tuple(layers)
  return src


def params_from_tunix(config: ModelConfig, src: dict) -> dict:
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
# RolloutConfig -> our settings


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _number(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool,
                                                                                       np.bool_))


def sampling_from_rollout_config(rc: base_rollout.RolloutConfig) -> SamplingConfig:
  """``SamplingConfig`` of tunix's ``RolloutConfig``, read as tunix's sampler reads it: greedy when
  ``top_p`` is None or ``temperature`` is 0; ``top_k`` None, 0 or -1 is off. ValueError naming the
  field, its value and the limit."""
  t, p, k = rc.temperature, rc.top_p, rc.top_k
  if not _number(t) or not math.isfinite(float(t)) or float(t) < 0:
    raise ValueError(f"RolloutConfig.temperature={t!r} is outside our limits: a finite number >= 0")
  if p is not None and (not _number(p) or not 0.0 < float(p) <= 1.0):
    raise ValueError(f"RolloutConfig.top_p={p!r} is outside our limits: None (greedy) or in (0, 1]")
  if k is not None and (not _is_int(k) or int(k) < -1):
    raise ValueError(f"RolloutConfig.top_k={k!r} is outside our limits: None, -1 or 0 (off), or an "
                     "int >= 1")
  if p is None or float(t) == 0.0:
    return SamplingConfig(temperature=0.0)
  return SamplingConfig(temperature=float(t), top_k=max(int(k or 0), 0), top_p=float(p))


def _seed(value, default: int) -> int:
  """A uint32 seed from ``RolloutConfig.seed``: None (the engine's), an int, an integer array
  scalar, or a jax PRNG key (``PRNGKey(s)`` for s < 2**32 gives s)."""
  if value is None:
    return default
  if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  arr = np.asarray(value)
  if arr.shape == () and np.issubdtype(arr.dtype, np.integer):
    s = int(arr)
  elif arr.shape == (2,) and arr.dtype == np.uint32:  # a raw threefry key [hi, lo]
    s = ((int(arr[0]) * 0x9E3779B1) ^ int(arr[1])) & 0xFFFFFFFF
  else:
    raise ValueError(f"RolloutConfig.seed={value!r} is outside our limits: None, an int in "
                     "[0, 2**32) or a jax PRNG key")
  if not 0 <= s < 2**32:
    raise ValueError(f"RolloutConfig.seed={s} is outside our limits: [0, 2**32)")
  return s


def _next_power_of_2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _trainer_layout(prompt_tokens, completion_tokens, pad_id, completion_mask):
  """tunix's left-padded prompts / right-padded completions -> (right-padded prompts, prompt
  lengths, completion lengths). A prompt starts at its first non-pad token; a completion ends after
  its last non-pad token (or at ``completion_mask``'s count)."""
  p = prompt_tokens.shape[1]
  real = prompt_tokens != pad_id
  first = jnp.argmax(real, axis=1)
  plen = jnp.maximum(jnp.where(real.any(axis=1), p - first, 1), 1).astype(jnp.int32)
  idx = jnp.minimum(first[:, None] + jnp.arange(p)[None], p - 1)
  right = jnp.take_along_axis(prompt_tokens, idx, axis=1).astype(jnp.int32)
  m = completion_tokens.shape[1]
  if completion_mask is None:
    live = completion_tokens != pad_id
    clen = jnp.where(live.any(axis=1), m - jnp.argmax(live[:, ::-1], axis=1), 0)
  else:
    clen = jnp.sum(completion_mask.astype(jnp.int32), axis=1)
  return right, plen, clen.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "sampling"))
def _per_token_logps(config, src, prompt_tokens, completion_tokens, pad_id, completion_mask, *,
                     sampling):
  right, plen, clen = _trainer_layout(prompt_tokens, completion_tokens, pad_id, completion_mask)
  scores = trainer_logprobs(config, params_from_tunix(config, src), right, plen,
                            completion_tokens.astype(jnp.int32), clen, sampling)
  return scores.logprobs


# ---------------------------------------------------------------------------------------------
# The engine


def _vocab_size(tokenizer) -> int | None:
  """The tokenizer's vocabulary size, or None when it does not say."""
  inner = tokenizer.tokenizer if isinstance(tokenizer, TokenizerAdapter) else tokenizer
  for name in ("GetPieceSize", "get_piece_size"):  # sentencepiece
    if callable(getattr(inner, name, None)):
      return int(getattr(inner, name)())
  if hasattr(inner, "get_vocab") and hasattr(inner, "__len__"):  # transformers (added tokens too)
    return len(inner)
  size = getattr(inner, "vocab_size", None)
  if callable(size):
    size = size()
  if _is_int(size):
    return int(size)
  if hasattr(inner, "__len__"):
    return len(inner)
  return None


class SpecRollRollout(base_rollout.BaseRollout):
  """SpecRoll decoding inside a tunix RL run (module docstring: parameters, sampling, sample ids).

  rollout_actor: a tunix Qwen2 or Llama3 nnx module (what ``model()`` returns and decoding reads).
  tokenizer: a tunix ``TokenizerAdapter`` (the cluster passes one) or anything it wraps; its
    vocabulary must fit the model's embedding (``tokenizer_vocab_size`` when it cannot say).
  mesh: the rollout mesh tunix passes (kept, not used to shard the decode).
  rollout_config: tunix's ``RolloutConfig`` the cluster passes (its TRAIN one): what
    ``get_per_token_logps`` scores under; ``generate`` reads the one it is given.
  heads: future-token heads (``cond_heads.CondHeads`` for the default tree, or ``heads.Heads``):
    decode through ``SpecRoll`` with its defaults. proposer, proposer_params: your proposer in the
    same object instead. specroll: other ``SpecRoll`` settings (a dict of its fields, e.g.
    ``{"budget": "fixed", "spec": SpecConfig(...)}``). None of heads / proposer: the vanilla
    engine. ``self.state`` is the object's state (carried from call to call, per rollout config),
    ``self.report`` the last call's ``SpecRollReport``. adaptation, spec: deprecated (a
    DeprecationWarning; ``heads=adaptation.heads`` and ``specroll={"spec": spec}``).
  num_generations: G (the object's group size; 1 when None); when set, ``generate`` checks
    tunix's group layout (G consecutive copies of each prompt).
  seed: the seed when ``RolloutConfig.seed`` is None.
  keep_eos: keep a sampled EOS in the completion (tunix's vLLM engine) or cut it (default: its own
    vanilla engine does).
  max_position_embeddings: our position limit for the model (tunix's models state none).
  """

  def __init__(self, rollout_actor=None, tokenizer=None, mesh=None,
               rollout_config: base_rollout.RolloutConfig | None = None, *, heads=None,
               proposer: Proposer | None = None, proposer_params=None,
               specroll: dict | None = None, num_generations: int | None = None, seed: int = 0,
               keep_eos: bool = False, kernels: str | Kernels = "auto",
               max_position_embeddings: int = 32768, tokenizer_vocab_size: int | None = None,
               on_nonfinite: str = "raise", adaptation=None, spec: SpecConfig | None = None):
    if rollout_actor is None:
      raise ValueError(f"rollout_actor is None; pass a tunix model: {_supported_names()}")
    if tokenizer is None:
      raise ValueError("tokenizer is None; pass the tokenizer of the model")
    self._model = rollout_actor
    self._tokenizer = (tokenizer if isinstance(tokenizer, TokenizerAdapter)
                       else TokenizerAdapter(tokenizer))
    self.mesh = mesh
    self._rollout_config = rollout_config or base_rollout.RolloutConfig()
    if num_generations is not None and (not _is_int(num_generations) or num_generations < 1):
      raise ValueError(f"num_generations={num_generations!r} must be an int >= 1 (or None)")
    self._num_generations = None if num_generations is None else int(num_generations)
    if not _is_int(seed) or not 0 <= int(seed) < 2**32:
      raise ValueError(f"seed={seed!r} must be an int in [0, 2**32)")
    self._seed = int(seed)
    self._keep_eos = bool(keep_eos)
    if on_nonfinite not in ("raise", "flag"):
      raise ValueError(f"on_nonfinite must be 'raise' or 'flag', got {on_nonfinite!r}")
    self._on_nonfinite = on_nonfinite
    self._kernels = Kernels.resolve(kernels)
    self._next_row = 0
    tok = self._tokenizer
    self._pad, self._eos, bos = int(tok.pad_id()), int(tok.eos_id()), tok.bos_id()
    self._base_config = model_config_from_tunix(
        rollout_actor, max_position_embeddings=max_position_embeddings, eos_token_ids=(self._eos,),
        bos_token_id=None if bos is None else int(bos))
    v = self._base_config.vocab_size
    n = tokenizer_vocab_size if tokenizer_vocab_size is not None else _vocab_size(tok)
    if n is None:
      raise ValueError(f"tokenizer: cannot tell the vocabulary size of {type(tok.tokenizer)}; pass "
                       "tokenizer_vocab_size=")
    if not _is_int(n) or n > v:
      raise ValueError(f"tokenizer vocabulary size {n} exceeds the model's vocab_size {v}: token "
                       "ids would fall outside the embedding table (a smaller tokenizer, as with "
                       "Qwen2.5's padded embedding, is fine)")
    for name, tid in (("pad_id", self._pad), ("eos_id", self._eos), ("bos_id", bos)):
      if tid is not None and not 0 <= int(tid) < v:
        raise ValueError(f"tokenizer.{name}()={tid} is outside the model's vocabulary "
                         f"[0, vocab_size={v})")
    specroll = dict(specroll or {})
    if adaptation is not None:
      warnings.warn("SpecRollRollout(adaptation=...) is deprecated: pass heads= (the SpecRoll "
                    "object's defaults carry Reflex and the slow path); using "
                    "heads=adaptation.heads", DeprecationWarning, stacklevel=2)
      if heads is not None:
        raise ValueError("pass heads= or the deprecated adaptation=, not both")
      heads = adaptation.heads
    if spec is not None:
      warnings.warn("SpecRollRollout(spec=...) is deprecated: pass specroll={'spec': ...}",
                    DeprecationWarning, stacklevel=2)
      specroll.setdefault("spec", spec)
    if heads is not None and proposer is not None:
      raise ValueError("pass heads= (the default tree) or proposer= with proposer_params=, not "
                       "both")
    if proposer is not None and proposer_params is None:
      raise ValueError(f"proposer_params is None but proposer={type(proposer).__name__}(...) is "
                       "given: pass its parameters (() for a proposer without any)")
    if proposer is None and proposer_params is not None:
      raise ValueError("proposer_params is set but proposer is None")
    if heads is not None:
      head_kinds.validate(self._base_config, heads)
    self._heads, self._proposer, self._proposer_params = heads, proposer, proposer_params
    self._specroll_kw = specroll
    self._objects: dict = {}  # (config, sampling, lengths, eos, width) -> (SpecRoll, state)
    self._params_from: dict = {}  # config -> the mapping of tunix arrays onto ours (one each)
    self.state = None
    self.report = None
    self.last_rollout: Rollout | None = None  # our engine's output of the last generate call
    self.last_sample_ids: np.ndarray | None = None
    self._sampling = sampling_from_rollout_config(self._rollout_config)
    self._config(self._rollout_config)  # validate the cluster's config up front
    if self.speculative:  # validate the object's settings and the proposer against the model
      self._object(self._base_config, self._sampling, 16, (self._eos,), 32)

  @property
  def speculative(self) -> bool:
    """Whether decoding goes through ``SpecRoll`` (heads or a proposer were given)."""
    return self._heads is not None or self._proposer is not None

  # --- tunix's interface -------------------------------------------------------------------

  def generate(self, prompts: str | Sequence[str], rollout_config: base_rollout.RolloutConfig,
               *, sample_ids=None, **kwargs) -> base_rollout.RolloutOutput:
    """Decode one completion per prompt. ``sample_ids`` (optional, [B]) overrides the row
    counter's ids. Extra keyword arguments tunix may pass are accepted and ignored."""
    del kwargs
    if isinstance(prompts, str):
      prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
      raise ValueError("prompts is empty (batch of 0 prompts)")
    config = self._config(rollout_config)
    sampling = sampling_from_rollout_config(rollout_config)
    m = int(rollout_config.max_tokens_to_generate)
    seed = _seed(rollout_config.seed, self._seed)
    eos = (list(rollout_config.eos_tokens) if rollout_config.eos_tokens
           else [self._eos])
    rows = [self._tokenize(p) for p in prompts]
    longest = max(len(r) for r in rows)
    width = int(rollout_config.max_prompt_length)
    if longest > width:  # tunix's sampler widens to the next power of two, never truncates
      width = _next_power_of_2(longest)
    if width + m > config.max_position_embeddings:
      raise ValueError(
          f"RolloutConfig: prompt width {width} (max_prompt_length="
          f"{rollout_config.max_prompt_length}, longest prompt {longest} tokens) + "
          f"max_tokens_to_generate={m} exceeds our max_position_embeddings "
          f"{config.max_position_embeddings}")
    b = len(rows)
    right = np.zeros((b, width), np.int32)
    left = np.full((b, width), self._pad, np.int32)
    lens = np.array([len(r) for r in rows], np.int32)
    for i, r in enumerate(rows):
      right[i, : len(r)] = r
      left[i, width - len(r):] = r
    ids = self._sample_ids(prompts) if sample_ids is None else np.asarray(sample_ids)
    batch = prepare_batch(config, right, prompt_lengths=lens, max_new_tokens=m, sample_ids=ids,
                          eos_ids=eos, cache_length=width + m)
    out = self._decode(config, batch, sampling, m, seed, width, eos)
    if sample_ids is None:
      self._next_row += b
    self.last_sample_ids = batch.sample_ids
    return self._output(out, left, set(eos))

  def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array,
                          completion_mask: jax.Array | None = None) -> jax.Array:
    """[B, M] f32 logprobs of ``completion_tokens`` (right-padded with ``pad_id``) after the
    left-padded ``prompt_tokens``, under the same decoder and sampling rule as the rollout (the
    engine's ``rollout_config``); 0 past each completion's end."""
    config = self._base_config
    src = tunix_source(config, self._model)
    mask = None if completion_mask is None else jnp.asarray(completion_mask)
    return _per_token_logps(config, src, jnp.asarray(prompt_tokens), jnp.asarray(completion_tokens),
                            jnp.int32(self._pad), mask, sampling=self._sampling)

  def update_params(self, params, filter_types: tuple[Any, ...] | None = None) -> None:
    """Write ``params`` (an ``nnx.State`` of the model's ``Param``s, as tunix's ``sync_weights``
    passes, or that state as a nested dict) into ``model()``: no copy, the arrays are shared. The
    state is shape-checked first (ValueError naming the leaf)."""
    del filter_types
    tunix_source(self._base_config, params)
    nnx.update(self._model, params)

  def pad_id(self) -> int:
    return self._pad

  def eos_id(self) -> int:
    return self._eos

  def model(self) -> nnx.Module:
    return self._model

  # --- our additions -----------------------------------------------------------------------

  @property
  def config(self) -> ModelConfig:
    """Our ``ModelConfig`` of the model (what heads and proposers are built for)."""
    return self._base_config

  @property
  def next_sample_id(self) -> int:
    """The sample id the next decoded row gets (the row counter)."""
    return self._next_row

  @next_sample_id.setter
  def next_sample_id(self, value: int) -> None:
    if not _is_int(value) or not 0 <= int(value) < 2**31:
      raise ValueError(f"next_sample_id={value!r} must be an int in [0, 2**31)")
    g = self._num_generations
    if g is not None and int(value) % g:
      raise ValueError(f"next_sample_id={value} is not a multiple of num_generations={g} (a group "
                       "boundary)")
    self._next_row = int(value)

  # --- helpers -----------------------------------------------------------------------------

  def _config(self, rc: base_rollout.RolloutConfig) -> ModelConfig:
    """Our model config for a rollout config; ValueError naming the field outside our limits."""
    if not isinstance(rc, base_rollout.RolloutConfig):
      raise ValueError(f"rollout_config must be a tunix RolloutConfig, got {type(rc).__name__}")
    m, w = rc.max_tokens_to_generate, rc.max_prompt_length
    if not _is_int(m) or m < 1:
      raise ValueError(f"RolloutConfig.max_tokens_to_generate={m!r} is outside our limits: an "
                       "int >= 1")
    if not _is_int(w) or w < 1:
      raise ValueError(f"RolloutConfig.max_prompt_length={w!r} is outside our limits: an int >= 1")
    limit = self._base_config.max_position_embeddings
    if w + m > limit:
      raise ValueError(f"RolloutConfig.max_prompt_length={w} + max_tokens_to_generate={m} = "
                       f"{w + m} exceeds our max_position_embeddings {limit}")
    v = self._base_config.vocab_size
    for e in rc.eos_tokens or ():
      if not _is_int(e) or not 0 <= int(e) < v:
        raise ValueError(f"RolloutConfig.eos_tokens={list(rc.eos_tokens)} is outside our limits: "
                         f"ids in [0, vocab_size={v})")
    sampling_from_rollout_config(rc)
    _seed(rc.seed, self._seed)
    if rc.data_type is None:
      return self._base_config
    return self._base_config.replace(dtype=_dtype_name(rc.data_type, "RolloutConfig.data_type"))

  def _tokenize(self, prompt) -> list[int]:
    """Prompt ids as tunix's sampler makes them: encode, BOS in front unless already there."""
    if not isinstance(prompt, str):
      raise ValueError(f"prompts must be strings, got {type(prompt).__name__}")
    tok = self._tokenizer
    ids = [int(t) for t in tok.encode(prompt)]
    bos = tok.bos_id()
    return tok.dedup_bos_ids(([int(bos)] if bos else []) + ids)

  def _sample_ids(self, prompts: list[str]) -> np.ndarray:
    """Global row k gets id k: under tunix's prompt-major layout that is prompt * G + member
    (``sampling.group_sample_ids``)."""
    b, g = len(prompts), self._num_generations
    if g is None:
      return np.arange(self._next_row, self._next_row + b, dtype=np.int64)
    if b % g:
      raise ValueError(f"generate: {b} prompts is not a multiple of num_generations={g}; tunix "
                       "passes whole groups of G copies of each prompt")
    for j in range(0, b, g):
      if any(p != prompts[j] for p in prompts[j: j + g]):
        raise ValueError(f"generate: prompts {j}..{j + g - 1} are not {g} copies of one prompt; "
                         "expected tunix's group layout (each prompt repeated num_generations "
                         "times, consecutively)")
    first = self._next_row // g
    return _sampling.group_sample_ids(np.arange(first, first + b // g, dtype=np.int64), g)

  def _mapping(self, config: ModelConfig):
    """``params_from_tunix`` for ``config``: one function object per config, so the compiled
    programs that read tunix's arrays through it are found again on the next call."""
    if config not in self._params_from:
      self._params_from[config] = functools.partial(params_from_tunix, config)
    return self._params_from[config]

  def _object(self, config, sampling, m: int, eos: tuple[int, ...], width: int):
    """(the ``SpecRoll`` object of these rollout settings, its current state)."""
    key = (config, sampling, m, eos, width)
    if key not in self._objects:
      kw = dict(max_new_tokens=m, sampling=sampling, group_size=self._num_generations or 1,
                eos_ids=eos, proposer=self._proposer, kernels=self._kernels, prompt_width=width,
                params_from=self._mapping(config))
      kw.update(self._specroll_kw)
      try:
        obj = SpecRoll(config, **kw)
      except TypeError as e:
        raise ValueError(f"specroll: {e} (its keys must be SpecRoll fields)") from None
      state = obj.init(self._heads, proposer_params=self._proposer_params)
      self._objects[key] = (obj, state)
    return self._objects[key]

  def _decode(self, config, batch, sampling, m, seed, width, eos) -> Rollout:
    src = tunix_source(self._base_config, self._model)
    if self.speculative:
      obj, state = self._object(config, sampling, m, tuple(eos), width)
      g = obj.group_size
      sids = batch.sample_ids
      pids = sids[::g] // g
      if not (sids == _sampling.group_sample_ids(pids, g)).all():
        raise ValueError(f"sample_ids {sids.tolist()} are not whole groups of G={g} "
                         "(prompt * G + member)")
      rows = [batch.tokens[i, : batch.lengths[i]] for i in range(0, len(sids), g)]
      out, state = obj.generate(src, obj.batch(rows, pids), state, seed=seed)
      self._objects[(config, sampling, m, tuple(eos), width)] = (obj, state)
      self.state, self.report = state, out.report
    else:
      settings = DecodeSettings(sampling=sampling, max_new_tokens=m,
                                cache_length=batch.cache_length, kernels=self._kernels,
                                pad_id=self._pad)
      engine = Mapped(VanillaEngine(config, settings), self._mapping(config))
      out = _exe.run(engine, src, batch.device(seed))
      nf = np.asarray(out.stats.nonfinite)
      if nf.any():
        msg = f"non-finite logits in rows {np.flatnonzero(nf).tolist()}; those rows were stopped"
        if self._on_nonfinite == "raise":
          raise FloatingPointError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    self.last_rollout = out
    return out

  def _output(self, out: Rollout, left: np.ndarray, eos: set[int]) -> base_rollout.RolloutOutput:
    toks, lens, lps = (np.asarray(x) for x in (out.tokens, out.lengths, out.logprobs))
    tokens, logprobs, texts = [], [], []
    for i in range(toks.shape[0]):
      n = int(lens[i])
      if not self._keep_eos and n and int(toks[i, n - 1]) in eos:
        n -= 1
      t = toks[i, :n].astype(np.int32)
      tokens.append(t)
      logprobs.append(lps[i, :n].astype(np.float32))
      texts.append(self._tokenizer.decode(t.tolist()))
    return base_rollout.RolloutOutput(text=texts, logits=[], tokens=tokens,
                                      left_padded_prompt_tokens=left, logprobs=logprobs)


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
  embedded model ``pipeline.default_model_path()``. ``dtype``: parameter and compute dtype
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


__all__ += ["tunix_qwen2_config", "tunix_qwen2_from_pretrained", "tunix_qwen2_params"]
