"""Root-conditioned future-token heads (Hydra-style), pure functions over a typed params pytree
(docs/design.md, "Root-conditioned heads").

A Medusa head sees only the anchor's hidden state, so it must average over every root the target
may sample; at T = 1 the root is the main unknown. Head k here also reads the tokens of the path
it extends: the root (depth 0, the target's own sample, already known when a tree is built) and
the path tokens at depths 1..k-1, through the target's own (frozen) input embedding:

    u_k = RMSNorm(h; g_k) W^h_k + sum_{j < k} RMSNorm(E[x_j]; e_k) W^e_{k,j} + b_k
    z_k = h + SiLU(u_k) W^o_k                    (W^o zero-initialised: z_k = h at init)
    logits_k = Unembed(FinalNorm(z_k))           (the target's final norm and unembedding, frozen)

h is the anchor's pre-norm hidden state (the one whose unembedding gives the root), x_0 the root,
x_j the path token at depth j; head k predicts the token at depth k. Still no KV cache and no
separate drafter: a head is one MLP and one unembedding. Trees expand depth by depth from the best
partial paths (``proposers/ranked_heads.py``).

Training is self-distillation on the target's own rollouts, teacher-forced on the sampled path:
head k at anchor j reads tokens j..j+k-1 and is fitted to the target's sampling distribution at
token j + k (soft labels: the unembedding of the rollout's own recorded hidden state there, at the
rollout's temperature and top-k/top-p; no extra target forward), plus the sampled token itself.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from specroll_jax import sampling as _sampling
from specroll_jax._fields import int_arg
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig

KIND = "root-conditioned"


@flax.struct.dataclass
class CondHeads:
  norm_h: Float[Array, "K D"]  # RMSNorm scale of the anchor hidden state, per head
  norm_e: Float[Array, "K D"]  # RMSNorm scale of the context token embeddings, per head
  w_h: Float[Array, "K D Dff"]
  w_e: Float[Array, "K K D Dff"]  # [head, context slot j (0 = root), D, Dff]; slots j >= k unused
  b: Float[Array, "K Dff"]
  w_o: Float[Array, "K Dff D"]
  vocab_size: int = flax.struct.field(pytree_node=False)

  @property
  def num_heads(self) -> int:
    return self.w_h.shape[0]

  @property
  def hidden_size(self) -> int:
    return self.w_h.shape[1]

  @property
  def width(self) -> int:
    return self.w_h.shape[2]


def init(key, config: ModelConfig, num_heads: int = 3, *, width: int | None = None,
         scale: float | None = None) -> CondHeads:
  """K heads for ``config`` with MLP width Dff (default 2 D). Input weights ~ N(0, scale^2)
  (default 1/sqrt(D)); the output weights start at zero (each head starts as the identity)."""
  num_heads = int_arg(num_heads, "num_heads", 1)
  d, dt = config.hidden_size, config.jnp_dtype
  f = 2 * d if width is None else int_arg(width, "width", 1)
  s = d ** -0.5 if scale is None else scale
  kh, ke = jax.random.split(key)
  k = num_heads
  return CondHeads(norm_h=jnp.ones((k, d), dt), norm_e=jnp.ones((k, d), dt),
                   w_h=(s * jax.random.normal(kh, (k, d, f))).astype(dt),
                   w_e=(s * jax.random.normal(ke, (k, k, d, f))).astype(dt),
                   b=jnp.zeros((k, f), dt), w_o=jnp.zeros((k, f, d), dt),
                   vocab_size=config.vocab_size)


def validate(config: ModelConfig, heads: CondHeads, num_heads: int | None = None) -> None:
  """Raise ValueError when the heads do not fit the model (hidden size, vocab, head count)."""
  if not isinstance(heads, CondHeads):
    raise ValueError(f"heads must be a specroll_jax.heads.conditioned.CondHeads, got "
                     f"{type(heads).__name__}")
  if heads.hidden_size != config.hidden_size:
    raise ValueError(f"heads hidden size {heads.hidden_size} does not match the model's "
                     f"hidden_size {config.hidden_size}")
  if heads.vocab_size != config.vocab_size:
    raise ValueError(f"heads vocab_size {heads.vocab_size} does not match the model's vocab_size "
                     f"{config.vocab_size}")
  if num_heads is not None and heads.num_heads != num_heads:
    raise ValueError(f"heads has {heads.num_heads} heads, expected {num_heads}")


def embed(config: ModelConfig, params, tokens):
  """The target's input embedding of token ids (any shape) [..., D]."""
  return jnp.take(params["embed"]["embedding"], jnp.clip(tokens, 0, config.vocab_size - 1), axis=0)


def head_state(config: ModelConfig, params, heads: CondHeads, k: int,
               h: Float[Array, "... D"], ctx: Int[Array, "... C"]) -> Float[Array, "... D"]:
  """z of head ``k`` (1-based, static) at anchor states ``h`` with context tokens ``ctx``
  (ctx[..., 0] the root, ctx[..., j] the path token at depth j; the first k are read)."""
  i = k - 1
  eps = config.rms_norm_eps
  u = jnp.einsum("...d,df->...f", _dec.rms_norm(h, heads.norm_h[i], eps), heads.w_h[i]) + heads.b[i]
  e = _dec.rms_norm(embed(config, params, ctx[..., :k]), heads.norm_e[i], eps)  # [..., k, D]
  u = u + jnp.einsum("...jd,jdf->...f", e, heads.w_e[i, :k])
  return h + jnp.einsum("...f,fd->...d", jax.nn.silu(u), heads.w_o[i]).astype(h.dtype)


def states(config: ModelConfig, params, heads: CondHeads, h: Float[Array, "... D"],
           ctx: Int[Array, "... K"]) -> Float[Array, "... K D"]:
  """z of every head along one path: head k reads ctx[..., :k] (teacher forcing)."""
  return jnp.stack([head_state(config, params, heads, k, h, ctx)
                    for k in range(1, heads.num_heads + 1)], axis=-2)


def apply(config: ModelConfig, params, heads: CondHeads, h, ctx) -> Float[Array, "... K V"]:
  """Logits (f32) of every head along the path ``ctx``: [..., K, V]."""
  return _dec.logits_from_hidden(config, params, states(config, params, heads, h, ctx))


# ---------------------------------------------------------------------------------------------
# Self-distillation on the target's own rollouts


def training_examples(tokens, lengths, num_heads: int):
  """Indices of the examples in rollouts (tokens [B, M], lengths [B]): (anchor index [A] into
  the flattened [B * M] hidden states, context tokens [A, K], target-anchor index [A, K] (the
  hidden state whose unembedding is head k's soft label), labels [A, K], mask [A, K]).

  hidden[b, j] is the anchor of response token j (``generate`` with
  ``DecodeOptions(return_hidden=True)``); head k at anchor j reads tokens j..j+k-1 and predicts
  token j + k, whose distribution is the unembedding of hidden[b, j + k].
  """
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  b, m = tokens.shape
  j = np.arange(m)
  ks = np.arange(num_heads)
  ctx_idx = np.minimum(j[:, None] + ks[None], m - 1)  # [M, K]
  lab_idx = np.minimum(j[:, None] + ks[None] + 1, m - 1)
  mask = (j[:, None] + ks[None] + 1)[None] < lengths[:, None, None]  # [B, M, K]
  anchors = mask[..., 0]
  bb, jj = np.nonzero(anchors)
  flat = lambda idx: bb[:, None] * m + idx[jj]
  return (bb * m + jj, tokens[bb[:, None], ctx_idx[jj]].astype(np.int32),
          flat(lab_idx), tokens[bb[:, None], lab_idx[jj]].astype(np.int32), mask[bb, jj])


def head_weights(num_heads: int) -> np.ndarray:
  """Per-head loss weights 0.8^(k-1), normalised to sum to 1."""
  w = 0.8 ** np.arange(num_heads)
  return (w / w.sum()).astype(np.float32)


def loss_fn(config: ModelConfig, params, heads: CondHeads, h, ctx, h_label, labels, mask,
            sampling: _sampling.SamplingConfig, soft_weight: float, tv_weight: float = 0.0):
  """soft_weight * CE(target's sampling distribution, head) + (1 - soft_weight) * CE(sampled
  token) + tv_weight * TV(target, head under the sampling rule), per head, weighted; returns
  (loss, per-head soft CE [K], per-head token CE [K]). The TV term rewards what coupled drafts
  are accepted by (docs/design.md, "Drafts coupled to the noise")."""
  logits = apply(config, params, heads, h, ctx)  # [A, K, V]
  logq = jax.nn.log_softmax(logits, axis=-1)
  target_logits = _dec.logits_from_hidden(config, params, h_label)  # [A, K, V]
  if sampling.greedy:
    p = jax.nn.one_hot(labels, logits.shape[-1])
  else:
    p = jax.nn.softmax(_sampling.allowed_logits(target_logits, sampling), axis=-1)
  soft = -(p * logq).sum(-1)
  hard = -jnp.take_along_axis(logq, labels[..., None], axis=-1)[..., 0]
  den = jnp.maximum(mask.sum(0), 1)
  soft_k = (soft * mask).sum(0) / den
  hard_k = (hard * mask).sum(0) / den
  per = soft_weight * soft_k + (1 - soft_weight) * hard_k
  if tv_weight > 0:
    q = jax.nn.softmax(_sampling.allowed_logits(logits, sampling), axis=-1)
    per = per + tv_weight * (0.5 * jnp.abs(p - q).sum(-1) * mask).sum(0) / den
  w = head_weights(heads.num_heads)
  return jnp.sum(w * per), (soft_k, hard_k)


def fit(config: ModelConfig, params, heads: CondHeads, tokens, lengths, hidden, *,
        sampling: _sampling.SamplingConfig, steps: int = 600, batch_size: int = 256,
        learning_rate: float = 3e-3, soft_weight: float = 0.8, weight_decay: float = 0.0,
        tv_weight: float = 1.0, seed: int = 0, progress: bool = True):
  """Fit the heads on the target's own rollouts (tokens [B, M], lengths [B], hidden [B, M, D]
  from ``generate`` with ``DecodeOptions(return_hidden=True)`` at ``sampling``). Optax AdamW
  with cosine decay; the loss is ``loss_fn``'s (``tv_weight``: its total-variation term, 1 by
  default: it raises coupled acceptance on held-out rollouts, docs/benchmarks.md "Drafts coupled
  to the noise").
  Returns (heads, per-head soft CE history [steps, K])."""
  validate(config, heads)
  if steps <= 0 or batch_size <= 0:
    raise ValueError(f"steps and batch_size must be > 0, got steps={steps}, "
                     f"batch_size={batch_size}")
  if not 0.0 <= soft_weight <= 1.0:
    raise ValueError(f"soft_weight must be in [0, 1], got {soft_weight}")
  if not tv_weight >= 0.0:
    raise ValueError(f"tv_weight must be >= 0, got {tv_weight}")
  hidden = np.asarray(hidden)
  flat = hidden.reshape(-1, hidden.shape[-1])
  anchor, ctx, lab_idx, labels, mask = training_examples(tokens, lengths, heads.num_heads)
  if len(anchor) == 0:
    raise ValueError("fit: the rollouts hold no anchor with a label (all lengths <= 1)")
  tx = optax.adamw(optax.cosine_decay_schedule(learning_rate, steps), weight_decay=weight_decay)
  opt = tx.init(heads)
  rng = np.random.default_rng(seed)

  @jax.jit
  def update(heads, opt, h, c, hl, lb, mk):
    (_, (soft_k, _)), g = jax.value_and_grad(
        lambda hd: loss_fn(config, params, hd, h, c, hl, lb, mk, sampling, soft_weight,
                           tv_weight),
        has_aux=True)(heads)
    upd, opt = tx.update(g, opt, heads)
    return optax.apply_updates(heads, upd), opt, soft_k

  from specroll_jax.progress import progress_range
  history = []
  for _ in progress_range(steps, "fit root-conditioned heads", enabled=progress):
    sel = rng.integers(0, len(anchor), size=min(batch_size, len(anchor)))
    heads, opt, soft_k = update(heads, opt, jnp.asarray(flat[anchor[sel]]), jnp.asarray(ctx[sel]),
                                jnp.asarray(flat[lab_idx[sel]]), jnp.asarray(labels[sel]),
                                jnp.asarray(mask[sel]))
    history.append(soft_k)
  return heads, np.asarray(jax.device_get(jnp.stack(history)))


@dataclasses.dataclass(frozen=True)
class HitRates:
  """Head 1's held-out quality (``hit_rates``) over ``anchors`` anchors, per k in ``ks``: hit (the
  share of anchors whose next-but-one sampled token is in the head's top-k), mass (the target mass
  the head's top-k hold: its expected hit) and bound (the mass of the target's own top-k)."""

  anchors: int
  ks: tuple[int, ...]
  hit: tuple[float, ...]
  mass: tuple[float, ...]
  bound: tuple[float, ...]

  def at(self, k: int) -> tuple[float, float, float]:
    """(hit, mass, bound) at top-k (k one of ``ks``)."""
    i = self.ks.index(k)
    return self.hit[i], self.mass[i], self.bound[i]

  def to_dict(self) -> dict:
    """Plain values for a JSON file: anchors and "hit@k", "mass@k", "bound@k" per k."""
    out = {"anchors": self.anchors}
    for k, h, m, b in zip(self.ks, self.hit, self.mass, self.bound, strict=True):
      out.update({f"hit@{k}": h, f"mass@{k}": m, f"bound@{k}": b})
    return out


def hit_rates(config: ModelConfig, params, heads, tokens, lengths, hidden, *,
              sampling: _sampling.SamplingConfig, ks=(1, 4), batch: int = 512) -> HitRates:
  """Held-out quality of head 1 against the bound, on rollouts at ``sampling``: for each k in
  ``ks``, the share of anchors whose next-but-one sampled token is in the head's top-k ("hit"),
  the target mass the head's top-k hold (its expected hit), and the bound: the mass of the
  target's own top-k. Works for ``CondHeads`` and Medusa ``heads.Heads``."""
  from specroll_jax.heads import medusa as _heads
  hidden = np.asarray(hidden)
  flat = hidden.reshape(-1, hidden.shape[-1])
  anchor, ctx, lab_idx, labels, mask = training_examples(tokens, lengths, 1)
  kmax = max(ks)

  @jax.jit
  def chunk(h, c, hl):
    if isinstance(heads, CondHeads):
      q = _dec.logits_from_hidden(config, params, head_state(config, params, heads, 1, h, c))
    else:
      q = _heads.apply(config, params, heads, h)[:, 0]
    x = _dec.logits_from_hidden(config, params, hl[:, 0])
    if sampling.greedy:
      p = jax.nn.one_hot(jnp.argmax(x, -1), x.shape[-1])
    else:
      p = jax.nn.softmax(_sampling.allowed_logits(x, sampling), axis=-1)
    qtop = jax.lax.top_k(q, kmax)[1]
    ptop = jax.lax.top_k(p, kmax)[0]
    return qtop, jnp.take_along_axis(p, qtop, axis=-1), ptop

  qtops, qmass, pmass = [], [], []
  for i in range(0, len(anchor), batch):
    s = slice(i, i + batch)
    a, b_, c = chunk(jnp.asarray(flat[anchor[s]]), jnp.asarray(ctx[s]),
                     jnp.asarray(flat[lab_idx[s]]))
    qtops.append(np.asarray(a))
    qmass.append(np.asarray(b_))
    pmass.append(np.asarray(c))
  qtop, qm, pm = np.concatenate(qtops), np.concatenate(qmass), np.concatenate(pmass)
  ks = tuple(int(k) for k in ks)
  return HitRates(anchors=int(len(anchor)), ks=ks,
                  hit=tuple(float((qtop[:, :k] == labels[:, :1]).any(1).mean()) for k in ks),
                  mass=tuple(float(qm[:, :k].sum(1).mean()) for k in ks),
                  bound=tuple(float(pm[:, :k].sum(1).mean()) for k in ks))


def save(path, heads: CondHeads) -> None:
  """Write the heads to a safetensors file (atomically: temporary name, then rename)."""
  import os
  import tempfile

  from safetensors.numpy import save_file
  path = os.fspath(path)
  names = ("norm_h", "norm_e", "w_h", "w_e", "b", "w_o")
  tensors = {k: np.asarray(jnp.asarray(getattr(heads, k), jnp.float32)) for k in names}
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
  os.close(fd)
  try:
    save_file(tensors, tmp, metadata={"kind": KIND, "vocab_size": str(heads.vocab_size),
                                      "dtype": str(jnp.dtype(heads.w_h.dtype))})
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def load(path) -> CondHeads:
  """Read heads written by :func:`save`."""
  from safetensors import safe_open
  names = ("norm_h", "norm_e", "w_h", "w_e", "b", "w_o")
  with safe_open(str(path), framework="numpy") as f:
    meta = f.metadata() or {}
    missing = [k for k in names if k not in f.keys()]
    if meta.get("kind") != KIND or "vocab_size" not in meta or missing:
      raise ValueError(f"{path}: not a root-conditioned heads file (kind {meta.get('kind')!r}, "
                       f"missing tensors: {missing})")
    t = {k: f.get_tensor(k) for k in names}
  dt = jnp.dtype(meta.get("dtype", "float32"))
  return CondHeads(**{k: jnp.asarray(t[k], dt) for k in names}, vocab_size=int(meta["vocab_size"]))


def is_file(path) -> bool:
  """Whether ``path`` is a root-conditioned heads file (else, e.g., Medusa ``heads.save``)."""
  from safetensors import safe_open
  with safe_open(str(path), framework="numpy") as f:
    return (f.metadata() or {}).get("kind") == KIND


__all__ = ["CondHeads", "HitRates", "apply", "fit", "head_state", "hit_rates", "init",
           "is_file", "load", "loss_fn", "save", "states", "training_examples", "validate"]
