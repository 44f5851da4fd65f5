"""The two rollout engines as frozen objects (docs/design.md, "Data flow of a rollout").

An engine holds everything static about a rollout (model config, decode settings, and for the
speculative engine the proposer and ``SpecConfig``) and is hashable, so it is the static argument
of one compiled program. Calling it takes the traced parts only: the parameters, for
``SpecEngine`` the proposer's parameters, and one ``PromptBatch``::

    engine = engines.VanillaEngine.build(config, sampling=SamplingConfig(temperature=1.0),
                                         max_new_tokens=256, cache_length=batch.cache_length)
    out = engine(params, batch)          # traceable: inside your jax.jit / jax.shard_map
    out = engine.jit(params, batch)      # or compiled once per engine (cached by jax)

    spec = engines.SpecEngine.build(config, proposer=HeadsProposer(), sampling=..., ...)
    out = spec(params, heads, batch)     # the same tokens as the vanilla engine

``rollout.generate`` is the host convenience on top (validation, padding, one way to choose a
proposer, adaptation between batches); ``rollout.vanilla_rollout`` / ``speculative_rollout`` are
the same traceable functions with the static settings spelled as keyword arguments.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, UInt32

from specroll_jax._fields import check_type, int_arg
from specroll_jax.engines import executables as _exe
from specroll_jax.engines import speculative as _spec
from specroll_jax.engines import vanilla as _vanilla
from specroll_jax.engines.config import DecodeSettings, SpecConfig
from specroll_jax.engines.results import Rollout
from specroll_jax.kernels import Kernels
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig
from specroll_jax.proposers.base import Proposer
from specroll_jax.sampling import SamplingConfig

__all__ = ["PromptBatch", "SpecEngine", "VanillaEngine"]

_PLAIN = SamplingConfig()
_SPEC = SpecConfig()


@flax.struct.dataclass
class PromptBatch:
  """One batch of prompts on device (a pytree: shard it, pass it through jit).

  tokens [B, P] right-padded prompt ids; lengths [B]; sample_ids [B] the noise coordinate of each
  response (``sampling.group_sample_ids`` for GRPO groups); eos_ids [E] ids that end a response
  (-1 padded; ``[-1]`` for none); seed [] the rollout's seed.
  """

  tokens: Int[Array, "B P"]
  lengths: Int[Array, " B"]
  sample_ids: Int[Array, " B"]
  eos_ids: Int[Array, " E"]
  seed: UInt32[Array, ""]

  @classmethod
  def from_prepared(cls, prepared, seed) -> PromptBatch:
    """The device batch of a ``rollout.prepare_batch`` result (validated and padded on the host)
    and a seed in [0, 2**32)."""
    check_seed(seed)
    return cls(tokens=jnp.asarray(prepared.tokens), lengths=jnp.asarray(prepared.lengths),
               sample_ids=jnp.asarray(prepared.sample_ids), eos_ids=jnp.asarray(prepared.eos_ids),
               seed=jnp.uint32(seed))


def check_seed(seed) -> None:
  """ValueError unless ``seed`` is an int in [0, 2**32) (the noise's uint32 seed)."""
  int_arg(seed, "seed", 0, 2**32 - 1)


def _settings(sampling, max_new_tokens, cache_length, kernels, **kw) -> DecodeSettings:
  return DecodeSettings(sampling=sampling, max_new_tokens=max_new_tokens,
                        cache_length=cache_length, kernels=Kernels.resolve(kernels), **kw)


def _check_common(engine) -> None:
  check_type(engine, "config", ModelConfig)
  check_type(engine, "settings", DecodeSettings)


@dataclasses.dataclass(frozen=True)
class VanillaEngine:
  """Plain decoding: batched prefill, then one token per row per step, rows bucketed as they
  finish (``DecodeSettings.bucket_fractions``)."""

  config: ModelConfig
  settings: DecodeSettings

  def __post_init__(self):
    _check_common(self)

  @classmethod
  def build(cls, config: ModelConfig, *, max_new_tokens: int, cache_length: int,
            sampling: SamplingConfig = _PLAIN, kernels: str | Kernels = "auto",
            **settings) -> VanillaEngine:
    """An engine from the decode settings' fields (``DecodeSettings`` validates them)."""
    return cls(config, _settings(sampling, max_new_tokens, cache_length, kernels, **settings))

  def __call__(self, params, batch: PromptBatch) -> Rollout:
    """The rollout of ``batch`` (traceable)."""
    return _vanilla.vanilla_rollout(self.config, params, batch.tokens, batch.lengths,
                                    batch.sample_ids, batch.eos_ids, batch.seed,
                                    settings=self.settings)

  def jit(self, params, batch: PromptBatch) -> Rollout:
    """``self(params, batch)`` through its compiled program (``executables``: one per engine and
    argument shapes)."""
    _dec.check_params(self.config, params)
    return _exe.run(self, params, batch)


@dataclasses.dataclass(frozen=True)
class SpecEngine:
  """Speculative decoding with ``proposer``: a verify forward per step over each row's candidate
  tree, committing exactly the vanilla engine's tokens (docs/design.md, "One speculative step")."""

  config: ModelConfig
  settings: DecodeSettings
  proposer: Proposer
  spec: SpecConfig = _SPEC

  def __post_init__(self):
    _check_common(self)
    check_type(self, "proposer", Proposer, what="specroll_jax.proposers.Proposer")
    check_type(self, "spec", SpecConfig)

  @classmethod
  def build(cls, config: ModelConfig, *, proposer: Proposer, max_new_tokens: int,
            cache_length: int, sampling: SamplingConfig = _PLAIN,
            spec: SpecConfig = _SPEC, kernels: str | Kernels = "auto",
            **settings) -> SpecEngine:
    return cls(config, _settings(sampling, max_new_tokens, cache_length, kernels, **settings),
               proposer, spec)

  def vanilla(self) -> VanillaEngine:
    """The vanilla engine with the same settings (the reference for exactness checks)."""
    return VanillaEngine(self.config, self.settings)

  def __call__(self, params, proposer_params, batch: PromptBatch, nodes=None) -> Rollout:
    """The rollout of ``batch`` (traceable); ``proposer_params`` as the proposer's ``validate``
    accepts them; ``nodes`` [S] int32 (with ``SpecConfig.choices`` only): each bucket
    fraction's node count, one of the choices, given at run time."""
    return _spec.speculative_rollout(self.config, params, self.proposer, proposer_params,
                                     batch.tokens, batch.lengths, batch.sample_ids, batch.eos_ids,
                                     batch.seed, settings=self.settings, spec=self.spec,
                                     nodes=nodes)

  def jit(self, params, proposer_params, batch: PromptBatch) -> Rollout:
    """``self(params, proposer_params, batch)`` through its compiled program (``executables``:
    one per engine and argument shapes)."""
    _dec.check_params(self.config, params)
    return _exe.run(self, params, proposer_params, batch)

  def start(self, params, proposer_params, batch: PromptBatch) -> _spec.SpecState:
    """The loop state after the prefill (traceable): what :meth:`steps` continues."""
    return _spec.init_state(self.config, params, self.proposer, proposer_params, batch.tokens,
                            batch.lengths, batch.sample_ids, batch.eos_ids, batch.seed,
                            settings=self.settings, spec=self.spec)

  def steps(self, params, proposer_params, state: _spec.SpecState, batch: PromptBatch, *,
            count: int) -> _spec.SpecState:
    """``count`` (static) speculative steps of every slot in the first bucket, whatever is
    active (traceable): the unit of work ``goodput.measure_cost`` times."""
    params = _dec.unstack_layers(params)
    (rows, n), = self.spec.bucket_shapes(batch.tokens.shape[0], self.proposer.capacity)[:1]
    del rows
    body = lambda _, s: _spec.spec_step(self.config, params, self.proposer, proposer_params, s,
                                        batch.eos_ids, batch.seed, settings=self.settings,
                                        num_nodes=n, bucket=0)
    return jax.lax.fori_loop(0, count, body, state)


