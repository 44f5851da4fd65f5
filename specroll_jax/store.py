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
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict, deque
from pathlib import Path

import numpy as np


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


__all__ = ["ResponseStore", "fingerprint"]
