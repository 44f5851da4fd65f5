"""A thin wrapper over ``tokenizers.Tokenizer`` that knows its EOS / pad / BOS ids.

``Tokenizer.from_pretrained`` reads a Hugging Face model folder: ``tokenizer.json`` plus whichever
of ``generation_config.json``, ``config.json`` and ``tokenizer_config.json`` exist. ``train_bpe``
builds the small byte-level BPE of the embedded model. ``encode`` adds no special tokens and
``decode`` cuts nothing: callers prepend BOS where a model wants it and cut completions at
``eos_ids``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
_CONFIG_FILES = ("generation_config.json", "config.json")  # searched in this order for *_token_id
# What tokenizer_config.json names so that transformers' AutoTokenizer builds a plain
# PreTrainedTokenizerFast (v5: TokenizersBackend) from tokenizer.json as written. tokenizer_class
# alone is not enough: transformers 5 ignores it for the model types whose own tokenizer class it
# enforces (config.json's model_type "qwen2" gives Qwen2Tokenizer, which replaces the pre-tokenizer
# with Qwen's, digits one at a time, and adds NFC) unless tokenizer_config.json has an auto_map.
# This auto_map names no module: AutoTokenizer uses tokenizer_class unless called with
# trust_remote_code=True, which then raises instead of tokenizing differently.
_HF_TOKENIZER_CONFIG: dict[str, Any] = {
  "tokenizer_class": "PreTrainedTokenizerFast",
  "auto_map": {"AutoTokenizer": [None, "PreTrainedTokenizerFast"]},
}


class Tokenizer:
  """Text <-> token ids, with the ids generation needs.

  eos_ids: every id that ends a completion (non-empty). pad_id, bos_id: an id or None.
  """

  def __init__(
    self,
    tokenizer: tokenizers.Tokenizer,
    eos_ids: Sequence[int],
    pad_id: int | None = None,
    bos_id: int | None = None,
  ):
    eos_ids = tuple(int(i) for i in eos_ids)
    if not eos_ids:
      raise ValueError("eos_ids must be non-empty, got ()")
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    for name, ids in (("eos_ids", eos_ids), ("pad_id", (pad_id,)), ("bos_id", (bos_id,))):
      bad = [i for i in ids if i is not None and not 0 <= i < n]
      if bad:
        raise ValueError(f"{name} must lie in [0, {n}), got {bad}")
    self._tok = tokenizer
    self._eos_ids = eos_ids
    self._pad_id = pad_id
    self._bos_id = bos_id

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
    """Load ``<path>/tokenizer.json``; special ids from the optional config files beside it.

    EOS ids: ``eos_token_id`` (int or list) of generation_config.json and config.json, then the
    ``eos_token`` of tokenizer_config.json, in that order, without repeats.
    """
    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
      raise ValueError(f"tokenizer.json not found: {tok_file}")
    tok = tokenizers.Tokenizer.from_file(tok_file)
    configs = [_read_json(os.path.join(path, f)) for f in _CONFIG_FILES]
    tok_config = _read_json(os.path.join(path, "tokenizer_config.json"))

    eos: list[int] = []
    for cfg in configs:
      eos.extend(_as_ids(cfg.get("eos_token_id")))
    eos_tok = _token_id(tok, tok_config.get("eos_token"))
    if eos_tok is not None:
      eos.append(eos_tok)
    eos_ids = tuple(dict.fromkeys(eos))
    if not eos_ids:
      raise ValueError(
        f"no EOS id in {path}: expected eos_token_id in {' or '.join(_CONFIG_FILES)} "
        "or eos_token in tokenizer_config.json"
      )

    def special(name: str) -> int | None:
      candidates = [_token_id(tok, tok_config.get(f"{name}_token"))]
      candidates += [(_as_ids(cfg.get(f"{name}_token_id")) or [None])[0] for cfg in configs]
      return next((i for i in candidates if i is not None), None)

    return cls(tok, eos_ids, pad_id=special("pad"), bos_id=special("bos"))

  @property
  def vocab_size(self) -> int:
    """Number of ids, added tokens included (a model's embedding table may be larger)."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return self._eos_ids

  @property
  def pad_id(self) -> int | None:
    return self._pad_id

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped ``tokenizers.Tokenizer``."""
    return self._tok

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self._tok.id_to_token(int(token_id))

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``; no special tokens added."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """``encode`` of each text."""
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Text of ``ids`` (any int iterable, e.g. a numpy row). Does not stop at EOS."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def decode_batch(
    self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = True
  ) -> list[str]:
    """``decode`` of each row."""
    rows = [[int(i) for i in ids] for ids in batch]
    return self._tok.decode_batch(rows, skip_special_tokens=skip_special_tokens)

  def save(self, path: str | os.PathLike) -> None:
    """Write ``tokenizer.json`` and a minimal ``tokenizer_config.json`` (class, eos, pad, bos).

    transformers' ``AutoTokenizer`` then tokenizes as ``tokenizer.json`` says, whatever model type
    a ``config.json`` beside it names. Only the first EOS id is recorded (tokenizer_config.json
    holds one ``eos_token``).
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    self._tok.save(os.path.join(path, "tokenizer.json"))
    cfg: dict[str, Any] = {
      **_HF_TOKENIZER_CONFIG,
      "eos_token": self._tok.id_to_token(self._eos_ids[0]),
    }
    if self._pad_id is not None:
      cfg["pad_token"] = self._tok.id_to_token(self._pad_id)
    if self._bos_id is not None:
      cfg["bos_token"] = self._tok.id_to_token(self._bos_id)
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(cfg, f, indent=2)


def train_bpe(
  texts: Iterable[str],
  vocab_size: int = 1024,
  special_tokens: Sequence[str] = (EOS_TOKEN, PAD_TOKEN),
) -> Tokenizer:
  """A byte-level BPE trained on ``texts``: EOS is "<|endoftext|>", pad "<|pad|>" (if listed).

  The vocabulary holds the 256 byte symbols, the special tokens and up to
  ``vocab_size - 256 - len(special_tokens)`` merges (fewer when ``texts`` is small).
  """
  special_tokens = tuple(special_tokens)
  if EOS_TOKEN not in special_tokens:
    raise ValueError(f"special_tokens must contain {EOS_TOKEN!r}, got {special_tokens}")
  min_size = 256 + len(special_tokens)
  if vocab_size < min_size:
    raise ValueError(
      f"vocab_size must be >= 256 + len(special_tokens) = {min_size}, got {vocab_size}"
    )
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(special_tokens),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer=trainer)
  pad_id = tok.token_to_id(PAD_TOKEN) if PAD_TOKEN in special_tokens else None
  return Tokenizer(tok, (tok.token_to_id(EOS_TOKEN),), pad_id=pad_id)


def _read_json(file: str) -> dict[str, Any]:
  if not os.path.isfile(file):
    return {}
  with open(file, encoding="utf-8") as f:
    return json.load(f)


def _as_ids(value: Any) -> list[int]:
  """An ``*_token_id`` config value (None, int or list of ints) as a list."""
  if value is None:
    return []
  if isinstance(value, int):
    return [value]
  return [int(v) for v in value]


def _token_id(tok: tokenizers.Tokenizer, token: Any) -> int | None:
  """Id of a tokenizer_config special token (a string or an AddedToken dict), else None."""
  if isinstance(token, dict):
    token = token.get("content")
  if not isinstance(token, str):
    return None
  return tok.token_to_id(token)
