"""Vanilla engine: teacher-forced logprobs, batch independence, EOS/length cuts, bad input, NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import engines, models, rollout, sampling
from specroll_jax.proposers import PromptLookup
from specroll_jax.rollout import SamplingConfig

CONFIGS = [SamplingConfig(temperature=1.0),
           pytest.param(SamplingConfig(temperature=0.7, top_p=0.95), marks=pytest.mark.slow),
           pytest.param(SamplingConfig(temperature=0.0), marks=pytest.mark.slow),
           pytest.param(SamplingConfig(temperature=1.0, top_k=20), marks=pytest.mark.slow)]


def _prompts(n, vocab, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, rng.integers(1, 12)).tolist() for _ in range(n)]


_forward = jax.jit(models.forward, static_argnums=0)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_logprobs_equal_teacher_forced(random_model, cfg):
  config, params = random_model
  prompts = _prompts(4, config.vocab_size)
  r = rollout.generate(config, params, prompts, sampling=cfg, max_new_tokens=10, seed=7)
  assert (np.asarray(r.lengths) == 10).all()
  seqs = np.zeros((4, 32), np.int32)  # right-padded: causal, so the padding changes no logit
  for i, p in enumerate(prompts):
    seqs[i, : len(p) + 10] = p + np.asarray(r.tokens[i]).tolist()
  full = _forward(config, params, jnp.asarray(seqs))  # one compiled teacher-forced forward
  for i, p in enumerate(prompts):
    logits = full[i, len(p) - 1: len(p) + 9]
    lp = sampling.token_logprobs(logits, r.tokens[i], cfg)
    np.testing.assert_allclose(np.asarray(r.logprobs[i]), np.asarray(lp), atol=1e-5)
    # the teacher-forced sample at each position reproduces the token (the noise is positional)
    tok, _, _ = sampling.sample(logits, 7, jnp.full((10,), i), len(p) + jnp.arange(10), cfg)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(r.tokens[i]))


@pytest.mark.slow
def test_batch_independence(random_model):
  config, params = random_model
  cfg = SamplingConfig(temperature=1.0)
  prompts = _prompts(8, config.vocab_size, seed=1)
  sids = np.arange(100, 108)
  r = rollout.generate(config, params, prompts, sampling=cfg, max_new_tokens=12, seed=3,
                       sample_ids=sids)
  perm = np.random.default_rng(0).permutation(8)
  rp = rollout.generate(config, params, [prompts[i] for i in perm], sampling=cfg,
                        max_new_tokens=12, seed=3, sample_ids=sids[perm])
  np.testing.assert_array_equal(np.asarray(rp.tokens), np.asarray(r.tokens)[perm])
  np.testing.assert_allclose(np.asarray(rp.logprobs), np.asarray(r.logprobs)[perm], atol=1e-5)
  alone = rollout.generate(config, params, [prompts[5]], sampling=cfg, max_new_tokens=12, seed=3,
                           sample_ids=[105])
  np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(r.tokens[5]))
  np.testing.assert_allclose(np.asarray(alone.logprobs[0]), np.asarray(r.logprobs[5]), atol=1e-5)
  other = rollout.generate(config, params, prompts, sampling=cfg, max_new_tokens=12, seed=4,
                           sample_ids=sids)
  assert (np.asarray(other.tokens) != np.asarray(r.tokens)).any()


def test_eos_and_length_cut(random_model):
  config, params = random_model
  cfg = SamplingConfig(temperature=1.0)
  prompts = _prompts(6, config.vocab_size, seed=2)
  # no EOS ([-1, -1]: two slots, as below, so both calls are one compiled program)
  pad = rollout.DecodeOptions(pad_id=-1)
  free = rollout.generate(config, params, prompts, sampling=cfg, max_new_tokens=16, seed=5,
                          eos_ids=[-1, -1], options=pad)
  toks = np.asarray(free.tokens)
  eos = [int(toks[0, 3]), int(toks[2, 7])]
  r = rollout.generate(config, params, prompts, sampling=cfg, max_new_tokens=16, seed=5,
                       eos_ids=eos, options=pad)
  out, lens, lps = np.asarray(r.tokens), np.asarray(r.lengths), np.asarray(r.logprobs)
  for i in range(6):
    hits = np.flatnonzero(np.isin(toks[i], eos))
    expect = int(hits[0]) + 1 if len(hits) else 16
    assert lens[i] == expect, (i, lens[i], expect)
    np.testing.assert_array_equal(out[i, :expect], toks[i, :expect])
    assert (out[i, expect:] == -1).all() and (lps[i, expect:] == 0).all()
  assert lens[0] <= 4 and lens[2] <= 8
  short = rollout.generate(config, params, prompts, sampling=cfg, max_new_tokens=5, seed=5,
                           eos_ids=[-1, -1])
  np.testing.assert_array_equal(np.asarray(short.tokens), toks[:, :5])
  assert r.stats.tokens_per_forward == pytest.approx(1.0)


def test_bad_input(random_model):
  config, params = random_model
  g = lambda prompts, **kw: rollout.generate(config, params, prompts,
                                             **{"max_new_tokens": 4, **kw})
  with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
    g([[1, 2], []])
  with pytest.raises(ValueError, match="exceeds cache_length 10"):
    g([[1] * 8], max_new_tokens=4, options=rollout.DecodeOptions(cache_length=10))
  with pytest.raises(ValueError, match="max_position_embeddings 256"):
    g([[1] * 200], max_new_tokens=100)
  with pytest.raises(ValueError, match=r"token id 256 outside \[0, vocab_size=256\)"):
    g([[1, 256]])
  with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got -0.5"):
    SamplingConfig(temperature=-0.5)
  for p in (0.0, 1.5):
    with pytest.raises(ValueError, match=f"top_p must be a finite number in \\(0, 1\\], got {p}"):
      SamplingConfig(top_p=p)
  for m in (0, -3):
    with pytest.raises(ValueError, match=f"max_new_tokens must be an int >= 1, got {m}"):
      g([[1]], max_new_tokens=m)
  with pytest.raises(ValueError, match="sample_ids must have shape"):
    g([[1], [2]], sample_ids=[0])
  with pytest.raises(ValueError, match="seed must be an int"):
    g([[1]], seed=-1)
  with pytest.raises(ValueError, match=r"prompts\[0\] holds 1.5 \(float\); token ids must be"):
    g([[1.5, 2]])
  with pytest.raises(ValueError, match="prompts must hold integer token ids, got dtype float32"):
    g(np.ones((2, 3), np.float32))
  with pytest.raises(ValueError, match=r"sample_ids holds duplicates \[3\]"):
    g([[1], [1], [2]], sample_ids=[3, 3, 4])
  with pytest.raises(ValueError, match=r"kernels must be one of \('auto', .*got 'cuda'"):
    rollout.DecodeOptions(kernels="cuda")
  with pytest.raises(ValueError, match="on_nonfinite must be 'raise' or 'flag', got 'warn'"):
    rollout.DecodeOptions(on_nonfinite="warn")
  with pytest.raises(ValueError, match="options must be a DecodeOptions, got dict"):
    g([[1]], options={"pad_id": 0})
  with pytest.raises(ValueError, match="Speculation.proposer must be a specroll_jax.proposers"):
    rollout.Speculation(None, ())
  with pytest.raises(ValueError, match=r"Speculation.params is None for PromptLookup"):
    rollout.Speculation(PromptLookup(), None)
  with pytest.raises(ValueError, match="speculation must be a Speculation, got PromptLookup"):
    g([[1]], speculation=PromptLookup())
  with pytest.raises(ValueError, match="bucket_fractions is for the vanilla engine"):
    g([[1]], speculation=rollout.Speculation(PromptLookup(), ()),
      options=rollout.DecodeOptions(bucket_fractions=(1.0,)))


def test_duplicate_sample_ids_on_request(random_model):
  """Opting in to duplicates gives identical responses for identical (prompt, id) rows."""
  config, params = random_model
  r = rollout.generate(config, params, [[5, 6], [5, 6]], max_new_tokens=6, sample_ids=[9, 9],
                       options=rollout.DecodeOptions(allow_duplicate_sample_ids=True))
  np.testing.assert_array_equal(np.asarray(r.tokens[0]), np.asarray(r.tokens[1]))


@pytest.mark.slow
def test_padded_array_prompts(random_model):
  config, params = random_model
  prompts = _prompts(3, config.vocab_size, seed=4)
  width = max(map(len, prompts))
  arr = np.full((3, width), 7, np.int32)
  for i, p in enumerate(prompts):
    arr[i, : len(p)] = p
  cfg = SamplingConfig(temperature=1.0)
  a = rollout.generate(config, params, arr, prompt_lengths=[len(p) for p in prompts],
                       sampling=cfg, max_new_tokens=6, seed=1)
  b = rollout.generate(config, params, prompts, sampling=cfg, max_new_tokens=6, seed=1)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def test_nonfinite_logits_are_reported():
  # untied: a NaN embedding row then poisons only the rows whose prompt holds that token
  config = models.ModelConfig.tiny(vocab_size=64, tie_word_embeddings=False)
  bad = models.init_params(jax.random.key(1), config)
  bad["embed"]["embedding"] = bad["embed"]["embedding"].at[13].set(jnp.nan)
  prompts = [[1, 2, 3], [4, 13, 5], [6]]
  with pytest.raises(FloatingPointError, match=r"non-finite logits in rows \[.*1.*\]"):
    rollout.generate(config, bad, prompts, max_new_tokens=4, eos_ids=[])
  with pytest.warns(RuntimeWarning, match="non-finite"):
    r = rollout.generate(config, bad, prompts, max_new_tokens=8, eos_ids=[],
                         options=rollout.DecodeOptions(on_nonfinite="flag"))
  nf, lens, toks = np.asarray(r.stats.nonfinite), np.asarray(r.lengths), np.asarray(r.tokens)
  assert nf[1] and lens[1] == 0  # poisoned prompt: nothing sampled
  for i in (0, 2):  # a row is flagged exactly when it sampled token 13 (its next step is NaN)
    sampled13 = 13 in toks[i, : lens[i]].tolist()
    assert nf[i] == sampled13
    if sampled13:
      assert toks[i, lens[i] - 1] == 13
    else:
      assert lens[i] == 8
  assert np.isfinite(np.asarray(r.logprobs)).all()


def test_pad_prompts_widths_and_bad_width():
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 100, n).tolist() for n in (3, 17, 9)]
  toks, lens = rollout.pad_prompts(prompts)
  assert toks.shape == (3, 32) and toks.dtype == np.int32  # 17: the next power of two, >= 32
  assert [rollout.prompt_width(n) for n in (1, 32, 33, 100, 129)] == [32, 32, 64, 128, 256]
  np.testing.assert_array_equal(lens, [3, 17, 9])
  for row, p in zip(toks, prompts, strict=True):
    np.testing.assert_array_equal(row[: len(p)], p)
    assert not row[len(p):].any()
  assert rollout.pad_prompts(prompts, 17)[0].shape == (3, 17)
  with pytest.raises(ValueError,
                     match=r"width=16 is shorter than the longest prompt \(17 tokens\)"):
    rollout.pad_prompts(prompts, 16)


def test_params_that_do_not_fit_the_config_are_refused():
  """An embedding of the wrong vocabulary (``jnp.take`` would clip ids silently), parameters of
  another dtype (a TypeError from inside ``lax.scan``) or a missing leaf: a ValueError naming
  the leaf at every public entry, before anything compiles."""
  from specroll_jax import SpecRoll
  from specroll_jax.engines import executables as exe
  from specroll_jax.grpo import GRPOConfig, init_train_state, make_train_step
  config = models.ModelConfig.tiny(vocab_size=64)
  params = models.init_params(jax.random.key(0), config)
  small = {**params, "embed": {"embedding": params["embed"]["embedding"][:10]}}
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  gone = {k: v for k, v in params.items() if k != "final_norm"}
  sr = SpecRoll(config, max_new_tokens=4, group_size=2)
  b = engines.PromptBatch.from_prepared(rollout.prepare_batch(config, [[1, 2]],
                                                              max_new_tokens=4), 0)
  eng = engines.VanillaEngine.build(config, max_new_tokens=4, cache_length=b.tokens.shape[1] + 4)
  n0 = exe.programs()
  for bad, match in ((small, r"\['embed'\]\['embedding'\] has shape \(10, 64\)"),
                     (bf16, r"is bfloat16; the config's dtype is float32"),
                     (gone, r"missing \[\"\['final_norm'\]")):
    with pytest.raises(ValueError, match=match):
      rollout.generate(config, bad, [[1, 2]], max_new_tokens=4)
    with pytest.raises(ValueError, match=match):
      sr.generate(bad, sr.batch([[1, 2]], [0]), sr.init(None))
    with pytest.raises(ValueError, match=match):
      eng.jit(bad, b)
  cfg = GRPOConfig(group_size=2)
  with pytest.raises(ValueError, match=r"state.params\['embed'\]\['embedding'\] has shape"):
    make_train_step(config, cfg)(init_train_state(small, cfg), None)
  assert exe.programs() == n0
