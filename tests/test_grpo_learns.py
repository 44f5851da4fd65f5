"""GRPO learns: a short run of the trainer on the embedded model and the synthetic task raises the
reward of the prompts it trains on, and the same run with the reward negated lowers it (so the test
fails if the advantage's sign flips anywhere between the reward and the update)."""

import numpy as np
import pytest

from app import pipeline
from app.tasks import Task
from specroll_jax import rewards, rollout
from specroll_jax.data import gsm8k
from specroll_jax.grpo import Batch, GRPOConfig, init_train_state, make_train_step

P, G, NEW, STEPS = 4, 8, 32, 10
SAMPLING = rollout.SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def setup():
  config, params, tok, _ = pipeline.load_model(None, progress=False)
  exs = Task(name="synthetic", level=0).examples("train")[:P]
  ids = [tok.encode(gsm8k.format_prompt(e.question)) for e in exs]
  rows, sids = pipeline.grpo_batch(ids, G)
  toks, lens = rollout.pad_prompts(rows)
  golds = [e.gold for e in exs for _ in range(G)]
  cfg = GRPOConfig(group_size=G, learning_rate=1e-3, sampling=SAMPLING)
  step = make_train_step(config, cfg)

  def sample(params, seed):
    return rollout.generate(config, params, toks, prompt_lengths=lens, sampling=SAMPLING,
                            max_new_tokens=NEW, sample_ids=sids, seed=seed, eos_ids=tok.eos_ids,
                            options=rollout.DecodeOptions(cache_length=toks.shape[1] + NEW))

  def correct(out):
    o, n = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = tok.decode_batch([o[i, : n[i]] for i in range(len(o))])
    return rewards.batch_rewards(texts, golds)

  def accuracy(params):  # fresh samples, seeds the training never used
    return float(np.mean([correct(sample(params, 1000 + s)).mean() for s in range(3)]))

  def train(sign):
    state = init_train_state(params, cfg)
    for k in range(STEPS):
      out = sample(state.params, k)
      state, _ = step(state, Batch.from_rollout(toks, lens, out, sign * correct(out)))
    return state.params

  return params, accuracy, train


@pytest.mark.slow  # ten GRPO steps twice: about 35 s
def test_grpo_raises_the_reward_and_the_negated_reward_lowers_it(setup):
  params, accuracy, train = setup
  before = accuracy(params)
  assert 0.1 < before < 0.9, before  # room both ways (else the test could not fail)
  up, down = accuracy(train(+1.0)), accuracy(train(-1.0))
  print(f"accuracy before {before:.3f}, after GRPO {up:.3f}, after GRPO on -reward {down:.3f}")
  assert up >= before + 0.15, (before, up)
  assert down <= before - 0.1, (before, down)
