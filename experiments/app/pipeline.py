"""Glue the experiments share: load a model, GSM8K prompts in GRPO shape, heads fitted on the
target's own rollouts (cached beside the model)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import numpy as np

from app import sft
from specroll_jax import assets, models, rollout
from specroll_jax import cache as _cache
from specroll_jax.data import gsm8k
from specroll_jax.heads import medusa as _heads
from specroll_jax.models.tokenizer import Tokenizer
from specroll_jax.sampling import group_sample_ids


def default_model_path(*, progress: bool = True) -> Path:
  """The embedded default model: shipped in the package (``specroll_jax.assets.path()``,
  reproduced by ``experiments/build_default_model.py``); if a checkout lacks it, built once with
  the on-the-fly recipe (about 6 minutes on 2 CPU cores) and cached."""
  shipped = assets.path()
  if (shipped / "model.safetensors").exists():
    return shipped
  return sft.build_default_model(progress=progress)


def load_model(path=None, *, progress: bool = True):
  """(config, params, tokenizer, path) of a local HF folder, or of the embedded default model."""
  if path is None:
    path = default_model_path(progress=progress)
  path = Path(path)
  if not path.is_dir():
    raise ValueError(f"model path {str(path)!r} is not a folder (expected a Hugging Face model "
                     "folder with config.json and model.safetensors)")
  config, params = models.load_pretrained(path)
  return config, params, Tokenizer.from_pretrained(path), path


def prompts(tok: Tokenizer, split: str, n: int, offset: int = 0):
  """(token-id prompts, golds) of ``n`` GSM8K examples starting at ``offset``."""
  exs = gsm8k.load(split)[offset:offset + n]
  if len(exs) < n:
    raise ValueError(f"GSM8K {split} has {len(gsm8k.load(split))} examples; asked for "
                     f"{n} from offset {offset}")
  return [tok.encode(gsm8k.format_prompt(e.question)) for e in exs], [e.gold for e in exs]


def grpo_batch(prompt_ids, group_size: int, first_prompt_index: int = 0):
  """Repeat each prompt G times; sample id = global prompt index * G + member (docs/design.md,
  "The node budget")."""
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}")
  rep = [p for p in prompt_ids for _ in range(group_size)]
  sids = group_sample_ids(np.arange(first_prompt_index, first_prompt_index + len(prompt_ids)),
                          group_size).astype(np.int32)
  return rep, sids


def self_rollouts(config, params, tok: Tokenizer, *, num_prompts: int, max_new_tokens: int,
                  sampling: rollout.SamplingConfig, seed: int, offset: int = 0,
                  chunk: int = 32, task=None, bucket_fractions=None):
  """The target's own rollouts of *train* prompts of ``task`` (default GSM8K) with the hidden
  states the heads train on (vanilla engine, ``return_hidden``; ``bucket_fractions`` its row
  buckets, None: the engine's default): (tokens [N, M], lengths [N], hidden [N, M, D])."""
  if task is None:
    ids, _ = prompts(tok, "train", num_prompts, offset)
  else:
    exs = task.examples("train")[offset:offset + num_prompts]
    if len(exs) < num_prompts:
      raise ValueError(f"task {task.name} has {len(exs)} train examples from offset {offset}; "
                       f"asked for {num_prompts}")
    ids = [tok.encode(gsm8k.format_prompt(e.question)) for e in exs]
  padded, plens = rollout.pad_prompts(ids)  # one width for every chunk: one compile
  toks, lens, hid = [], [], []
  for i in range(0, num_prompts, chunk):
    r = rollout.generate(config, params, padded[i:i + chunk], prompt_lengths=plens[i:i + chunk],
                         sampling=sampling, max_new_tokens=max_new_tokens, seed=seed,
                         sample_ids=np.arange(i, min(i + chunk, num_prompts)),
                         eos_ids=tok.eos_ids, options=rollout.DecodeOptions(
                             cache_length=padded.shape[1] + max_new_tokens, return_hidden=True,
                             bucket_fractions=bucket_fractions))
    toks.append(np.asarray(r.tokens))
    lens.append(np.asarray(r.lengths))
    hid.append(np.asarray(r.hidden))
  return np.concatenate(toks), np.concatenate(lens), np.concatenate(hid)


def _heads_cache_file(kind: str, model_path, *settings) -> Path:
  key = json.dumps([str(Path(model_path).resolve()), *settings])
  return _cache.cache_dir() / "heads" / (
      f"{kind}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.safetensors")


def fitted_heads(config, params, tok: Tokenizer, model_path, *, num_heads: int = 3,
                 num_prompts: int = 128, max_new_tokens: int = 256, temperature: float = 1.0,
                 steps: int = 600, seed: int = 1234, progress: bool = True, cache: bool = True):
  """Medusa heads fitted by self-distillation on the target's own rollouts of GSM8K *train*
  prompts; cached as ``heads-<hash>.safetensors`` in the cache folder
  (``cache.cache_dir()``), keyed by the model folder and these settings."""
  file = _heads_cache_file("heads", model_path, num_heads, num_prompts, max_new_tokens,
                           temperature, steps, seed)
  if cache and file.exists():
    return _heads.load(file)
  toks, lens, hid = self_rollouts(config, params, tok, num_prompts=num_prompts,
                                  max_new_tokens=max_new_tokens,
                                  sampling=rollout.SamplingConfig(temperature=temperature),
                                  seed=seed)
  hd = _heads.init(jax.random.key(seed), config, num_heads)
  hd, _ = _heads.fit_heads(config, params, hd, toks, lens, hid, steps=steps, progress=progress)
  if cache:
    file.parent.mkdir(parents=True, exist_ok=True)
    _heads.save(file, hd)
  return hd


_T1 = rollout.SamplingConfig(temperature=1.0)


def fitted_cond_heads(config, params, tok: Tokenizer, model_path, *, num_heads: int = 3,
                      num_prompts: int = 2048, max_new_tokens: int = 256,
                      sampling: rollout.SamplingConfig = _T1, steps: int = 4000,
                      width: int | None = None, seed: int = 1234, progress: bool = True,
                      cache: bool = True, task=None, tv_weight: float = 1.0):
  """Root-conditioned heads (``cond_heads``) fitted on the target's own rollouts of train prompts
  of ``task`` (default GSM8K) at ``sampling`` (soft self-distillation with ``cond_heads.fit``'s
  TV term at ``tv_weight``); cached like ``fitted_heads``."""
  from specroll_jax.heads import conditioned as _cond
  settings = (num_heads, num_prompts, max_new_tokens, repr(sampling), steps, width, seed,
              f"tv_weight={tv_weight}")
  if task is not None:
    settings += (repr(task),)
  file = _heads_cache_file("cond", model_path, *settings)
  if cache and file.exists():
    return _cond.load(file)
  toks, lens, hid = self_rollouts(config, params, tok, num_prompts=num_prompts,
                                  max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                  chunk=64, task=task)
  hd = _cond.init(jax.random.key(seed), config, num_heads, width=width)
  hd, _ = _cond.fit(config, params, hd, toks, lens, hid, sampling=sampling, steps=steps,
                    tv_weight=tv_weight,
                    progress=progress)
  if cache:
    file.parent.mkdir(parents=True, exist_ok=True)
    _cond.save(file, hd)
  return hd


def default_heads(config, params, tok: Tokenizer, model_path, *, num_heads: int = 3,
                  progress: bool = True, conditioned: bool = False):
  """The heads shipped beside a model: with ``conditioned``, the root-conditioned
  ``cond_heads.safetensors`` when there is one; else the Medusa ``heads.safetensors`` (e.g. the
  embedded default model's); else Medusa heads fitted on the model's own T = 1 rollouts
  (``fitted_heads``, cached)."""
  from specroll_jax.heads import conditioned as _cond
  cond = Path(model_path) / "cond_heads.safetensors"
  if conditioned and cond.exists():
    hd = _cond.load(cond)
    _cond.validate(config, hd, num_heads)
    return hd
  shipped = Path(model_path) / "heads.safetensors"
  if shipped.exists():
    hd = _heads.load(shipped)
    _heads.validate(config, hd, num_heads)
    return hd
  return fitted_heads(config, params, tok, model_path, num_heads=num_heads, progress=progress)
