"""``SpecRollRollout``: the tunix ``BaseRollout`` that decodes through SpecRoll or the vanilla
engine, and the trainer-side scoring of its ``get_per_token_logps``. The design (parameters,
sampling, sample ids, outputs) is described in ``specroll_jax.integrations.tunix``, which
re-exports the class.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.rl.rollout import base_rollout

from specroll_jax import sampling as _sampling
from specroll_jax.engines import VanillaEngine
from specroll_jax.engines import executables as _exe
from specroll_jax.engines.config import DecodeSettings
from specroll_jax.engines.results import Rollout, check_nonfinite
from specroll_jax.grpo.logprobs import trainer_logprobs
from specroll_jax.heads import kinds as head_kinds
from specroll_jax.integrations.tunix_params import (
  _dtype_name,
  _supported_names,
  model_config_from_tunix,
  params_from_tunix,
  tunix_source,
)
from specroll_jax.integrations.tunix_settings import _is_int, _seed, sampling_from_rollout_config
from specroll_jax.kernels import Kernels
from specroll_jax.mesh import ModelMesh
from specroll_jax.models.config import ModelConfig
from specroll_jax.proposers import Proposer
from specroll_jax.rollout import prepare_batch, prompt_width
from specroll_jax.specroll import Mapped, SpecRoll

__all__ = ["SpecRollRollout"]


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


def _rollout_mesh(mesh, axes) -> ModelMesh | None:
  """The ``ModelMesh`` the decode runs on: None for no mesh or one device."""
  if mesh is None or mesh.size == 1:
    return None
  if not isinstance(axes, tuple) or len(axes) != 2:
    raise ValueError(f"mesh_axes must be a (row axis, model axis) pair, got {axes!r}")
  return ModelMesh(mesh, data=axes[0], model=axes[1])


class SpecRollRollout(base_rollout.BaseRollout):
  """SpecRoll decoding inside a tunix RL run (``specroll_jax.integrations.tunix``'s docstring:
  parameters, sampling, sample ids).

  rollout_actor: a tunix Qwen2 or Llama3 nnx module (what ``model()`` returns and decoding reads).
  tokenizer: a tunix ``TokenizerAdapter`` (the cluster passes one) or anything it wraps; its
    vocabulary must fit the model's embedding (``tokenizer_vocab_size`` when it cannot say).
  mesh: the rollout mesh tunix passes: with more than one device the decode runs on it, rows over
    its ``mesh_axes[0]`` axis and the weights and KV cache over ``mesh_axes[1]``
    (``specroll_jax.mesh``), reading the trainer's sharded arrays where they lie (GSPMD moves what
    a layer needs; nothing gathers the model onto one device).
  mesh_axes: (row axis, model axis) of ``mesh``: tunix's ("fsdp", "tp") by default.
  rollout_config: tunix's ``RolloutConfig`` the cluster passes (its TRAIN one): what
    ``get_per_token_logps`` scores under; ``generate`` reads the one it is given.
  heads: future-token heads (``cond_heads.CondHeads`` for the default tree, or ``heads.Heads``):
    decode through ``SpecRoll`` with its defaults; ``"learn"``: fresh heads that SpecRoll learns
    from the policy's own rollouts (``SpecRoll.init("learn")``), for a model without heads.
    proposer, proposer_params: your proposer in the same object instead. specroll: other
    ``SpecRoll`` settings (a dict of its fields, e.g.
    ``{"budget": "fixed", "spec": SpecConfig(...)}``). None of heads / proposer: the vanilla
    engine. ``self.state`` is the object's state (carried from call to call, per rollout config),
    ``self.report`` the last call's ``SpecRollReport``.
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
               on_nonfinite: str = "raise", mesh_axes: tuple[str | None, str] = ("fsdp", "tp")):
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
    self._model_mesh = _rollout_mesh(mesh, mesh_axes)
    self._kernels = Kernels.resolve(kernels, mesh=self._model_mesh)
    self._next_row = 0
    tok = self._tokenizer
    self._pad, self._eos, bos = int(tok.pad_id()), int(tok.eos_id()), tok.bos_id()
    self._base_config = model_config_from_tunix(
        rollout_actor, max_position_embeddings=max_position_embeddings, eos_token_ids=(self._eos,),
        bos_token_id=None if bos is None else int(bos))
    if self._model_mesh is not None:
      self._model_mesh.check_config(self._base_config)
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
    if heads is not None and proposer is not None:
      raise ValueError("pass heads= (the default tree) or proposer= with proposer_params=, not "
                       "both")
    if proposer is not None and proposer_params is None:
      raise ValueError(f"proposer_params is None but proposer={type(proposer).__name__}(...) is "
                       "given: pass its parameters (() for a proposer without any)")
    if proposer is None and proposer_params is not None:
      raise ValueError("proposer_params is set but proposer is None")
    if isinstance(heads, str):
      if heads != "learn":
        raise ValueError(f"heads must be heads, None or 'learn', got {heads!r}")
    elif heads is not None:
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
    if longest > width:  # widened as every entry pads (a power of two), never truncated
      width = prompt_width(longest)
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
                params_from=self._mapping(config), mesh=self._model_mesh,
                on_nonfinite=self._on_nonfinite)
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
      out, report, state = obj.generate(src, obj.batch(rows, pids), state, seed=seed)
      self._objects[(config, sampling, m, tuple(eos), width)] = (obj, state)
      self.state, self.report = state, report
    else:
      settings = DecodeSettings(sampling=sampling, max_new_tokens=m,
                                cache_length=batch.cache_length, kernels=self._kernels,
                                pad_id=self._pad)
      engine = Mapped(VanillaEngine(config, settings), self._mapping(config))
      dev = batch.device(seed)
      if self._model_mesh is not None:
        dev = self._model_mesh.place_batch(dev)
      out = _exe.run(engine, src, dev)
      check_nonfinite(out, self._on_nonfinite, stacklevel=3)
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
