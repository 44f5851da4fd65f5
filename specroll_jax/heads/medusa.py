"""Future-token heads (Medusa-style), pure functions over a typed params pytree.

Head k (k = 1..K) reads the target's last pre-norm hidden state h at an anchor position a and
predicts the token at a + k + 1 (the target's own unembedding predicts a + 1):

    z_k = h + SiLU(RMSNorm_k(h) W_k + b_k)      (W_k, b_k zero-initialised: z_k = h at init)
    logits_k = Unembed(FinalNorm(z_k))           (the target's final norm and unembedding, frozen)

All K heads share one unembedding matmul over the stacked [..., K, D] states.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float

from specroll_jax._fields import int_arg
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig


@flax.struct.dataclass
class Heads:
  norm: Float[Array, "K D"]  # RMSNorm scale of each head's input
  w: Float[Array, "K D D"]  # [in, out]
  b: Float[Array, "K D"]
  vocab_size: int = flax.struct.field(pytree_node=False)  # vocab of the model they were made for

  @property
  def num_heads(self) -> int:
    return self.w.shape[0]

  @property
  def hidden_size(self) -> int:
    return self.w.shape[1]


def init(key, config: ModelConfig, num_heads: int = 3, *, scale: float = 0.0) -> Heads:
  """K heads for ``config``. ``scale`` = 0 gives the zero init (each head starts as the identity);
  ``scale`` > 0 draws W, b ~ N(0, scale^2) (random, untrained heads)."""
  num_heads = int_arg(num_heads, "num_heads", 1)
  d, dt = config.hidden_size, config.jnp_dtype
  kw, kb = jax.random.split(key)
  w = scale * jax.random.normal(kw, (num_heads, d, d), jnp.float32)
  b = scale * jax.random.normal(kb, (num_heads, d), jnp.float32)
  return Heads(norm=jnp.ones((num_heads, d), dt), w=w.astype(dt), b=b.astype(dt),
               vocab_size=config.vocab_size)


def validate(config: ModelConfig, heads: Heads, num_heads: int | None = None) -> None:
  """Raise ValueError when the heads do not fit the model (hidden size, vocab, head count)."""
  if not isinstance(heads, Heads):
    raise ValueError(f"heads must be a specroll_jax.heads.medusa.Heads, got {type(heads).__name__}")
  if heads.hidden_size != config.hidden_size:
    raise ValueError(
        f"heads hidden size {heads.hidden_size} does not match the model's hidden_size "
        f"{config.hidden_size}")
  if heads.vocab_size != config.vocab_size:
    raise ValueError(
        f"heads vocab_size {heads.vocab_size} does not match the model's vocab_size "
        f"{config.vocab_size}")
  if num_heads is not None and heads.num_heads != num_heads:
    raise ValueError(
        f"heads has {heads.num_heads} heads but SpecConfig.num_heads is {num_heads}")


def head_states(config: ModelConfig, heads: Heads,
                h: Float[Array, "... D"]) -> Float[Array, "... K D"]:
  """z_k = h + SiLU(RMSNorm_k(h) W_k + b_k) for every head: [..., K, D]."""
  x = h[..., None, :]  # [..., 1, D]
  n = _dec.rms_norm(jnp.broadcast_to(x, h.shape[:-1] + heads.norm.shape), heads.norm,
                    config.rms_norm_eps)
  upd = jnp.einsum("...kd,kde->...ke", n, heads.w) + heads.b
  return x + jax.nn.silu(upd)


def apply(config: ModelConfig, params, heads: Heads,
          h: Float[Array, "... D"]) -> Float[Array, "... K V"]:
  """Logits (f32) of every head from pre-norm hidden states h: [..., K, V]."""
  return _dec.logits_from_hidden(config, params, head_states(config, heads, h))


# ---------------------------------------------------------------------------------------------
# Self-distillation on the target's own rollouts


def head_weights(num_heads: int) -> np.ndarray:
  """Per-head loss weights 0.8^(k-1), normalised to sum to 1."""
  w = 0.8 ** np.arange(num_heads)
  return (w / w.sum()).astype(np.float32)


def training_examples(tokens, lengths, hidden, num_heads: int):
  """(anchor hidden [A, D], labels [A, K], label mask [A, K]) from rollouts.

  hidden[b, j] is the anchor preceding response token j (``generate`` with
  ``DecodeOptions(return_hidden=True)``); head k (1-based) at anchor j is labelled with response
  token j + k.
  """
  tokens, lengths, hidden = np.asarray(tokens), np.asarray(lengths), np.asarray(hidden)
  b, m = tokens.shape
  j = np.arange(m)
  ks = np.arange(1, num_heads + 1)
  idx = j[:, None] + ks[None, :]  # [M, K]
  labels = tokens[:, np.minimum(idx, m - 1)]  # [B, M, K]
  mask = idx[None] < lengths[:, None, None]
  anchors = mask[..., 0]  # an anchor is useful when head 1 has a label
  return hidden[anchors], labels[anchors].astype(np.int32), mask[anchors]


def loss_fn(config: ModelConfig, params, heads: Heads, h, labels, mask):
  """Weighted cross-entropy of each head on its token; returns (loss, per-head CE [K])."""
  logits = apply(config, params, heads, h)  # [A, K, V]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [A, K]
  per_head = (ce * mask).sum(0) / jnp.maximum(mask.sum(0), 1)
  return jnp.sum(per_head * head_weights(heads.num_heads)), per_head


def fit_heads(config: ModelConfig, params, heads: Heads, tokens, lengths, hidden, *,
              steps: int = 300, batch_size: int = 256, learning_rate: float = 1e-2, seed: int = 0,
              progress: bool = True):
  """Fit the heads by self-distillation on the target's own rollouts (tokens [B, M], lengths [B],
  hidden [B, M, D] from ``generate`` with ``DecodeOptions(return_hidden=True)``); no extra target
  forward.

  Optimiser: optax AdamW with cosine decay. Returns (heads, per-head CE history [steps, K]).
  """
  validate(config, heads)
  if steps <= 0 or batch_size <= 0:
    raise ValueError(
        f"steps and batch_size must be > 0, got steps={steps}, batch_size={batch_size}")
  h, labels, mask = training_examples(tokens, lengths, hidden, heads.num_heads)
  if len(h) == 0:
    raise ValueError("fit_heads: the rollouts hold no anchor with a label (all lengths <= 1)")
  tx = optax.adamw(optax.cosine_decay_schedule(learning_rate, steps), weight_decay=0.0)
  opt = tx.init(heads)
  rng = np.random.default_rng(seed)

  @jax.jit
  def update(heads, opt, hb, lb, mb):
    (loss, per_head), g = jax.value_and_grad(
        lambda hd: loss_fn(config, params, hd, hb, lb, mb), has_aux=True)(heads)
    upd, opt = tx.update(g, opt, heads)
    return optax.apply_updates(heads, upd), opt, per_head

  history = []
  from specroll_jax.progress import progress_range
  for _ in progress_range(steps, "fit heads", enabled=progress):
    sel = rng.integers(0, len(h), size=min(batch_size, len(h)))
    heads, opt, per_head = update(heads, opt, jnp.asarray(h[sel]), jnp.asarray(labels[sel]),
                                  jnp.asarray(mask[sel]))
    history.append(per_head)
  return heads, np.asarray(jax.device_get(jnp.stack(history)))


def head_accuracy(config: ModelConfig, params, heads: Heads, tokens, lengths, hidden) -> np.ndarray:
  """Top-1 accuracy of each head on held-out rollouts: [K]."""
  h, labels, mask = training_examples(tokens, lengths, hidden, heads.num_heads)
  pred = jnp.argmax(apply(config, params, heads, jnp.asarray(h)), -1)
  hit = (np.asarray(pred) == labels) & mask
  return hit.sum(0) / np.maximum(mask.sum(0), 1)


def save(path, heads: Heads) -> None:
  """Write heads to a safetensors file (atomically: temporary name, then rename)."""
  import os
  import tempfile

  from safetensors.numpy import save_file
  path = os.fspath(path)
  tensors = {k: np.asarray(jnp.asarray(getattr(heads, k), jnp.float32)) for k in ("norm", "w", "b")}
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
  os.close(fd)
  try:
    save_file(tensors, tmp, metadata={"vocab_size": str(heads.vocab_size),
                                      "dtype": str(jnp.dtype(heads.w.dtype))})
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def load(path) -> Heads:
  """Read heads written by :func:`save`."""
  from safetensors import safe_open
  with safe_open(str(path), framework="numpy") as f:
    meta = f.metadata() or {}
    missing = [k for k in ("norm", "w", "b") if k not in f.keys()]
    if "vocab_size" not in meta or missing:
      raise ValueError(f"{path}: not a heads file (vocab_size metadata: {'vocab_size' in meta}, "
                       f"missing tensors: {missing})")
    t = {k: f.get_tensor(k) for k in ("norm", "w", "b")}
  dt = jnp.dtype(meta.get("dtype", "float32"))
  return Heads(norm=jnp.asarray(t["norm"], dt), w=jnp.asarray(t["w"], dt),
               b=jnp.asarray(t["b"], dt), vocab_size=int(meta["vocab_size"]))


__all__ = ["Heads", "apply", "fit_heads", "head_accuracy", "head_states", "head_weights", "init",
           "load", "loss_fn", "save", "training_examples", "validate"]

