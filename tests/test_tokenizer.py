"""The tokenizer wrapper and the byte-level BPE trainer."""

import json

import numpy as np
import pytest

from specroll_jax.data import gsm8k
from specroll_jax.models.tokenizer import EOS_TOKEN, PAD_TOKEN, Tokenizer, train_bpe


def _texts(examples):
  return [gsm8k.format_prompt(e.question) + gsm8k.format_target(e.answer) for e in examples]


@pytest.fixture(scope="module")
def tok():
  return train_bpe(_texts(gsm8k.load("train")[:300]), vocab_size=512)


def test_trained_special_ids(tok):
  assert tok.vocab_size == 512
  assert tok.eos_ids == (tok.token_to_id(EOS_TOKEN),)
  assert tok.pad_id == tok.token_to_id(PAD_TOKEN)
  assert tok.pad_id not in tok.eos_ids
  assert tok.bos_id is None


def test_roundtrip(tok):
  texts = _texts(gsm8k.load("test")[:100]) + ["", " ", "a  b\n\n\tc", "#### -1,234.50", "~`|{}"]
  for text in texts:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
  assert tok.decode_batch(tok.encode_batch(texts)) == texts
  assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_merges_compress(tok):
  text = _texts(gsm8k.load("test")[:1])[0]
  assert len(tok.encode(text)) < len(text.encode()) / 2


def test_decode_does_not_stop_at_eos(tok):
  a, b = tok.encode("one"), tok.encode("two")
  ids = a + [tok.eos_ids[0]] + b
  assert tok.decode(ids) == "onetwo"
  assert tok.decode(ids, skip_special_tokens=False) == "one" + EOS_TOKEN + "two"
  assert tok.decode(np.asarray(ids, np.int32)) == "onetwo"


def test_save_and_load(tok, tmp_path):
  tok.save(tmp_path)
  loaded = Tokenizer.from_pretrained(tmp_path)
  texts = _texts(gsm8k.load("test")[:50])
  assert loaded.encode_batch(texts) == tok.encode_batch(texts)
  assert loaded.vocab_size == tok.vocab_size
  assert loaded.eos_ids == tok.eos_ids
  assert loaded.pad_id == tok.pad_id
  assert loaded.bos_id is None
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert cfg["eos_token"] == EOS_TOKEN


def test_eos_resolution_from_config_files(tok, tmp_path):
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  eos, pad = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
  # No config file gives an EOS id.
  with pytest.raises(ValueError, match="no EOS id"):
    Tokenizer.from_pretrained(tmp_path)
  # config.json: an int; pad from pad_token_id.
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7, "pad_token_id": pad}))
  t = Tokenizer.from_pretrained(tmp_path)
  assert t.eos_ids == (7,) and t.pad_id == pad and t.bos_id is None
  # generation_config.json: a list, read first; tokenizer_config.json adds its eos_token (as an
  # AddedToken dict) last; repeats are dropped.
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
  (tmp_path / "tokenizer_config.json").write_text(
    json.dumps({"eos_token": {"content": EOS_TOKEN}, "bos_token": EOS_TOKEN})
  )
  t = Tokenizer.from_pretrained(tmp_path)
  assert t.eos_ids == (9, 7, eos)
  assert t.bos_id == eos
  # tokenizer_config.json alone: eos_token as a string.
  (tmp_path / "config.json").unlink()
  (tmp_path / "generation_config.json").unlink()
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
  assert Tokenizer.from_pretrained(tmp_path).eos_ids == (eos,)


def test_missing_tokenizer_json_raises(tmp_path):
  with pytest.raises(ValueError, match="tokenizer.json"):
    Tokenizer.from_pretrained(tmp_path)


def test_bad_vocab_size_raises():
  with pytest.raises(ValueError, match=r"vocab_size must be >= 256 \+ len\(special_tokens\) = 258"):
    train_bpe(["hello world"], vocab_size=257)
  with pytest.raises(ValueError, match=r"special_tokens must contain '<\|endoftext\|>'"):
    train_bpe(["hello world"], vocab_size=300, special_tokens=("<|pad|>",))


def test_bad_special_ids_raise(tok):
  with pytest.raises(ValueError, match="eos_ids must be non-empty"):
    Tokenizer(tok.backend, ())
  with pytest.raises(ValueError, match=r"pad_id must lie in \[0, 512\), got \[512\]"):
    Tokenizer(tok.backend, (0,), pad_id=512)
