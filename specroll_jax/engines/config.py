"""Static settings of one rollout call: ``DecodeSettings`` (sampling, lengths, kernels, outputs) and
``SpecConfig`` (the speculative engine's node budget and buckets). Both are frozen and hashable:
they are static jit arguments, validated once when built."""

from __future__ import annotations

import dataclasses

from specroll_jax._fields import check_bool, check_int, check_type, float_arg, int_tuple
from specroll_jax.engines import buckets as _buckets
from specroll_jax.kernels import Kernels
from specroll_jax.sampling import SamplingConfig

DEFAULT_TOPK = (4, 3, 2)  # per-depth candidates of the heads proposer; deeper heads take 2


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """Per-call static settings shared by the vanilla and the speculative engine.

  sampling: how the target samples (temperature, top-k, top-p).
  max_new_tokens: response length limit M (an EOS, when sampled, ends a response earlier).
  cache_length: KV cache positions per row (>= padded prompt width + M is the caller's check).
  kernels: which attention / sampler implementation (``Kernels.resolve``); resolved already.
  return_hidden: also record the pre-norm hidden state at the anchor of every response token.
  pad_id: the token written after each response's end.
  bucket_fractions: the vanilla engine's row buckets as fractions of the batch (descending from
    1.0): live rows move into the next smaller bucket once no more of them are active than it
    holds, as a serving engine frees finished rows. ``(1.0,)`` keeps every row until the longest
    response ends. (The speculative engine's buckets are ``SpecConfig.bucket_fractions``.)
  """

  sampling: SamplingConfig
  max_new_tokens: int
  cache_length: int
  kernels: Kernels = Kernels()
  return_hidden: bool = False
  pad_id: int = 0
  bucket_fractions: tuple[float, ...] = _buckets.DEFAULT_FRACTIONS

  def __post_init__(self):
    check_type(self, "sampling", SamplingConfig)
    for name in ("max_new_tokens", "cache_length"):
      check_int(self, name, 1)
    if not isinstance(self.kernels, Kernels):
      raise ValueError(f"DecodeSettings.kernels must be a Kernels (see Kernels.resolve), got "
                       f"{self.kernels!r}")
    check_bool(self, "return_hidden")
    check_int(self, "pad_id", None)
    object.__setattr__(self, "bucket_fractions", _buckets.check_fractions(
        self.bucket_fractions, "DecodeSettings.bucket_fractions"))


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Speculative engine settings (docs/design.md, "One speculative step" and "Buckets and
  compaction").

  node_budget: global number of tree nodes (root excluded) per verify forward, shared by the rows
    of a bucket.
  max_nodes: per-row cap N_max. A bucket of ``rows`` rows gives every row
    N = min(max_nodes, node_budget // rows, the proposer's capacity) nodes; the fields themselves
    are never rewritten.
  bucket_fractions: row counts of the compiled buckets as fractions of the batch, descending and
    starting at 1.0; rows move to the next bucket (compacted, KV cache and proposer state included)
    once no more rows than it holds are active.
  nodes: nodes per row in each bucket, one entry per bucket fraction (what ``goodput.choose``
    picks from measured cost and acceptance); overrides node_budget / max_nodes (still capped by
    the proposer's capacity). 0 runs the plain decode step in that bucket.
  gate: per bucket fraction, None or the break-even expected accepted nodes per active row: a
    step verifies its tree only when the proposer's estimate (``Proposer.expected_gain``) reaches
    it, else it runs the plain decode step (``goodput.choose(..., gated=True)``).
  choices: node counts per row that one compiled program can run, the count of each bucket given
    at run time (``SpecEngine.__call__``'s ``nodes``): every bucket's step is a ``lax.switch``
    over one branch per count, so a new choice (goodput's, per batch) never compiles; the program
    costs about one branch per count to compile. One tuple for every bucket, or one per bucket
    fraction (a bucket with one count compiles no switch); a count a bucket was not compiled for
    runs the bucket's first (the plain step where it has 0). Excludes ``nodes`` and ``gate``.
  """

  node_budget: int = 64
  max_nodes: int = 16
  bucket_fractions: tuple[float, ...] = _buckets.DEFAULT_FRACTIONS
  nodes: tuple[int, ...] | None = None
  gate: tuple[float | None, ...] | None = None
  choices: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = None

  def __post_init__(self):
    check_int(self, "node_budget", 0)
    check_int(self, "max_nodes", 0)
    object.__setattr__(self, "bucket_fractions", _buckets.check_fractions(
        self.bucket_fractions, "SpecConfig.bucket_fractions"))
    nb = len(self.bucket_fractions)
    if self.nodes is not None:
      object.__setattr__(self, "nodes", int_tuple(
          self.nodes, "SpecConfig.nodes", 0, length=nb, count=f"len(bucket_fractions)={nb}"))
    if self.gate is not None:
      gate = tuple(self.gate)
      if len(gate) != nb:
        raise ValueError(f"SpecConfig.gate must hold one None or number >= 0 per bucket fraction "
                         f"({nb}), got {self.gate}")
      object.__setattr__(self, "gate", tuple(
          None if g is None else float_arg(g, f"SpecConfig.gate[{i}]", 0, allow_inf=True)
          for i, g in enumerate(gate)))
    if self.choices is not None:
      per = tuple(self.choices)
      if not per or not all(isinstance(c, (tuple, list)) for c in per):
        per = (per,) * nb
      if len(per) != nb:
        raise ValueError(f"SpecConfig.choices must be one tuple of counts, or one per bucket "
                         f"fraction ({nb}), got {self.choices}")
      checked = []
      for ch in per:
        ch = int_tuple(ch, "SpecConfig.choices", 0)
        if not ch or list(ch) != sorted(set(ch)):
          raise ValueError(f"SpecConfig.choices must be distinct ints >= 0, ascending, got "
                           f"{self.choices}")
        checked.append(ch)
      if self.nodes is not None or self.gate is not None:
        raise ValueError("SpecConfig.choices (node counts chosen at run time) excludes nodes and "
                         f"gate, got nodes={self.nodes}, gate={self.gate}")
      object.__setattr__(self, "choices", tuple(checked))

  @classmethod
  def for_cpu(cls) -> SpecConfig:
    """CPU: a verify forward is compute-bound, its cost growing with every token it holds
    (docs/benchmarks.md, "The engine around proposers"), so 32 nodes per forward: a full batch of
    64 rows decodes plainly (N = 0) and the tree grows as rows finish (the long tail)."""
    return cls(node_budget=32)

  @classmethod
  def for_h200(cls) -> SpecConfig:
    """H200 bf16: verify stays memory-bound up to ~200 tokens per forward (docs/design.md, "The
    node budget")."""
    return cls(node_budget=192, max_nodes=12, topk=(4, 3, 2))

  @classmethod
  def auto(cls, backend: str | None = None) -> SpecConfig:
    """The preset for ``backend`` (default: jax's default backend): :meth:`for_cpu` on a CPU,
    :meth:`for_h200` on a GPU or TPU, where a verify forward is memory-bound up to its ridge
    point. Never a GPU preset on a CPU by accident."""
    import jax
    backend = jax.default_backend() if backend is None else backend
    if backend not in ("cpu", "gpu", "cuda", "rocm", "tpu"):
      raise ValueError(f"SpecConfig.auto: backend must be 'cpu', 'gpu' or 'tpu', got {backend!r}")
    return cls.for_cpu() if backend == "cpu" else cls.for_h200()

  def gate_of(self, batch: int, bucket: int) -> float | None:
    """The gate of the ``bucket``-th kept bucket of a ``batch``-row batch (None: always verify)."""
    if self.gate is None:
      return None
    return self.gate[_buckets.kept_buckets(batch, self.bucket_fractions)[bucket][1]]

  def bucket_shapes(self, batch: int, capacity: int | None = None) -> list[tuple[int, int]]:
    """Static (rows, N) buckets for a batch: rows descending,
    N = min(max_nodes, node_budget // rows, capacity) (with ``nodes``: its entry; with
    ``choices``: the largest, the counts themselves chosen at run time)."""
    kept = _buckets.kept_buckets(batch, self.bucket_fractions)
    if self.choices is not None:  # the largest count each bucket's program can run
      big = lambda i: max(self.choices[i]) if capacity is None else min(capacity,
                                                                         max(self.choices[i]))
      return [(r, big(i)) for r, i in kept]
    if self.nodes is not None:
      cap = max(self.nodes) if capacity is None else capacity
      return [(r, min(cap, self.nodes[i])) for r, i in kept]
    cap = self.max_nodes if capacity is None else min(self.max_nodes, capacity)
    return [(r, min(cap, self.node_budget // r)) for r, _ in kept]
