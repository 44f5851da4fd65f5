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

from specroll_jax._fields import int_arg


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
    self.vocab_size = int_arg(vocab_size, "ResponseStore.vocab_size", 1)
    self.per_prompt = int_arg(per_prompt, "ResponseStore.per_prompt", 1)
    self.max_tokens = int_arg(max_tokens, "ResponseStore.max_tokens", 1)
    self.max_prompts = int_arg(max_prompts, "ResponseStore.max_prompts", 1)
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

  prompt_ids [S] (-1: empty slot), fingerprints [S, 2] (``fingerprint`` of the prompt's tokens as
  int32 halves: a checkpoint or a device keeps int32),
  count [S] responses held, tokens [S, K, W] (-1 padded, oldest first), stamp [S] the slot's
  place in recency order (the least recently added prompt is dropped first), clock [] prompts
  held. The host functions go through ``ResponseStore``, so both behave alike.
  vocab_size (static): ids must lie below it; a store for another vocabulary is refused.
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


def store_init(*, vocab_size: int, prompts: int, per_prompt: int, max_tokens: int) -> StoreState:
  """An empty store of ``prompts`` slots, each holding the last ``per_prompt`` responses of one
  prompt cut to ``max_tokens``."""
  ResponseStore(vocab_size=vocab_size, per_prompt=per_prompt, max_tokens=max_tokens,
                max_prompts=prompts)  # the same checks
  i32 = lambda *shape, v=0: np.full(shape, v, np.int32)
  return StoreState(prompt_ids=i32(prompts, v=-1), fingerprints=i32(prompts, 2),
                    count=i32(prompts),
                    tokens=i32(prompts, per_prompt, max_tokens, v=-1), stamp=i32(prompts),
                    clock=np.int32(0), vocab_size=int(vocab_size))


def _to_store(st: StoreState) -> ResponseStore:
  """The ``ResponseStore`` holding ``st``'s prompts in the same recency order."""
  ids = np.asarray(st.prompt_ids)
  occupied = np.flatnonzero(ids >= 0)
  order = occupied[np.argsort(np.asarray(st.stamp)[occupied], kind="stable")]
  cfg = np.asarray([st.vocab_size, st.per_prompt, st.max_tokens, st.capacity], np.int64)
  halves = np.asarray(st.fingerprints)[order].astype(np.int64)
  fps = (halves[:, 0] << 32) | (halves[:, 1] & 0xFFFFFFFF)
  return ResponseStore.from_state_dict({
      "ids": ids[order].astype(np.int64), "fingerprints": fps,
      "counts": np.asarray(st.count)[order], "tokens": np.asarray(st.tokens)[order],
      "config": cfg})


def _from_store(ref: ResponseStore, st: StoreState) -> StoreState:
  d = ref.state_dict()
  n, cap = len(d["ids"]), st.capacity
  out = store_init(vocab_size=st.vocab_size, prompts=cap, per_prompt=st.per_prompt,
                   max_tokens=st.max_tokens)
  ids, fps, cnt, toks, stamp = (np.array(x) for x in (out.prompt_ids, out.fingerprints,
                                                        out.count, out.tokens, out.stamp))
  f = np.asarray(d["fingerprints"], np.int64)
  fps[:n, 0], fps[:n, 1] = f >> 32, (f & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
  ids[:n], cnt[:n], toks[:n] = d["ids"], d["counts"], d["tokens"]
  stamp[:n] = np.arange(1, n + 1)
  return st.replace(prompt_ids=ids, fingerprints=fps, count=cnt, tokens=toks, stamp=stamp,
                    clock=np.int32(n))


def store_add(st: StoreState, prompt_ids, prompts, tokens, lengths) -> StoreState:
  """``st`` with row b's response ``tokens[b, :lengths[b]]`` (prompt ``prompt_ids[b]``, token ids
  ``prompts[b]``) added as ``ResponseStore.add`` adds it (its checks; the oldest response of a
  prompt dropped past ``per_prompt``, the least recently added prompt past capacity)."""
  ref = _to_store(st)
  ref.add(prompt_ids, prompts, tokens, lengths)
  return _from_store(ref, st)


def store_context(st: StoreState, prompt_ids, prompts, *, vocab_size: int) -> np.ndarray:
  """[B, K, W] int32: row b's stored responses (newest first), -1 padded, for
  ``GroupLookup.context(prior=...)`` (``ResponseStore.context``: ``vocab_size`` must be the
  store's; a prompt id stored with other prompt tokens is refused)."""
  return _to_store(st).context(prompt_ids, prompts, vocab_size=vocab_size)


__all__ = ["ResponseStore", "StoreState", "fingerprint", "store_add", "store_context",
           "store_init"]
