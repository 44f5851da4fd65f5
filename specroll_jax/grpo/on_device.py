"""A fully on-device GRPO step for rewards written in JAX: one jitted ``shard_map`` whose
``lax.scan`` runs, per micro-batch of prompts, the traceable rollout (vanilla, or speculative with
a proposer), a jnp reward function, the group advantages and the gradient; then one optax update.

Every prompt's G responses are one micro-batch's rows (groups never straddle micro-batches or
devices); response ``i`` of global prompt ``p`` has sample id ``p * G + i`` (docs/design.md, "The
central invariant"), so the rollouts, and hence the update, do not depend on the device count or on
the micro-batching. Token counts are only known after the rollouts, so the scan accumulates the
objective's numerator and the ``Sums``; one ``psum`` and one division follow (see ``step``).

reward_fn(prompt_tokens [R, P], prompt_lengths [R], tokens [R, M], lengths [R], data) -> [R]:
traceable jnp; ``data`` is ``StepPrompts.reward_data`` (any pytree with a leading prompt axis, e.g.
a gold answer's token ids) repeated G times per prompt, or None.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PyTree

from specroll_jax import engines
from specroll_jax._fields import int_arg, int_tuple
from specroll_jax.engines.config import DecodeSettings, SpecConfig
from specroll_jax.grpo import loss as _loss
from specroll_jax.grpo import step as _step
from specroll_jax.grpo.config import GRPOConfig
from specroll_jax.grpo.step import AXIS, Batch, TrainState
from specroll_jax.kernels import REFERENCE, Kernels
from specroll_jax.mesh import ModelMesh
from specroll_jax.models.config import ModelConfig
from specroll_jax.proposers import Proposer
from specroll_jax.sampling import group_sample_ids


@flax.struct.dataclass
class StepPrompts:
  """One step's prompts, each once (the step makes its G responses)."""

  tokens: Int[Array, "Pr P"]  # right-padded prompt tokens
  lengths: Int[Array, " Pr"]  # >= 1
  indices: Int[Array, " Pr"]  # global prompt index: sample id of member i = index * G + i
  reward_data: PyTree | None = None  # leading [Pr] axis, handed to reward_fn (repeated G times)


@flax.struct.dataclass
class StepRollouts:
  """What the step sampled, by row (row p*G + i: prompt p, member i); for logs and traces."""

  tokens: Int[Array, "B M"]  # pad_id after each row's end
  lengths: Int[Array, " B"]
  logprobs: Float[Array, "B M"]  # the rollout's (0 after the end)
  rewards: Float[Array, " B"]
  advantages: Float[Array, " B"]
  nonfinite: Bool[Array, " B"]  # the row met NaN/inf logits and stopped
  row_forwards: Int[Array, ""]  # rows x target forwards summed over micro-batches and devices
  target_forwards: Int[Array, ""]  # sequential target forwards summed likewise


def rollout_train_step(state: TrainState, prompts: StepPrompts, seed, proposer_params=None, *,
                       config: ModelConfig, cfg: GRPOConfig, reward_fn: Callable, mesh: Mesh,
                       max_new_tokens: int, eos_ids: tuple[int, ...], proposer: Proposer | None,
                       spec: SpecConfig | None, rollout_kernels: Kernels,
                       train_kernels: Kernels, pad_id: int):
  """Rollouts + rewards + one GRPO update, traceable. seed: uint32 scalar (the rollouts' noise
  seed); proposer_params: the proposer's parameters (speculative only). Everything after ``*`` is
  static. Returns (new state, Metrics, StepRollouts)."""
  g = cfg.group_size
  settings = DecodeSettings(sampling=cfg.sampling, max_new_tokens=max_new_tokens,
                            cache_length=prompts.tokens.shape[1] + max_new_tokens,
                            kernels=rollout_kernels, pad_id=pad_id)
  eos = jnp.asarray(list(eos_ids) or [-1], jnp.int32)
  rep = lambda x: jnp.repeat(x, g, axis=0)

  def local(state, prompts, seed, proposer_params):
    def fn(params_v, pr: StepPrompts):
      ptok, plen = rep(pr.tokens), rep(pr.lengths)
      sids = group_sample_ids(pr.indices.astype(jnp.int32), g)
      batch = engines.PromptBatch(tokens=ptok, lengths=plen, sample_ids=sids, eos_ids=eos,
                                  seed=seed)
      if proposer is None:
        out = engines.VanillaEngine(config, settings)(state.params, batch)
      else:
        out = engines.SpecEngine(config, settings, proposer, spec)(state.params, proposer_params,
                                                                   batch)
      data = jax.tree.map(rep, pr.reward_data)
      rewards = jnp.asarray(reward_fn(ptok, plen, out.tokens, out.lengths, data), jnp.float32)
      adv = _loss.group_advantages(rewards, g, cfg.adv_eps)
      mb = Batch(prompt_tokens=ptok, prompt_lengths=plen, tokens=out.tokens, lengths=out.lengths,
                 logprobs=out.logprobs, rewards=rewards)
      grads, sums = _step.micro_sums(config, cfg, params_v, state.ref_params, mb, adv,
                                     train_kernels)
      st = out.stats
      return grads, sums, (out.tokens, out.lengths, out.logprobs, rewards, adv, st.nonfinite,
                           st.row_forwards, st.target_forwards)

    xs = _step.split_micro(prompts, cfg.micro_batches)
    grads, sums, outs = _step.accumulate(fn, state.params, xs, prompts)
    new, mets = _step.apply_update(cfg, state, grads, sums)
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    toks, lens, lps, rew, adv, nf, rf, tf = outs
    rolled = StepRollouts(tokens=flat(toks), lengths=flat(lens), logprobs=flat(lps),
                          rewards=flat(rew), advantages=flat(adv), nonfinite=flat(nf),
                          row_forwards=jax.lax.psum(rf.sum(), AXIS),
                          target_forwards=jax.lax.psum(tf.sum(), AXIS))
    return new, mets, rolled

  out_rolled = StepRollouts(tokens=P(AXIS), lengths=P(AXIS), logprobs=P(AXIS), rewards=P(AXIS),
                            advantages=P(AXIS), nonfinite=P(AXIS), row_forwards=P(),
                            target_forwards=P())
  # (data, model): rows by hand over data, the model axis to GSPMD (and to the kernels' own
  # shard_map over it: ``Kernels.mesh``), as in ``step.train_step``
  manual = {} if _step._model_axis(mesh) is None else {"axis_names": frozenset({AXIS})}
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS), P(), P()),
                       out_specs=(P(), P(), out_rolled), **manual)(state, prompts, seed,
                                                                   proposer_params)


@dataclasses.dataclass(frozen=True)
class RolloutTrainStep:
  """``step(state, prompts, seed, proposer_params=None) -> (state, Metrics, StepRollouts)``:
  host checks, then the jitted ``rollout_train_step`` (``state`` is donated: do not reuse it)."""

  config: ModelConfig
  cfg: GRPOConfig
  reward_fn: Callable
  mesh: Mesh
  max_new_tokens: int
  eos_ids: tuple[int, ...]
  proposer: Proposer | None = None
  spec: SpecConfig | None = None
  rollout_kernels: Kernels = REFERENCE
  train_kernels: Kernels = REFERENCE
  pad_id: int = 0

  @functools.cached_property
  def jitted(self):
    fn = functools.partial(
        rollout_train_step, config=self.config, cfg=self.cfg, reward_fn=self.reward_fn,
        mesh=self.mesh, max_new_tokens=self.max_new_tokens, eos_ids=self.eos_ids,
        proposer=self.proposer, spec=self.spec, rollout_kernels=self.rollout_kernels,
        train_kernels=self.train_kernels, pad_id=self.pad_id)
    return jax.jit(fn, donate_argnums=0)

  def __call__(self, state: TrainState, prompts: StepPrompts, seed, proposer_params=None):
    if not isinstance(prompts, StepPrompts):
      raise ValueError(f"prompts must be a grpo.StepPrompts, got {type(prompts).__name__}")
    n, w = prompts.tokens.shape
    for name in ("lengths", "indices"):
      got = tuple(getattr(prompts, name).shape)
      if got != (n,):
        raise ValueError(f"prompts.{name} has shape {got}, expected ({n},)")
    if w + self.max_new_tokens > self.config.max_position_embeddings:
      raise ValueError(f"prompt width {w} + max_new_tokens {self.max_new_tokens} = "
                       f"{w + self.max_new_tokens} exceeds max_position_embeddings "
                       f"{self.config.max_position_embeddings}")
    _step.check_rows(n, self.cfg, self.mesh, "prompts", per_row=self.cfg.group_size)
    if (self.proposer is None) != (proposer_params is None):
      raise ValueError("proposer_params must be given exactly when the step has a proposer, got "
                       f"proposer={self.proposer!r}, proposer_params "
                       f"{'None' if proposer_params is None else 'set'}")
    if self.proposer is not None:
      self.proposer.validate(self.config, proposer_params)
      if has_row_context(proposer_params):
        raise ValueError("proposer_params carry per-row lookup context (LookupContext.group_ids "
                         "or .prior), which this step replicates to every shard; on device, "
                         "siblings follow from the sample ids (leave group_ids and prior None)")
    state, prompts, seed, proposer_params = _step.place(
        self.mesh, state, prompts, (jnp.asarray(seed, jnp.uint32), proposer_params))
    return self.jitted(state, prompts, seed, proposer_params)


def has_row_context(params) -> bool:
  """Whether a proposer's parameters hold a ``LookupContext`` with per-row arrays."""
  from specroll_jax.proposers.group_lookup import LookupContext
  found = [x for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, LookupContext))
           if isinstance(x, LookupContext)]
  return any(c.group_ids is not None or c.prior is not None for c in found)


def make_rollout_train_step(config: ModelConfig, cfg: GRPOConfig, reward_fn: Callable, *,
                            max_new_tokens: int, eos_ids, mesh: Mesh | None = None,
                            proposer: Proposer | None = None, spec: SpecConfig | None = None,
                            rollout_kernels: Kernels | str = "auto",
                            train_kernels: Kernels | str = "reference",
                            pad_id: int = 0) -> RolloutTrainStep:
  """The fully on-device step (module docstring). ``proposer`` (with ``spec``, default
  ``SpecConfig()``) selects speculative rollouts; the same tokens as vanilla, so the same update.
  ``rollout_kernels`` is resolved once here ("auto": Pallas on GPU/TPU); the trainer forward uses
  ``train_kernels`` (the differentiable jnp reference by default)."""
  if not isinstance(cfg, GRPOConfig):
    raise ValueError(f"cfg must be a GRPOConfig, got {type(cfg).__name__}")
  if not callable(reward_fn):
    raise ValueError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
  max_new_tokens = int_arg(max_new_tokens, "max_new_tokens", 1)
  eos = int_tuple(eos_ids, "eos_ids", 0, config.vocab_size - 1)
  if proposer is not None and not isinstance(proposer, Proposer):
    raise ValueError(f"proposer must be a specroll_jax.proposers.Proposer, got "
                     f"{type(proposer).__name__}")
  if spec is not None and proposer is None:
    raise ValueError("spec is set but proposer is None (vanilla rollouts take no SpecConfig)")
  mesh = _step.default_mesh() if mesh is None else mesh
  if AXIS not in mesh.axis_names:
    raise ValueError(f"mesh must have a {AXIS!r} axis, got axes {mesh.axis_names}")
  model_mesh = None
  if len(mesh.axis_names) > 1:  # (data, model): the rollouts' kernels run per model shard
    model_mesh = ModelMesh(mesh)
    model_mesh.check_config(config)
  return RolloutTrainStep(
      config=config, cfg=cfg, reward_fn=reward_fn, mesh=mesh, max_new_tokens=max_new_tokens,
      eos_ids=eos, proposer=proposer,
      spec=(spec or SpecConfig()) if proposer is not None else None,
      rollout_kernels=Kernels.resolve(rollout_kernels, mesh=model_mesh),
      train_kernels=Kernels.resolve(train_kernels), pad_id=int(pad_id))
