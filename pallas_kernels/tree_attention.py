"""Tree-verify attention: queries = one step's tokens, keys = valid KV cache prefix + the step's own K/V.

Shapes (dimension legend in ``specroll_jax/__init__.py``):
  q        [B, T, H, Dh]    the step's queries (T = N + 1 tree nodes, or any chunk of new tokens)
  k_cache  [B, L, Hkv, Dh]  KV cache; only the first ``cache_lengths[b]`` positions of row b are valid
  v_cache  [B, L, Hkv, Dh]
  cache_lengths [B] int32
  k_new    [B, T, Hkv, Dh]  the step's own keys/values
  v_new    [B, T, Hkv, Dh]
  tree_mask [B, T, T] bool  query i may attend new key j (ancestor-or-self for a tree, causal for a chunk)
  -> out   [B, T, H, Dh] in q.dtype

GQA: query head h reads kv head h // (H // Hkv). A query row with no allowed key returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def tree_attention_reference(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, *,
                             scale: float | None = None):
  """Plain-jnp tree attention, computed in float32 (the kernel's reference; CPU production path)."""
  b, t, h, dh = q.shape
  hkv = k_cache.shape[2]
  g = h // hkv
  scale = dh ** -0.5 if scale is None else scale
  f32 = jnp.float32
  qg = q.astype(f32).reshape(b, t, hkv, g, dh)
  s_cache = jnp.einsum("btkgd,blkd->bkgtl", qg, k_cache.astype(f32)) * scale
  s_new = jnp.einsum("btkgd,bskd->bkgts", qg, k_new.astype(f32)) * scale
  valid_cache = jnp.arange(k_cache.shape[1])[None, :] < cache_lengths[:, None]  # [B, L]
  s_cache = jnp.where(valid_cache[:, None, None, None, :], s_cache, _NEG)
  s_new = jnp.where(tree_mask[:, None, None, :, :], s_new, _NEG)
  s = jnp.concatenate([s_cache, s_new], axis=-1)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  allowed = jnp.concatenate(
      [jnp.broadcast_to(valid_cache[:, None, None, None, :], s_cache.shape),
       jnp.broadcast_to(tree_mask[:, None, None, :, :], s_new.shape)], axis=-1)
  p = jnp.where(allowed, p, 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0, 1.0, denom)
  lc = k_cache.shape[1]
  out = (jnp.einsum("bkgtl,blkd->btkgd", p[..., :lc], v_cache.astype(f32))
         + jnp.einsum("bkgts,bskd->btkgd", p[..., lc:], v_new.astype(f32)))
  return out.reshape(b, t, h, dh).astype(q.dtype)


tree_attention_reference_jit = jax.jit(tree_attention_reference, static_argnames=("scale",))
