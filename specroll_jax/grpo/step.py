"""The data-parallel GRPO train step (docs/design.md, "GRPO"): ``jax.shard_map`` over a ``Mesh``
with a
``data`` axis inside ``jax.jit``, a ``lax.scan`` over micro-batches for gradient accumulation and
one optax update, with the ``TrainState`` donated.

Equal on 1 and N devices: inside the shard the parameters are cast to device-varying, so each
device's gradient is its own sum (no implicit all-reduce per micro-batch); the scan adds the
micro-batches' gradients of the objective's *numerator* and their ``loss.Sums``; after the scan one
``psum`` over ``data`` reduces gradients and sums, and both are divided by the global token count
(token_mean) or sequence count (seq_mean). No per-device mean is ever averaged, so the update is the
same function of the global batch whatever the device count (up to float summation order).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PyTree

from specroll_jax import mesh as _mesh
from specroll_jax._fields import bool_arg
from specroll_jax._vma import vary_like
from specroll_jax.grpo import loss as _loss
from specroll_jax.grpo.config import GRPOConfig
from specroll_jax.grpo.logprobs import trainer_logprobs
from specroll_jax.kernels import REFERENCE, Kernels
from specroll_jax.models.config import ModelConfig
from specroll_jax.models.decoder import check_params

AXIS = "data"


@flax.struct.dataclass
class TrainState:
  """What a step carries (and donates). ``ref_params`` is the frozen reference policy when
  ``beta > 0`` (None otherwise); a checkpoint can drop it and rebuild it from the initial params."""

  params: PyTree  # policy parameters (the decoder's ``params`` collection)
  opt_state: optax.OptState  # ``GRPOConfig.optimizer()`` state
  step: Int[Array, ""]  # optimizer updates done
  ref_params: PyTree | None = None


def init_train_state(params, cfg: GRPOConfig, *, ref_params=None) -> TrainState:
  """A fresh state. Copies ``params`` (and the reference), so donating the state never consumes the
  caller's arrays; with ``beta > 0`` the reference defaults to a copy of ``params``."""
  if not isinstance(cfg, GRPOConfig):
    raise ValueError(f"cfg must be a GRPOConfig, got {type(cfg).__name__}")
  if ref_params is not None and cfg.beta == 0:
    raise ValueError("ref_params is given but GRPOConfig.beta is 0 (no KL term): drop it or set "
                     "beta > 0")
  copy = lambda t: jax.tree.map(jnp.array, t)
  params = copy(params)
  ref = None if cfg.beta == 0 else copy(params if ref_params is None else ref_params)
  return TrainState(params=params, opt_state=cfg.optimizer().init(params), step=jnp.int32(0),
                    ref_params=ref)


@flax.struct.dataclass
class Batch:
  """Finished rollouts in prompt-major groups of G rows (row p*G + i: prompt p, member i)."""

  prompt_tokens: Int[Array, "B P"]  # right-padded prompts
  prompt_lengths: Int[Array, " B"]  # >= 1
  tokens: Int[Array, "B M"]  # response tokens (anything past lengths)
  lengths: Int[Array, " B"]  # response lengths (EOS included)
  logprobs: Float[Array, "B M"]  # the rollout's logprobs: the old policy of the ratio
  rewards: Float[Array, " B"]

  @classmethod
  def from_rollout(cls, prompt_tokens, prompt_lengths, rollout, rewards) -> Batch:
    """From a ``results.Rollout`` of the prompts (rows already repeated G times)."""
    return cls(prompt_tokens=jnp.asarray(prompt_tokens, jnp.int32),
               prompt_lengths=jnp.asarray(prompt_lengths, jnp.int32),
               tokens=jnp.asarray(rollout.tokens, jnp.int32),
               lengths=jnp.asarray(rollout.lengths, jnp.int32),
               logprobs=jnp.asarray(rollout.logprobs, jnp.float32),
               rewards=jnp.asarray(rewards, jnp.float32))


def default_mesh() -> Mesh:
  """A 1-D ``data`` mesh over every device."""
  return Mesh(np.array(jax.devices()), (AXIS,))


def micro_sums(config: ModelConfig, cfg: GRPOConfig, params, ref_params, mb: Batch,
               advantages: Float[Array, " B"], kernels: Kernels, return_hidden: bool = False):
  """(gradient of the objective's numerator, ``Sums``) of one micro-batch, on this device only;
  with ``return_hidden``, (gradient, (``Sums``, the forward's anchor hidden states [b, M, D]))."""
  ref_logp = None
  if cfg.beta > 0:
    ref_logp = jax.lax.stop_gradient(trainer_logprobs(
        config, ref_params, mb.prompt_tokens, mb.prompt_lengths, mb.tokens, mb.lengths,
        cfg.sampling, kernels=kernels).logprobs)

  def numerator(p):
    sc = trainer_logprobs(config, p, mb.prompt_tokens, mb.prompt_lengths, mb.tokens, mb.lengths,
                          cfg.sampling, kernels=kernels, return_hidden=return_hidden)
    old = mb.logprobs if cfg.old_policy == "rollout" else jax.lax.stop_gradient(sc.logprobs)
    terms = _loss.token_terms(sc.logprobs, old, advantages, cfg, ref_logp)
    s = _loss.batch_sums(terms, sc.logprobs, mb.logprobs, sc.entropy, mb.lengths, mb.rewards,
                         cfg.aggregation)
    return s.objective, ((s, sc.hidden) if return_hidden else s)

  grads, sums = jax.grad(numerator, has_aux=True)(params)
  return grads, sums


def accumulate(fn, params, xs, refs):
  """``lax.scan`` over the leading (micro-batch) axis of ``xs``: ``fn(params_varying, x)`` returns
  (grads, Sums, per-micro output); gradients (in f32) and sums are added on this device, outputs
  stacked. Returns (grads, Sums, outputs). ``refs``: arrays whose manual axes the carry must vary
  over (the parameters are cast to vary too, so no gradient is all-reduced inside the scan)."""
  params_v = vary_like(params, refs)
  f32_zeros = lambda p: jnp.zeros(p.shape, jnp.float32)
  zeros = vary_like((jax.tree.map(f32_zeros, params), _loss.Sums.zeros()), refs)

  def body(carry, x):
    g_acc, s_acc = carry
    g, s, out = fn(params_v, x)
    g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
    return (g_acc, s_acc.combine(s)), out

  (grads, sums), outs = jax.lax.scan(body, zeros, xs)
  return grads, sums, outs


def apply_update(cfg: GRPOConfig, state: TrainState, grads, sums: _loss.Sums, axis_name=AXIS):
  """Reduce the per-device f32 gradient and ``Sums`` over ``axis_name`` (one ``psum``), divide by
  the global denominator, then clip and apply one optax update (gradients cast to the parameters'
  dtype). Returns (new state, Metrics); every output is replicated."""
  grads = jax.lax.psum(grads, axis_name)
  sums = sums.psum(axis_name)
  den = jnp.maximum(sums.denominator(cfg.aggregation), 1.0)
  grads = jax.tree.map(lambda g: g / den, grads)
  gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  updates, opt_state = cfg.optimizer().update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
  return new, _loss.metrics(sums, cfg.aggregation, gnorm)


def split_micro(tree, micro_batches: int):
  """[B, ...] leaves -> [micro_batches, B // micro_batches, ...]."""
  return jax.tree.map(lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches,
                                          *x.shape[1:]), tree)


def train_step(state: TrainState, batch: Batch, *, config: ModelConfig, cfg: GRPOConfig,
               mesh: Mesh, kernels: Kernels = REFERENCE, return_hidden: bool = False):
  """One GRPO update from a batch of finished rollouts. Traceable; ``config``, ``cfg``, ``mesh``,
  ``kernels`` and ``return_hidden`` are static. Advantages come from the whole batch's groups; then
  each device takes B / n_devices rows (``shard_map`` over ``data``) in ``cfg.micro_batches``
  chunks. Returns (new state, Metrics); with ``return_hidden``, (new state, Metrics, hidden
  [B, M, D]): the anchor hidden states of the loss's own forward under the parameters *before* the
  update (the policy that rolled the batch out), sharded like the batch, for the slow path's
  records (``trainer_records.from_hidden``). The update is the same either way."""
  adv = _loss.group_advantages(batch.rewards, cfg.group_size, cfg.adv_eps)

  def local(state, batch, adv):
    def fn(params_v, x):
      mb, a = x
      g, s = micro_sums(config, cfg, params_v, state.ref_params, mb, a, kernels, return_hidden)
      if return_hidden:
        s, hid = s
        return g, s, hid
      return g, s, None

    xs = split_micro((batch, adv), cfg.micro_batches)
    grads, sums, hid = accumulate(fn, state.params, xs, (batch, adv))
    new, metrics = apply_update(cfg, state, grads, sums)
    if return_hidden:
      return new, metrics, hid.reshape((-1,) + hid.shape[2:])
    return new, metrics

  specs = (P(), P(), P(AXIS)) if return_hidden else (P(), P())
  # On a (data, model) mesh the rows are mapped by hand over data and the model axis is left to
  # GSPMD: the weights stay split as placed (``place``), each layer's partial sums all-reduced.
  manual = {} if _model_axis(mesh) is None else {"axis_names": frozenset({AXIS})}
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                       out_specs=specs, **manual)(state, batch, adv)


def _model_axis(mesh: Mesh) -> str | None:
  """The mesh's model axis (``specroll_jax.mesh.MODEL``) when it splits anything, else None."""
  return _mesh.MODEL if mesh.shape.get(_mesh.MODEL, 1) > 1 else None


def check_rows(rows: int, cfg: GRPOConfig, mesh: Mesh, what: str, per_row: int = 1) -> None:
  """ValueError unless ``rows`` splits into whole groups, devices and micro-batches."""
  n = mesh.shape[AXIS]
  if rows * per_row % cfg.group_size:
    raise ValueError(f"{what} has {rows} rows, not a multiple of group_size {cfg.group_size}")
  if rows % (n * cfg.micro_batches):
    raise ValueError(f"{what} has {rows} rows, not a multiple of n_devices {n} x micro_batches "
                     f"{cfg.micro_batches} = {n * cfg.micro_batches}")


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """``step(state, batch) -> (state, Metrics)`` (with ``return_hidden``: ``(state, Metrics,
  hidden)``, see ``train_step``): shapes checked on the host, then the jitted ``train_step``
  (compiled once per shapes; ``state`` is donated: do not reuse it)."""

  config: ModelConfig
  cfg: GRPOConfig
  mesh: Mesh
  kernels: Kernels = REFERENCE
  return_hidden: bool = False

  @functools.cached_property
  def jitted(self):
    fn = functools.partial(train_step, config=self.config, cfg=self.cfg, mesh=self.mesh,
                           kernels=self.kernels, return_hidden=self.return_hidden)
    return jax.jit(fn, donate_argnums=0)

  def __call__(self, state: TrainState, batch: Batch):
    check_params(self.config, state.params, "state.params")
    check_batch(batch, self.config, self.cfg, self.mesh)
    state, batch = place(self.mesh, state, batch)
    return self.jitted(state, batch)


def place(mesh: Mesh, state, rows, replicated=()):
  """``state`` (and ``replicated``) replicated over ``mesh``, ``rows`` split over ``data``: the
  shardings the step returns, so later calls reuse the first compile (a no-op when already so).
  On a (data, model) mesh the parameters, the reference and the optimizer's moments are split
  over ``model`` as ``ModelMesh.shard_params`` splits the weights (by their path's layer names)."""
  rows = jax.device_put(rows, NamedSharding(mesh, P(AXIS)))
  return (place_state(mesh, state), rows) + tuple(place_state(mesh, x) for x in replicated)


def place_state(mesh: Mesh, tree):
  """``tree`` (a ``TrainState``, parameters) as the steps take it: replicated over ``mesh``, or
  on a (data, model) mesh split over ``model`` as ``ModelMesh.shard_params`` splits the weights
  (by each leaf's path: the optimizer's moments follow their parameters)."""
  if _model_axis(mesh) is None:
    return jax.device_put(tree, NamedSharding(mesh, P()))
  return _mesh.ModelMesh(mesh).place(tree)


def check_batch(batch: Batch, config: ModelConfig, cfg: GRPOConfig, mesh: Mesh) -> None:
  """ValueError naming the field, its shape and the limit when ``batch`` does not fit."""
  if not isinstance(batch, Batch):
    raise ValueError(f"batch must be a grpo.Batch, got {type(batch).__name__}")
  b, m = batch.tokens.shape
  want = {"prompt_tokens": (b, batch.prompt_tokens.shape[-1]), "prompt_lengths": (b,),
          "lengths": (b,), "logprobs": (b, m), "rewards": (b,)}
  for name, shape in want.items():
    got = tuple(getattr(batch, name).shape)
    if got != shape or batch.prompt_tokens.ndim != 2:
      raise ValueError(f"batch.{name} has shape {got}, expected {shape} (tokens is {(b, m)})")
  width = batch.prompt_tokens.shape[1] + m
  if width > config.max_position_embeddings:
    raise ValueError(f"prompt width {batch.prompt_tokens.shape[1]} + response width {m} = {width} "
                     f"exceeds max_position_embeddings {config.max_position_embeddings}")
  check_rows(b, cfg, mesh, "batch")


def make_train_step(config: ModelConfig, cfg: GRPOConfig, *, mesh: Mesh | None = None,
                    kernels: Kernels = REFERENCE, return_hidden: bool = False) -> TrainStep:
  """The data-parallel step over ``mesh`` (default: every device on one ``data`` axis).
  ``kernels`` is the trainer forward's attention (the jnp reference by default: differentiable);
  ``return_hidden``: the step also returns its forward's anchor hidden states (``train_step``)."""
  if not isinstance(cfg, GRPOConfig):
    raise ValueError(f"cfg must be a GRPOConfig, got {type(cfg).__name__}")
  mesh = default_mesh() if mesh is None else mesh
  if AXIS not in mesh.axis_names:
    raise ValueError(f"mesh must have a {AXIS!r} axis, got axes {mesh.axis_names}")
  if len(mesh.axis_names) > 1:  # (data, model): the model axis must divide what it splits
    _mesh.ModelMesh(mesh).check_config(config)
  bool_arg(return_hidden, "return_hidden")
  return TrainStep(config=config, cfg=cfg, mesh=mesh, kernels=Kernels.resolve(kernels),
                   return_hidden=return_hidden)
