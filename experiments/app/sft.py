"""Supervised fine-tuning on GSM8K and the embedded default model (built once, cached on disk).

``build_default_model()`` trains a byte-level BPE tokenizer on GSM8K train, then a small Qwen2-
architecture model by SFT on the train solutions (optax AdamW, a few minutes on 2 CPU cores), and
writes it with ``save_pretrained`` + the tokenizer into ``~/.cache/specroll_jax/<name>/``. Callers
then load it with ``load_pretrained`` exactly like a real checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from app import evaluation
from specroll_jax import models
from specroll_jax.cache import cache_dir
from specroll_jax.data import gsm8k
from specroll_jax.models.tokenizer import Tokenizer, train_bpe
from specroll_jax.progress import progress_range

_CALC = re.compile(r"<<[^>]*>>")


def solution_text(answer: str) -> str:
  """The GSM8K solution without its calculator annotations (``<<48/2=24>>``)."""
  return _CALC.sub("", answer)


def training_text(ex: gsm8k.Example) -> tuple[str, str]:
  """(prompt, completion) of one SFT example."""
  return gsm8k.format_prompt(ex.question), gsm8k.format_target(solution_text(ex.answer))


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  vocab_size: int = 2048
  seq_len: int = 288
  batch_size: int = 32
  steps: int | None = 600  # None: as many as fit in max_seconds (measured after compiling)
  learning_rate: float = 3e-3
  warmup: int = 30
  seed: int = 0
  max_seconds: float | None = None  # stop early (at a step boundary) after this much training time
  num_train: int | None = None  # use the first n train examples (None: all)

  @classmethod
  def tiny(cls) -> SFTConfig:
    """For tests: trains in seconds."""
    return cls(vocab_size=1024, seq_len=192, batch_size=16, steps=200, learning_rate=1e-2,
               warmup=10, num_train=2000)


def encode_examples(tok: Tokenizer, examples, seq_len: int):
  """Token arrays for SFT: (tokens [n, seq_len], loss mask [n, seq_len]) over prompt + completion
  + EOS. Examples longer than ``seq_len`` are dropped (never truncated); returns the drop count."""
  eos = tok.eos_ids[0]
  rows, masks, dropped = [], [], 0
  for ex in examples:
    prompt, completion = training_text(ex)
    ids = tok.encode(prompt + completion) + [eos]
    if len(ids) > seq_len:
      dropped += 1
      continue
    t = np.zeros(seq_len, np.int32)
    t[: len(ids)] = ids
    m = np.zeros(seq_len, np.float32)
    m[: len(ids) - 1] = 1.0  # predict every next token of the sequence (prompt included)
    rows.append(t)
    masks.append(m)
  return np.stack(rows), np.stack(masks), dropped


def lm_loss(config, params, tokens, mask):
  logits = models.forward(config, params, tokens[:, :-1], kernels="reference")
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  m = mask[:, :-1]
  return (ce * m).sum() / jnp.maximum(m.sum(), 1.0)


def train(config: models.ModelConfig, tok: Tokenizer, sft: SFTConfig, *, progress: bool = True,
          examples=None, init=None):
  """SFT on ``examples`` (default: GSM8K train), from ``init`` parameters (default: a fresh
  random initialisation). Returns (params, metrics dict)."""
  train_ex = (gsm8k.load("train") if examples is None else list(examples))[: sft.num_train]
  tokens, mask, dropped = encode_examples(tok, train_ex, sft.seq_len)
  params = models.init_params(jax.random.key(sft.seed), config) if init is None else init
  rng = np.random.default_rng(sft.seed)
  steps = sft.steps
  if steps is None:  # size the cosine schedule to the time budget
    if sft.max_seconds is None:
      raise ValueError("SFTConfig.steps=None needs max_seconds (the training time budget)")
    steps = max(sft.warmup + 1, int(sft.max_seconds / _seconds_per_step(config, tokens, mask, sft)))
  sched = optax.warmup_cosine_decay_schedule(0.0, sft.learning_rate, sft.warmup, steps,
                                             sft.learning_rate * 0.05)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
  opt = tx.init(params)
  update = _update_fn(config, tx)
  losses, t0, steps_done = [], time.perf_counter(), 0
  for _ in progress_range(steps, "SFT on GSM8K", enabled=progress):
    idx = rng.integers(0, len(tokens), sft.batch_size)
    params, opt, loss = update(params, opt, jnp.asarray(tokens[idx]), jnp.asarray(mask[idx]))
    losses.append(float(loss))
    steps_done += 1
    if sft.max_seconds is not None and time.perf_counter() - t0 > sft.max_seconds:
      break
  metrics = {"train_examples": len(tokens), "train_dropped_too_long": dropped,
             "steps": steps_done, "train_seconds": time.perf_counter() - t0,
             "final_train_loss": float(np.mean(losses[-20:])), "train_loss_curve": losses}
  return params, metrics


def _update_fn(config, tx):
  @jax.jit
  def update(params, opt, t, m):
    loss, g = jax.value_and_grad(lambda p: lm_loss(config, p, t, m))(params)
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt, loss
  return update


def _seconds_per_step(config, tokens, mask, sft: SFTConfig) -> float:
  """Time one compiled training step (throwaway parameters and optimiser)."""
  params = models.init_params(jax.random.key(0), config)
  tx = optax.adamw(0.0)
  opt = tx.init(params)
  update = _update_fn(config, tx)
  t, m = jnp.asarray(tokens[: sft.batch_size]), jnp.asarray(mask[: sft.batch_size])
  jax.block_until_ready(update(params, opt, t, m))
  t0 = time.perf_counter()
  for _ in range(3):
    params, opt, loss = update(params, opt, t, m)
  jax.block_until_ready(loss)
  return (time.perf_counter() - t0) / 3


def test_loss(config, params, tok: Tokenizer, seq_len: int, n: int = 256) -> float:
  tokens, mask, _ = encode_examples(tok, gsm8k.load("test")[:n], seq_len)
  f = jax.jit(lambda t, m: lm_loss(config, params, t, m))
  vals = [float(f(jnp.asarray(tokens[i:i + 32]), jnp.asarray(mask[i:i + 32])))
          for i in range(0, len(tokens), 32)]
  return float(np.mean(vals))


def build_model(path, config_fn, sft: SFTConfig, *, progress: bool = True,
                eval_examples: int = 64) -> Path:
  """Build (tokenizer + SFT model + metrics.json) into ``path`` unless it is already there.

  The trained model appears atomically (written in a temporary sibling, then renamed) before the
  accuracy evaluation, which is added to metrics.json afterwards (and redone if it is missing).
  """
  path = Path(path)
  if not (path / "metrics.json").exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
      texts = [q + a for q, a in (training_text(e) for e in gsm8k.load("train"))]
      tok = train_bpe(texts, vocab_size=sft.vocab_size)
      config = config_fn(tok.vocab_size).replace(eos_token_ids=tok.eos_ids)
      params, metrics = train(config, tok, sft, progress=progress)
      models.save_pretrained(tmp, config, params)
      tok.save(tmp)
      metrics["test_loss"] = test_loss(config, params, tok, sft.seq_len)
      metrics["sft_config"] = dataclasses.asdict(sft)
      (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))
      if path.exists():
        shutil.rmtree(path)
      os.replace(tmp, path)
    finally:
      if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
  metrics = json.loads((path / "metrics.json").read_text())
  if eval_examples and "accuracy_strict" not in metrics:
    config, params = models.load_pretrained(path)
    metrics.update(evaluation.gsm8k_accuracy(config, params, Tokenizer.from_pretrained(path),
                                             n=eval_examples).to_dict())
    _write_json_atomic(path / "metrics.json", metrics)
  return path


def _write_json_atomic(file: Path, obj) -> None:
  from specroll_jax.models.hf import atomic_write
  atomic_write(file, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2)))


def build_default_model(*, progress: bool = True, max_seconds: float = 360.0) -> Path:
  """The embedded default model of ``experiments/gsm8k.py`` (cached after the first build)."""
  sft = SFTConfig(max_seconds=max_seconds, steps=None, learning_rate=5e-3)
  return build_model(cache_dir() / "gsm8k-tiny-qwen2-v2",
                     models.ModelConfig.embedded_default, sft, progress=progress)


def build_test_model(path, *, progress: bool = False) -> Path:
  """The far smaller model the tests use (trains in seconds)."""
  tiny = lambda v: models.ModelConfig.tiny(vocab_size=v, max_position_embeddings=512)
  return build_model(path, tiny, SFTConfig.tiny(), progress=progress, eval_examples=0)
