"""The tokenizer wrapper and the byte-level BPE trainer; transformers' AutoTokenizer on the
folders the library ships and writes gives the same ids and text."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TEST_MODEL

import specroll_jax
from app.tasks import Task
from specroll_jax import models
from specroll_jax.data import gsm8k
from specroll_jax.models.tokenizer import EOS_TOKEN, PAD_TOKEN, Tokenizer, train_bpe

os.environ["HF_HUB_OFFLINE"] = "1"  # AutoTokenizer reads local folders only

SHIPPED = {
  "embedded": Path(specroll_jax.__file__).parent / "assets" / "gsm8k-tiny",
  "test-model": Path(TEST_MODEL),
}
# Digits in runs (GPT-2's regex keeps \p{N}+ together, Qwen's splits each), spaces, newlines,
# unicode that NFC would change (e + combining acute), other number scripts, and the special tokens.
EDGE_TEXTS = [
  "",
  " ",
  "   ",
  "0",
  "7 77 777 7777 77777 1234567890",
  "3.14 -2,500 1/2 10% $48.00 #### 72",
  "<<48/2=24>>24",
  "a  b\n\nc\r\n\td \n",
  " leading and trailing  ",
  "Q:\n\n\nA: 5\n#### 5\n",
  "caf\u00e9 cafe\u0301 \ufb01sh \u00bd \u0661\u0662 \uff11\uff12 \u4e2d\u6587 \U0001f600",
  "don't it's WE'LL",
  f"x{EOS_TOKEN}y",
  EOS_TOKEN,
  f" 12{EOS_TOKEN}\n{PAD_TOKEN}3",
  "<|endoftext",
]


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


@pytest.fixture(scope="module")
def transformers():
  return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def agreement_texts():
  """Texts as the library encodes them: synthetic prompts the way ``app.loop.Prompts`` builds
  them (easy and hard numbers), GSM8K test prompts and prompt + answer, and ``EDGE_TEXTS``."""
  syn = Task(name="synthetic", train_size=100).examples("train")
  syn += Task(name="synthetic", level=4, train_size=100).examples("train")
  test = gsm8k.load("test")[:200]
  return {
    "synthetic prompts": [gsm8k.format_prompt(e.question) for e in syn],
    "synthetic sft texts": _texts(syn),
    "gsm8k prompts": [gsm8k.format_prompt(e.question) for e in test],
    "gsm8k sft texts": _texts(test),
    "edge texts": EDGE_TEXTS,
  }


def _assert_transformers_agrees(folder, transformers, texts_by_name, **load_kwargs):
  """AutoTokenizer and ``Tokenizer.from_pretrained`` on ``folder``: the same backend parts, ids,
  decodes and special ids."""
  hf = transformers.AutoTokenizer.from_pretrained(folder, **load_kwargs)
  lib = Tokenizer.from_pretrained(folder)
  ours, theirs = json.loads(lib.backend.to_str()), json.loads(hf.backend_tokenizer.to_str())
  for part in ("normalizer", "pre_tokenizer", "decoder", "model", "added_tokens"):
    assert theirs[part] == ours[part], (type(hf).__name__, part, theirs[part])
  for name, texts in texts_by_name.items():
    ids = lib.encode_batch(texts)
    got = hf(texts)["input_ids"]  # add_special_tokens=True (the default) adds nothing either
    bad = [t for t, a, b in zip(texts, got, ids, strict=True) if a != b]
    assert not bad, f"{name}: {len(bad)} of {len(texts)} differ, first {bad[0]!r}"
    assert [hf.encode(t, add_special_tokens=False) for t in texts] == ids, name
    for skip in (True, False):
      assert hf.batch_decode(ids, skip_special_tokens=skip) == lib.decode_batch(ids, skip), name
    assert hf.batch_decode(ids) == texts, name  # round trip, special tokens kept
  assert hf.eos_token == EOS_TOKEN and (hf.eos_token_id,) == lib.eos_ids
  assert transformers.AutoConfig.from_pretrained(folder).eos_token_id == lib.eos_ids[0]
  assert hf.pad_token == PAD_TOKEN and hf.pad_token_id == lib.pad_id
  assert hf.bos_token_id is None and lib.bos_id is None


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_transformers_agrees_on_shipped_folders(name, transformers, agreement_texts):
  folder = SHIPPED[name]
  assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
  _assert_transformers_agrees(folder, transformers, agreement_texts)


def test_transformers_with_trust_remote_code_raises_or_agrees(transformers):
  # tokenizer_config.json's auto_map names no module: loading fails rather than loading a
  # tokenizer that splits differently.
  folder = SHIPPED["embedded"]
  try:
    transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
  except ValueError:
    return
  texts = {"edge texts": EDGE_TEXTS}
  _assert_transformers_agrees(folder, transformers, texts, trust_remote_code=True)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_transformers_agrees_on_saved_folder(
  architecture, tok, tmp_path, transformers, agreement_texts
):
  # What sft.build_model writes: models.save_pretrained (config.json with model_type, weights),
  # then Tokenizer.save. transformers 5 maps model_type "qwen2" to its own Qwen2Tokenizer.
  config = models.ModelConfig.tiny(
    tok.vocab_size,
    architecture=architecture,
    qkv_bias=architecture == "qwen2",
    eos_token_ids=tok.eos_ids,
  )
  shapes = jax.eval_shape(lambda key: models.init_params(key, config), jax.random.key(0))
  models.save_pretrained(
    tmp_path, config, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
  )
  tok.save(tmp_path)
  assert Tokenizer.from_pretrained(tmp_path).eos_ids == tok.eos_ids
  _assert_transformers_agrees(tmp_path, transformers, agreement_texts)
