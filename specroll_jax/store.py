"""Earlier responses to the same prompt, kept on the host for the group-aware lookup (docs/
design.md, "Group-aware lookup": SPEC-RL / DAS-style reuse across epochs, but exact).

``ResponseStore`` keeps, per prompt id, the last ``per_prompt`` responses (each cut to
``max_tokens``) of finished rollout batches, with a fingerprint of the prompt's tokens so that a
store built for another prompt set (or another tokenizer / vocabulary) is refused rather than
silently proposing nonsense. ``context`` gives a batch's [B, K, W] array for
``GroupLookup.context(prior=...)``. Proposals from it are verified like any other: a stored
response that is the row's own future text speeds the row up, it never decides a token.

``state_dict`` / ``from_state_dict`` turn it into a flat dict of numpy arrays (what a
checkpoint stores); ``save`` / ``load`` write one ``.npz`` file atomically.

``StoreState`` is the same store as a fixed-capacity pytree of arrays (what ``SpecRoll``'s state
carries and orbax checkpoints as is): ``store_init``, ``store_add`` and ``store_context`` are its
host functions, with the checks of ``ResponseStore``.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict, deque
from pathlib import Path

import flax.struct
import numpy as np
from jaxtyping import Array, Int


def fingerprint(tokens) -> int:
  """A 63-bit fingerprint of a prompt's token ids."""
  arr = np.asarray(list(tokens), np.int64)
  return int.from_bytes(hashlib.blake2b(arr.tobytes(), digest_size=8).digest(), "little") >> 1


class ResponseStore:
  """Bounded host store of earlier responses, keyed by prompt id.

  per_prompt: responses kept per prompt (the most recent). max_tokens: tokens kept per response.
  max_prompts: prompts kept (least recently added dropped first). vocab_size: the model's; ids
  outside it are refused.
  """

  def __init__(self, *, vocab_size: int, per_prompt: int = 4, max_tokens: int = 256,
               max_prompts: int = 100_000):
    for name, v, lo in (("vocab_size", vocab_size, 1), ("per_prompt", per_prompt, 1),
                        ("max_tokens", max_tokens, 1), ("max_prompts", max_prompts, 1)):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"ResponseStore.{name} must be an int >= {lo}, got {v!r}")
    self.vocab_size, self.per_prompt = int(vocab_size), int(per_prompt)
    self.max_tokens, self.max_prompts = int(max_tokens), int(max_prompts)
    self._fp: dict[int, int] = {}
    self._resp: OrderedDict[int, deque] = OrderedDict()

  def __len__(self) -> int:
    return len(self._resp)

  def responses(self, prompt_id: int) -> list[np.ndarray]:
    """The stored responses of one prompt, oldest first."""
    return list(self._resp.get(int(prompt_id), ()))

  def _check_prompt(self, pid: int, prompt, what: str) -> None:
    fp = fingerprint(prompt)
    old = self._fp.get(pid)
    if old is not None and old != fp:
      raise ValueError(f"{what}: prompt id {pid} is stored with other prompt tokens (fingerprint "
                       f"{old:#x} vs {fp:#x}): a store for another prompt set or tokenizer")

  def add(self, prompt_ids, prompts, tokens, lengths) -> None:
    """Store finished responses: row b (prompt ``prompt_ids[b]``, token ids ``prompts[b]``) with
    response ``tokens[b, :lengths[b]]``."""
    pids = np.asarray(prompt_ids)
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    b = len(pids)
    if len(prompts) != b or tokens.shape[0] != b or lengths.shape != (b,):
      raise ValueError(f"ResponseStore.add: prompt_ids ({b}), prompts ({len(prompts)}), tokens "
                       f"{tokens.shape} and lengths {lengths.shape} must agree on the batch size")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
      raise ValueError(f"ResponseStore.add: tokens outside [0, vocab_size={self.vocab_size}): "
                       f"range [{tokens.min()}, {tokens.max()}]")
    for i in range(b):
      pid = int(pids[i])
      self._check_prompt(pid, prompts[i], "ResponseStore.add")
      self._fp[pid] = fingerprint(prompts[i])
      q = self._resp.pop(pid, None) or deque(maxlen=self.per_prompt)
      q.append(tokens[i, : min(int(lengths[i]), self.max_tokens)].astype(np.int32).copy())
      self._resp[pid] = q  # most recently added last
    while len(self._resp) > self.max_prompts:
      pid, _ = self._resp.popitem(last=False)
      self._fp.pop(pid, None)

  def context(self, prompt_ids, prompts, *, vocab_size: int) -> np.ndarray:
    """[B, per_prompt, max_tokens] int32 of each row's stored responses (newest first), -1
    padded. ``vocab_size`` (the model's) must be the store's; every prompt must match its stored
    fingerprint."""
    if int(vocab_size) != self.vocab_size:
      raise ValueError(f"ResponseStore holds ids of a {self.vocab_size}-token vocabulary; the "
                       f"model has vocab_size={vocab_size}")
    pids = np.asarray(prompt_ids)
    if len(prompts) != len(pids):
      raise ValueError(f"ResponseStore.context: {len(pids)} prompt ids but {len(prompts)} prompts")
    out = np.full((len(pids), self.per_prompt, self.max_tokens), -1, np.int32)
    for i, pid in enumerate(pids.tolist()):
      self._check_prompt(int(pid), prompts[i], "ResponseStore.context")
      for k, r in enumerate(reversed(self.responses(pid))):
        out[i, k, : len(r)] = r
    return out

  # -- checkpointing

  def state_dict(self) -> dict:
    """Flat numpy arrays: ids [P], fingerprints [P], counts [P], tokens [P, K, W] (-1 padded)."""
    ids = np.asarray(list(self._resp), np.int64)
    toks = np.full((len(ids), self.per_prompt, self.max_tokens), -1, np.int32)
    counts = np.zeros((len(ids),), np.int32)
    for i, pid in enumerate(ids.tolist()):
      for k, r in enumerate(self._resp[pid]):
        toks[i, k, : len(r)] = r
      counts[i] = len(self._resp[pid])
    return {"ids": ids, "fingerprints": np.asarray([self._fp[p] for p in ids.tolist()], np.int64),
            "counts": counts, "tokens": toks,
            "config": np.asarray([self.vocab_size, self.per_prompt, self.max_tokens,
                                  self.max_prompts], np.int64)}

  @classmethod
  def from_state_dict(cls, d: dict) -> ResponseStore:
    vocab, per, width, maxp = (int(x) for x in np.asarray(d["config"]))
    st = cls(vocab_size=vocab, per_prompt=per, max_tokens=width, max_prompts=maxp)
    toks = np.asarray(d["tokens"])
    for i, pid in enumerate(np.asarray(d["ids"]).tolist()):
      q = deque(maxlen=per)
      for k in range(int(np.asarray(d["counts"])[i])):
        r = toks[i, k]
        q.append(r[r >= 0].astype(np.int32))
      st._resp[int(pid)] = q
      st._fp[int(pid)] = int(np.asarray(d["fingerprints"])[i])
    return st

  def save(self, path) -> None:
    """Write to ``path`` (.npz) atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **self.state_dict())
    os.replace(tmp, path)

  @classmethod
  def load(cls, path) -> ResponseStore:
    with np.load(Path(path)) as z:
      return cls.from_state_dict({k: z[k] for k in z.files})


@flax.struct.dataclass
class StoreState:
  """Earlier responses per prompt in fixed-capacity arrays (a pytree; host functions below).

  prompt_ids [S] (-1: empty slot), fingerprints [S] (31-bit fingerprint of the prompt's tokens),
  count [S] responses held, tokens [S, K, W] (-1 padded, oldest first), stamp [S] the last
  ``clock`` at which the slot was written (the least recent slot is reused first), clock [].
  vocab_size (static): ids must lie below it; a store for another vocabulary is refused.
  """

  prompt_ids: Int[Array, " S"]
  fingerprints: Int[Array, " S"]
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


def store_init(*, vocab_size: int, prompts: int, per_prompt: int, max_tokens: int) -> StoreState:
  """An empty store of ``prompts`` slots, each holding the last ``per_prompt`` responses of one
  prompt cut to ``max_tokens``."""
  ResponseStore(vocab_size=vocab_size, per_prompt=per_prompt, max_tokens=max_tokens,
                max_prompts=prompts)  # the same checks
  i32 = lambda *shape, v=0: np.full(shape, v, np.int32)
  return StoreState(prompt_ids=i32(prompts, v=-1), fingerprints=i32(prompts), count=i32(prompts),
                    tokens=i32(prompts, per_prompt, max_tokens, v=-1), stamp=i32(prompts),
                    clock=np.int32(0), vocab_size=int(vocab_size))


def _fp31(tokens) -> int:
  return fingerprint(tokens) & 0x7FFFFFFF


def _slots(st: StoreState) -> dict[int, int]:
  ids = np.asarray(st.prompt_ids)
  return {int(p): i for i, p in enumerate(ids.tolist()) if p >= 0}


def store_add(st: StoreState, prompt_ids, prompts, tokens, lengths) -> StoreState:
  """``st`` with row b's response ``tokens[b, :lengths[b]]`` (prompt ``prompt_ids[b]``, token ids
  ``prompts[b]``) appended to its prompt's responses (the oldest dropped past ``per_prompt``); a
  new prompt takes the least recently written slot."""
  pids = np.asarray(prompt_ids)
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  b = len(pids)
  if len(prompts) != b or tokens.shape[0] != b or lengths.shape != (b,):
    raise ValueError(f"store_add: prompt_ids ({b}), prompts ({len(prompts)}), tokens "
                     f"{tokens.shape} and lengths {lengths.shape} must agree on the batch size")
  if tokens.size and (tokens.min() < 0 or tokens.max() >= st.vocab_size):
    raise ValueError(f"store_add: tokens outside [0, vocab_size={st.vocab_size}): range "
                     f"[{tokens.min()}, {tokens.max()}]")
  ids, fps, cnt, toks, stamp = (np.array(x) for x in (st.prompt_ids, st.fingerprints, st.count,
                                                        st.tokens, st.stamp))
  clock = int(st.clock)
  slots = _slots(st)
  k, w = st.per_prompt, st.max_tokens
  for i in range(b):
    pid, fp = int(pids[i]), _fp31(prompts[i])
    slot = slots.get(pid)
    if slot is not None and fps[slot] != fp:
      raise ValueError(f"store_add: prompt id {pid} is stored with other prompt tokens (a store "
                       "for another prompt set or tokenizer)")
    if slot is None:
      slot = int(np.argmin(np.where(ids < 0, -1, stamp)))
      slots.pop(int(ids[slot]), None)
      ids[slot], fps[slot], cnt[slot] = pid, fp, 0
      toks[slot] = -1
      slots[pid] = slot
    n = min(int(lengths[i]), w)
    row = np.full((w,), -1, np.int32)
    row[:n] = tokens[i, :n]
    if cnt[slot] == k:
      toks[slot, :-1] = toks[slot, 1:].copy()
      toks[slot, -1] = row
    else:
      toks[slot, cnt[slot]] = row
      cnt[slot] += 1
    clock += 1
    stamp[slot] = clock
  return st.replace(prompt_ids=ids, fingerprints=fps, count=cnt, tokens=toks, stamp=stamp,
                    clock=np.int32(clock))


def store_context(st: StoreState, prompt_ids, prompts, *, vocab_size: int) -> np.ndarray:
  """[B, K, W] int32: row b's stored responses (newest first), -1 padded, for
  ``GroupLookup.context(prior=...)``. ``vocab_size`` must be the store's; a prompt id stored with
  other prompt tokens is refused."""
  if int(vocab_size) != st.vocab_size:
    raise ValueError(f"the response store holds ids of a {st.vocab_size}-token vocabulary; the "
                     f"model has vocab_size={vocab_size}")
  pids = np.asarray(prompt_ids)
  if len(prompts) != len(pids):
    raise ValueError(f"store_context: {len(pids)} prompt ids but {len(prompts)} prompts")
  slots = _slots(st)
  fps, cnt, toks = np.asarray(st.fingerprints), np.asarray(st.count), np.asarray(st.tokens)
  out = np.full((len(pids), st.per_prompt, st.max_tokens), -1, np.int32)
  for i, pid in enumerate(pids.tolist()):
    slot = slots.get(int(pid))
    if slot is None:
      continue
    if fps[slot] != _fp31(prompts[i]):
      raise ValueError(f"store_context: prompt id {pid} is stored with other prompt tokens (a "
                       "store for another prompt set or tokenizer)")
    c = int(cnt[slot])
    out[i, :c] = toks[slot, :c][::-1]
  return out


__all__ = ["ResponseStore", "StoreState", "fingerprint", "store_add", "store_context",
           "store_init"]
