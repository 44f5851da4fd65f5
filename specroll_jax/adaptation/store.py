"""Earlier responses to the same prompt, kept for the group-aware lookup (docs/design.md,
"Group-aware lookup": SPEC-RL / DAS-style reuse across epochs, but exact).

``StoreState`` keeps, per prompt id, the last ``per_prompt`` responses (each cut to
``max_tokens``) of finished rollout batches in fixed-capacity arrays (a pytree: ``SpecRoll``'s
state carries it and orbax checkpoints it as is), with a fingerprint of the prompt's tokens so
that a store built for another prompt set (or another tokenizer / vocabulary) is refused rather
than silently proposing nonsense. ``store_add`` adds a finished batch (host), ``store_context``
gives a batch's [B, K, W] array for ``GroupLookup.context(prior=...)``. Proposals from it are
verified like any other: a stored response that is the row's own future text speeds the row up, it
never decides a token.
"""

from __future__ import annotations

import hashlib

import flax.struct
import numpy as np
from jaxtyping import Array, Int

from specroll_jax._fields import int_arg


def fingerprint(tokens) -> int:
  """A 63-bit fingerprint of a prompt's token ids."""
  arr = np.asarray(list(tokens), np.int64)
  return int.from_bytes(hashlib.blake2b(arr.tobytes(), digest_size=8).digest(), "little") >> 1


@flax.struct.dataclass
class StoreState:
  """Earlier responses per prompt in fixed-capacity arrays (host functions below).

  prompt_ids [S] (-1: empty slot), fingerprints [S, 2] (``fingerprint`` of the prompt's tokens as
  int32 halves: a checkpoint or a device keeps int32), count [S] responses held, tokens [S, K, W]
  (-1 padded, oldest first), stamp [S] the slot's place in recency order (the least recently
  added prompt is dropped first), clock [] the last stamp given. vocab_size (static): ids must
  lie below it; a store for another vocabulary is refused.
  """

  prompt_ids: Int[Array, " S"]
  fingerprints: Int[Array, "S 2"]  # the 63-bit fingerprint as int32 (high, low) halves
  count: Int[Array, " S"]
  tokens: Int[Array, "S K W"]
  stamp: Int[Array, " S"]
  clock: Int[Array, ""]
  vocab_size: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def capacity(self) -> int:
    return int(np.shape(self.prompt_ids)[0])

  @property
  def per_prompt(self) -> int:
    return int(np.shape(self.tokens)[1])

  @property
  def max_tokens(self) -> int:
    return int(np.shape(self.tokens)[2])

  def __len__(self) -> int:
    return int((np.asarray(self.prompt_ids) >= 0).sum())

  def responses(self, prompt_id: int) -> list[np.ndarray]:
    """The stored responses of one prompt, oldest first."""
    slot = np.flatnonzero(np.asarray(self.prompt_ids) == int(prompt_id))
    if not slot.size:
      return []
    s = int(slot[0])
    return [r[r >= 0] for r in np.asarray(self.tokens)[s, : int(np.asarray(self.count)[s])]]


def store_init(*, vocab_size: int, prompts: int, per_prompt: int, max_tokens: int) -> StoreState:
  """An empty store of ``prompts`` slots, each holding the last ``per_prompt`` responses of one
  prompt cut to ``max_tokens``."""
  vocab_size = int_arg(vocab_size, "store vocab_size", 1)
  n, k, w = (int_arg(v, f"store {name}", 1) for v, name in (
      (prompts, "prompts"), (per_prompt, "per_prompt"), (max_tokens, "max_tokens")))
  i32 = lambda *shape, v=0: np.full(shape, v, np.int32)
  return StoreState(prompt_ids=i32(n, v=-1), fingerprints=i32(n, 2), count=i32(n),
                    tokens=i32(n, k, w, v=-1), stamp=i32(n), clock=i32(), vocab_size=vocab_size)


def _halves(fp: int) -> tuple[int, int]:
  return fp >> 32, int(np.uint32(fp & 0xFFFFFFFF).view(np.int32))


def _check_prompt(st: StoreState, ids, fps, pid: int, prompt, what: str) -> int | None:
  """The slot of ``pid`` (None: not held); ValueError if it is held with other prompt tokens."""
  slot = np.flatnonzero(ids == pid)
  if not slot.size:
    return None
  s = int(slot[0])
  held, fp = tuple(int(x) for x in fps[s]), fingerprint(prompt)
  if held != _halves(fp):
    raise ValueError(f"{what}: prompt id {pid} is stored with other prompt tokens: a store for "
                     "another prompt set or tokenizer")
  return s


def store_add(st: StoreState, prompt_ids, prompts, tokens, lengths) -> StoreState:
  """``st`` with row b's response ``tokens[b, :lengths[b]]`` (prompt ``prompt_ids[b]``, token ids
  ``prompts[b]``) added: the oldest response of a prompt dropped past ``per_prompt``, the least
  recently added prompts past capacity once the batch is in."""
  pids = np.asarray(prompt_ids)
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  b = len(pids)
  if len(prompts) != b or tokens.shape[0] != b or lengths.shape != (b,):
    raise ValueError(f"store_add: prompt_ids ({b}), prompts ({len(prompts)}), tokens "
                     f"{tokens.shape} and lengths {lengths.shape} must agree on the batch size")
  if tokens.size and (tokens.min() < 0 or tokens.max() >= st.vocab_size):
    raise ValueError(f"store_add: tokens outside [0, vocab_size={st.vocab_size}): range "
                     f"[{tokens.min()}, {tokens.max()}]")
  k, w = st.per_prompt, st.max_tokens
  # the batch's new prompts may pass the capacity before the oldest leave: work on room for both
  extra = len(set(pids.tolist()))
  grow = lambda x, v: np.concatenate([np.asarray(x), np.full((extra,) + np.shape(x)[1:], v,
                                                             np.int32)])
  ids, fps, cnt = grow(st.prompt_ids, -1), grow(st.fingerprints, 0), grow(st.count, 0)
  toks, stamp, clock = grow(st.tokens, -1), grow(st.stamp, 0), int(st.clock)
  for i in range(b):
    pid = int(pids[i])
    s = _check_prompt(st, ids, fps, pid, prompts[i], "store_add")
    if s is None:
      s = int(np.flatnonzero(ids < 0)[0])
      ids[s], fps[s], cnt[s], toks[s] = pid, _halves(fingerprint(prompts[i])), 0, -1
    if cnt[s] == k:  # the oldest response leaves
      toks[s, :-1], cnt[s] = toks[s, 1:].copy(), k - 1
    resp = tokens[i, : min(int(lengths[i]), w)]
    toks[s, cnt[s]] = -1
    toks[s, cnt[s], : len(resp)] = resp
    cnt[s] += 1
    clock += 1
    stamp[s] = clock  # most recently added last
  held = np.flatnonzero(ids >= 0)
  keep = held[np.argsort(stamp[held], kind="stable")][-st.capacity:]  # (recency order)
  out = store_init(vocab_size=st.vocab_size, prompts=st.capacity, per_prompt=k, max_tokens=w)
  n = len(keep)
  parts = [np.array(x) for x in (out.prompt_ids, out.fingerprints, out.count, out.tokens,
                                  out.stamp)]
  for dst, src in zip(parts, (ids, fps, cnt, toks, stamp), strict=True):
    dst[:n] = src[keep]
  return st.replace(prompt_ids=parts[0], fingerprints=parts[1], count=parts[2], tokens=parts[3],
                    stamp=parts[4], clock=np.asarray(clock, np.int32))


def store_context(st: StoreState, prompt_ids, prompts, *, vocab_size: int) -> np.ndarray:
  """[B, K, W] int32: row b's stored responses (newest first), -1 padded, for
  ``GroupLookup.context(prior=...)``. ``vocab_size`` (the model's) must be the store's; a prompt
  id stored with other prompt tokens is refused."""
  if int(vocab_size) != st.vocab_size:
    raise ValueError(f"the store holds ids of a {st.vocab_size}-token vocabulary; the model has "
                     f"vocab_size={vocab_size}")
  pids = np.asarray(prompt_ids)
  if len(prompts) != len(pids):
    raise ValueError(f"store_context: {len(pids)} prompt ids but {len(prompts)} prompts")
  ids, fps = np.asarray(st.prompt_ids), np.asarray(st.fingerprints)
  cnt, toks = np.asarray(st.count), np.asarray(st.tokens)
  out = np.full((len(pids), st.per_prompt, st.max_tokens), -1, np.int32)
  for i, pid in enumerate(pids.tolist()):
    s = _check_prompt(st, ids, fps, int(pid), prompts[i], "store_context")
    if s is not None:
      out[i, : cnt[s]] = toks[s, : cnt[s]][::-1]
  return out


__all__ = ["StoreState", "fingerprint", "store_add", "store_context", "store_init"]
