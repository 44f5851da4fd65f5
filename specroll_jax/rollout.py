"""Public rollout entry: vanilla and speculative (SpecRoll) generation with one sampling rule.

``generate(config, params, prompts, sampling=..., max_new_tokens=..., seed=...)`` validates host
inputs and runs the vanilla engine (batched prefill, then one jitted ``lax.while_loop``). With
``speculation=Speculation(proposer, params, spec)`` (or ``Speculation.of_heads(heads)`` for static
future-token heads) it runs the speculative engine, which returns the same tokens: both sample
position t of response ``sample_id`` with the counter-based noise u(seed, sample_id, t, v)
(``sampling.py``), so the speculative rollout is the target's own sample. ``options=
DecodeOptions(...)`` holds how it decodes (kernels, hidden states, cache length, mesh, ...).

Inside your own ``jax.jit`` / ``jax.shard_map`` call an engine object (``VanillaEngine`` /
``SpecEngine`` from ``engines``: static settings in a frozen object, traced parameters and one
``PromptBatch``), or the traceable functions ``vanilla_rollout`` and ``speculative_rollout``;
``prepare_batch`` pads and checks host inputs once and ``PreparedBatch.device(seed)`` gives the
engines' ``PromptBatch``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from specroll_jax._fields import int_arg
from specroll_jax._fields import is_int as _is_int
from specroll_jax.engines import PromptBatch, SpecEngine, VanillaEngine, check_seed
from specroll_jax.engines.config import DecodeSettings, SpecConfig
from specroll_jax.engines.results import Rollout, RolloutStats, SpecStats, check_nonfinite
from specroll_jax.engines.speculative import speculative_rollout
from specroll_jax.engines.vanilla import vanilla_rollout
from specroll_jax.heads import kinds as head_kinds
from specroll_jax.kernels import Kernels
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig
from specroll_jax.proposers import Proposer, RankedHeads
from specroll_jax.sampling import SamplingConfig

__all__ = ["DecodeOptions", "DecodeSettings", "Kernels", "PreparedBatch", "PromptBatch", "Rollout",
           "RolloutStats", "SamplingConfig", "SpecConfig", "SpecEngine", "SpecStats", "Speculation",
           "VanillaEngine", "generate", "pad_prompts", "prepare_batch", "speculative_rollout",
           "vanilla_rollout"]

MIN_PROMPT_WIDTH = 32


def prompt_width(longest: int, limit: int | None = None) -> int:
  """The padded width of a batch whose longest prompt has ``longest`` tokens: the next power of
  two, at least ``MIN_PROMPT_WIDTH``, and at most ``limit`` (the positions a model has left for
  prompts) where that still holds the longest: the one padding rule of every entry (few widths,
  few programs)."""
  width = max(MIN_PROMPT_WIDTH, 1 << max(int(longest) - 1, 0).bit_length())
  return width if limit is None else max(min(width, int(limit)), int(longest))


def pad_prompts(prompts, width: int | None = None, *,
                limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [B, W] right-padded with 0, lengths int32 [B]) of ragged token-id lists.
  ``width`` None: ``prompt_width(longest, limit)``; a fixed width (the same shapes for every
  batch: one compile) must hold the longest prompt."""
  lens = np.array([len(p) for p in prompts], np.int32)
  longest = int(lens.max())
  if width is None:
    width = prompt_width(longest, limit)
  elif longest > width:
    raise ValueError(f"width={width} is shorter than the longest prompt ({longest} tokens)")
  toks = np.zeros((len(prompts), int(width)), np.int32)
  for i, p in enumerate(prompts):
    toks[i, : len(p)] = p
  return toks, lens


# ---------------------------------------------------------------------------------------------
# Input preparation and validation (before tracing)


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
  """A validated, padded batch of prompt rows on the host: what every entry takes (the engines
  through ``device(seed)``, ``SpecRoll`` with its groups, ``generate``). In GRPO shape
  (``SpecRoll.batch``) the rows are each prompt's G rows, prompt-major, and ``prompt_ids`` [P]
  holds the prompts' global ids (sample id = prompt id * G + member)."""

  tokens: np.ndarray  # [B, P] int32, right-padded
  lengths: np.ndarray  # [B] int32
  sample_ids: np.ndarray  # [B] int32
  eos_ids: np.ndarray  # [E] int32 (padded with -1)
  cache_length: int
  prompt_ids: np.ndarray | None = None  # [B // G] int64 (None: rows without groups)
  group_size: int = 1

  def device(self, seed: int) -> PromptBatch:
    """The batch on device with ``seed``: what ``engines.VanillaEngine`` / ``SpecEngine`` take."""
    return PromptBatch.from_prepared(self, seed)

  def __len__(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def row_prompt_ids(self) -> np.ndarray:
    """[B] each row's prompt id (GRPO shape only)."""
    if self.prompt_ids is None:
      raise ValueError("this batch has no prompt groups (SpecRoll.batch makes them)")
    return np.repeat(self.prompt_ids, self.group_size)

  def row_prompts(self, rows=slice(None)) -> list[np.ndarray]:
    """Each row's prompt tokens (unpadded), for the rows ``rows``."""
    return [self.tokens[i, : self.lengths[i]] for i in np.arange(len(self))[rows]]

  def head(self, k: int) -> PreparedBatch:
    """The first ``k`` rows (whole groups keep their prompt ids)."""
    ids = None if self.prompt_ids is None else self.prompt_ids[: -(-k // self.group_size)]
    return dataclasses.replace(self, tokens=self.tokens[:k], lengths=self.lengths[:k],
                               sample_ids=self.sample_ids[:k], prompt_ids=ids)


def prepare_batch(config: ModelConfig, prompts, *, max_new_tokens: int, prompt_lengths=None,
                  sample_ids=None, eos_ids=None, cache_length: int | None = None,
                  allow_duplicate_sample_ids: bool = False) -> PreparedBatch:
  """Validate and pad a batch of prompts. Raises ValueError naming the argument, value and limit.

  A list of prompts is padded to ``prompt_width`` of its longest (a power of two, at least 32:
  few programs); a padded [B, P] array keeps its width P, so a caller can fix every shape.

  Duplicate ``sample_ids`` are refused (two rows with the same prompt and id would get the same
  response) unless ``allow_duplicate_sample_ids``.
  """
  max_new_tokens = int_arg(max_new_tokens, "max_new_tokens", 1)
  if isinstance(prompts, (np.ndarray, jax.Array)):
    arr = np.asarray(prompts)
    if arr.ndim != 2:
      raise ValueError(f"prompts as an array must be 2-D [B, P], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"prompts must hold integer token ids, got dtype {arr.dtype}")
    if prompt_lengths is None:
      lens = np.full((arr.shape[0],), arr.shape[1], np.int64)
    else:
      lens = np.asarray(prompt_lengths)
      if lens.shape != (arr.shape[0],) or not np.issubdtype(lens.dtype, np.integer):
        raise ValueError(f"prompt_lengths must be integers of shape ({arr.shape[0]},), got "
                         f"{lens.dtype} {lens.shape}")
      if (lens > arr.shape[1]).any():
        raise ValueError(
            f"prompt_lengths {lens.max()} exceeds the padded prompt width {arr.shape[1]}")
    rows = [arr[i, : lens[i]].tolist() for i in range(arr.shape[0])]
    fixed_width = arr.shape[1]  # a padded array keeps its width (the caller fixes shapes)
  elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
    if prompt_lengths is not None:
      raise ValueError("prompt_lengths is only for a padded prompt array, got a list of prompts")
    fixed_width = None
    rows = []
    for i, p in enumerate(prompts):
      if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)):
        raise ValueError(f"prompts[{i}] must be a sequence of token ids, got {type(p).__name__}")
      bad = next((t for t in p if not _is_int(t)), None)
      if bad is not None:
        raise ValueError(f"prompts[{i}] holds {bad!r} ({type(bad).__name__}); token ids must be "
                         "integers")
      rows.append([int(t) for t in p])
  else:
    raise ValueError(
        f"prompts must be a list of token-id lists or a 2-D array, got {type(prompts)}")
  if not rows:
    raise ValueError("prompts is empty (batch of 0 prompts)")
  for i, r in enumerate(rows):
    if len(r) == 0:
      raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
    bad = [t for t in r if not (0 <= t < config.vocab_size)]
    if bad:
      raise ValueError(
          f"prompts[{i}] holds token id {bad[0]} outside [0, vocab_size={config.vocab_size})")
  b = len(rows)
  toks, lens = pad_prompts(rows, fixed_width,
                           limit=config.max_position_embeddings - int(max_new_tokens))
  if cache_length is None:  # the padded width + max_new_tokens: one shape per prompt bucket (a
    # batch whose longest prompt is shorter does not recompile), within the position limit
    need = int(lens.max()) + int(max_new_tokens)
    cache_length = max(need, min(toks.shape[1] + int(max_new_tokens),
                                 config.max_position_embeddings))
  if int(lens.max()) + int(max_new_tokens) > config.max_position_embeddings:
    raise ValueError(
        f"prompt length {int(lens.max())} + max_new_tokens {max_new_tokens} = "
        f"{int(lens.max()) + int(max_new_tokens)} exceeds the model's max_position_embeddings "
        f"{config.max_position_embeddings}")
  if not _is_int(cache_length) or int(lens.max()) + int(max_new_tokens) > cache_length:
    raise ValueError(
        f"prompt length {int(lens.max())} + max_new_tokens {max_new_tokens} = "
        f"{int(lens.max()) + int(max_new_tokens)} exceeds cache_length {cache_length}")
  if sample_ids is None:
    sids = np.arange(b, dtype=np.int32)
  else:
    sids = np.asarray(sample_ids)
    if sids.shape != (b,):
      raise ValueError(f"sample_ids must have shape ({b},), got {sids.shape}")
    if not np.issubdtype(sids.dtype, np.integer):
      raise ValueError(f"sample_ids must be integers, got dtype {sids.dtype}")
    if sids.min() < 0 or sids.max() >= 2**31:
      raise ValueError(f"sample_ids must be in [0, 2**31), got range [{sids.min()}, {sids.max()}]")
    uniq, counts = np.unique(sids, return_counts=True)
    if (counts > 1).any() and not allow_duplicate_sample_ids:
      dup = uniq[counts > 1][:8].tolist()
      raise ValueError(
          f"sample_ids holds duplicates {dup}: rows with the same prompt and sample id get the "
          "same response; give every GRPO member its own id (prompt_index * G + member) or pass "
          "allow_duplicate_sample_ids=True")
    sids = sids.astype(np.int32)
  if eos_ids is None:
    eos_ids = config.eos_token_ids
  eos_list = list(eos_ids)
  if any(not _is_int(e) for e in eos_list):
    raise ValueError(f"eos_ids must be integer token ids, got {eos_list}")
  eos = np.asarray(eos_list or [-1], np.int64)
  if ((eos >= config.vocab_size) | (eos < -1)).any():
    raise ValueError(f"eos_ids {eos_list} must lie in [0, vocab_size={config.vocab_size}) (-1: "
                     "none)")
  return PreparedBatch(toks, lens, sids, eos.astype(np.int32), int(cache_length))


_DEFAULT_SAMPLING = SamplingConfig()


@dataclasses.dataclass(frozen=True)
class Speculation:
  """The one way ``generate`` chooses a proposer: the proposer (settings), its parameters and the
  speculative engine's ``SpecConfig``. ``Speculation.of_heads(heads)`` is the static-heads
  shorthand (``RankedHeads`` over either head family, as ``SpecRoll`` ranks heads alone). For
  GRPO batches with Reflex, the slow path, calibration and goodput budgets, use
  ``specroll_jax.SpecRoll``."""

  proposer: Proposer
  params: object
  spec: SpecConfig = SpecConfig()

  def __post_init__(self):
    if not isinstance(self.proposer, Proposer):
      raise ValueError(f"Speculation.proposer must be a specroll_jax.proposers.Proposer, got "
                       f"{type(self.proposer).__name__}")
    if self.params is None:
      raise ValueError(f"Speculation.params is None for {type(self.proposer).__name__}(...): pass "
                       "its parameters (() for a proposer without any)")
    if not isinstance(self.spec, SpecConfig):
      raise ValueError(f"Speculation.spec must be a SpecConfig, got {type(self.spec).__name__}")

  @classmethod
  def of_heads(cls, heads, spec: SpecConfig | None = None, *,
               tree: RankedHeads | None = None) -> Speculation:
    """Static future-token ``heads`` (Medusa ``heads.Heads`` or root-conditioned
    ``cond_heads.CondHeads``) proposing as ``SpecRoll`` proposes with them alone (Reflex, the
    lookup and the slow path off): ``tree``, a ``proposers.RankedHeads`` (the tree's settings:
    candidates per depth, beams, nodes; default ``RankedHeads.for_heads(heads.num_heads)``),
    scored by its uncalibrated acceptance table, under ``spec`` (default ``SpecConfig()``)."""
    if heads is None:
      raise ValueError("Speculation.of_heads: heads is None; pass heads.init(...) or fitted heads")
    if spec is not None and not isinstance(spec, SpecConfig):
      raise ValueError(f"spec must be a SpecConfig, got {type(spec).__name__}")
    if not isinstance(heads, head_kinds.KINDS):
      raise ValueError(f"heads must be heads.Heads or cond_heads.CondHeads, got "
                       f"{type(heads).__name__}")
    tree = RankedHeads.for_heads(heads.num_heads) if tree is None else tree
    if not isinstance(tree, RankedHeads):
      raise ValueError(f"tree must be a proposers.RankedHeads, got {type(tree).__name__}")
    if heads.num_heads != tree.num_heads:
      raise ValueError(f"heads has {heads.num_heads} heads but tree.num_heads={tree.num_heads}")
    return cls(tree, tree.params(heads), spec or SpecConfig())


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How ``generate`` decodes, besides what it samples.

  kernels: "auto" (Pallas on GPU/TPU, jnp references on CPU), "reference", "pallas",
    "pallas_interpret", or a ``Kernels``; resolved once per call. return_hidden: also return the
    pre-norm hidden state at the anchor of each response token (what ``heads.fit_heads`` trains
    on). on_nonfinite: "raise" (FloatingPointError naming the rows) or "flag" (rows stop; see
    ``stats.nonfinite``); NaN/inf logits are never sampled. cache_length: KV positions per row
    (None: the padded prompt width + max_new_tokens). pad_id: written after each response's end.
    allow_duplicate_sample_ids: let two rows share a sample id (they then share a response).
    bucket_fractions: the vanilla engine's row buckets (None: ``DecodeSettings``'s; the
    speculative engine takes its buckets from ``Speculation.spec``).
    mesh: None (one device), or a ``Mesh`` with axes "data" / "model" or a
    ``specroll_jax.mesh.ModelMesh``: rows over data, the weights and the KV cache over model
    (``params`` placed by ``ModelMesh.shard_params``; docs/design.md, "Model-parallel rollouts").
  """

  kernels: str | Kernels = "auto"
  return_hidden: bool = False
  on_nonfinite: str = "raise"
  cache_length: int | None = None
  pad_id: int = 0
  allow_duplicate_sample_ids: bool = False
  bucket_fractions: tuple[float, ...] | None = None
  mesh: Any = None

  def __post_init__(self):
    if self.on_nonfinite not in ("raise", "flag"):
      raise ValueError(f"DecodeOptions.on_nonfinite must be 'raise' or 'flag', got "
                       f"{self.on_nonfinite!r}")
    Kernels.resolve(self.kernels, mesh=self.mesh)


def generate(config: ModelConfig, params, prompts, *, sampling: SamplingConfig = _DEFAULT_SAMPLING,
             max_new_tokens: int, seed: int = 0, sample_ids=None, eos_ids=None,
             prompt_lengths=None, speculation: Speculation | None = None,
             options: DecodeOptions | None = None) -> Rollout:
  """Sample one response per prompt from the target: the vanilla engine, or the speculative one
  with ``speculation`` (the same tokens).

  prompts: a list of token-id lists (ragged) or a padded [B, P] integer array with
    ``prompt_lengths``.
  sample_ids: global response ids (default 0..B-1, duplicates refused); the noise of a token
    depends on (seed, sample id, position, token) only, so a response does not depend on its batch
    slot or batch mates.
  eos_ids: ids that end a response (default: the config's); the EOS itself is part of the response.
  speculation: ``Speculation(proposer, params, spec)`` (any ``proposers.Proposer``), or
    ``Speculation.of_heads(heads)``. For GRPO batches whose proposer adapts to the policy
    (Reflex, the slow path, calibration, goodput budgets), use ``specroll_jax.SpecRoll``.
  options: ``DecodeOptions`` (kernels, hidden states, non-finite handling, cache length, ...;
    default ``DecodeOptions()``).
  """
  opts = DecodeOptions() if options is None else options
  if not isinstance(opts, DecodeOptions):
    raise ValueError(f"options must be a DecodeOptions, got {type(opts).__name__}")
  if speculation is not None and not isinstance(speculation, Speculation):
    raise ValueError(f"speculation must be a Speculation, got {type(speculation).__name__}")
  proposer = proposer_params = spec = None
  if speculation is not None:
    proposer, proposer_params, spec = (speculation.proposer, speculation.params,
                                       speculation.spec)
  if not isinstance(sampling, SamplingConfig):
    raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
  check_seed(seed)
  _dec.check_params(config, params)
  kern = Kernels.resolve(opts.kernels, mesh=opts.mesh)
  if kern.mesh is not None:
    kern.mesh.check_params(config, params)
  if proposer is not None:
    proposer.validate(config, proposer_params)
    if opts.bucket_fractions is not None:
      raise ValueError("DecodeOptions.bucket_fractions is for the vanilla engine; the speculative "
                       "engine takes its buckets from Speculation.spec (SpecConfig("
                       "bucket_fractions=...))")
  batch = prepare_batch(config, prompts, max_new_tokens=max_new_tokens,
                        prompt_lengths=prompt_lengths, sample_ids=sample_ids, eos_ids=eos_ids,
                        cache_length=opts.cache_length,
                        allow_duplicate_sample_ids=opts.allow_duplicate_sample_ids)
  extra = ({} if opts.bucket_fractions is None
           else {"bucket_fractions": tuple(opts.bucket_fractions)})
  if proposer is not None:
    proposer.validate_batch(config, proposer_params, batch.tokens, batch.lengths,
                            batch.sample_ids)
  settings = DecodeSettings(sampling=sampling, max_new_tokens=int(max_new_tokens),
                            cache_length=batch.cache_length, kernels=kern,
                            return_hidden=bool(opts.return_hidden), pad_id=opts.pad_id, **extra)
  dev = batch.device(seed)
  if kern.mesh is not None:
    dev = kern.mesh.place_batch(dev)
  if proposer is None:
    out = VanillaEngine(config, settings).jit(params, dev)
  else:
    out = SpecEngine(config, settings, proposer, spec).jit(params, proposer_params, dev)
  check_nonfinite(out, opts.on_nonfinite, stacklevel=2)
  return out
