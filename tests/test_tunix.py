"""SpecRollRollout inside google/tunix: tunix's own Qwen2 / Llama3 modules with random weights, our
engines decoding them, and tunix's GRPOLearner training with our backend (CPU, tiny shapes).

Skipped unless tunix is installed (the ``tunix`` extra: ``.venv-tunix``)."""

import dataclasses
import functools
import re

import numpy as np
import pytest

tunix = pytest.importorskip("tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.qwen2 import model as qwen2  # noqa: E402
from tunix.rl import rl_cluster as rlc  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from specroll_jax.grpo import trainer_logprobs  # noqa: E402
from specroll_jax.heads import medusa as heads  # noqa: E402
from specroll_jax.integrations import tunix as sr  # noqa: E402
from specroll_jax.models import decoder  # noqa: E402
from specroll_jax.proposers import PromptLookup  # noqa: E402
from specroll_jax.rollout import SpecConfig  # noqa: E402
from specroll_jax.sampling import SamplingConfig  # noqa: E402

V = 64
PAD, BOS, EOS = 0, 1, 2
ATOL = 1e-4  # f32, logits/logprobs through different forward shapes (TOOLCHAIN.md "Float rounding")
# one rollout config for every decode (one compile per engine): sampled, with top-k and top-p
RC = base_rollout.RolloutConfig(max_tokens_to_generate=12, max_prompt_length=16, temperature=0.9,
                                top_p=0.95, top_k=20, seed=3)
PROMPTS = ["hello world", "hello world", "abc", "abc"]  # tunix's layout: G = 2 copies, prompt-major
PROMPTS_2 = ["good day", "good day", "xyz q", "xyz q"]
# SpecRoll's settings in these tests: the fixed budget, one bucket (trees verified on this CPU,
# where goodput would verify none; one program each)
FIXED = {"budget": "fixed", "spec": SpecConfig(bucket_fractions=(1.0,), node_budget=16)}


class CharTokenizer:
  """A tokenizer with tunix's plain interface: characters to ids 3.., 0 pad, 1 BOS, 2 EOS."""

  def __init__(self, vocab_size: int = V):
    self.vocab_size = vocab_size

  def encode(self, text):
    return [3 + ord(c) % (self.vocab_size - 3) for c in text]

  def decode(self, ids):
    return "".join(chr(97 + (i - 3) % 26) for i in ids if i >= 3)

  def bos_id(self):
    return BOS

  def eos_id(self):
    return EOS

  def pad_id(self):
    return PAD


def _randomize(model, seed: int):
  """Every Param redrawn (tunix initialises zero biases, unit norms and zero MLP kernels, which
  would hide a mapping bug): norms 1 + 0.2 N(0, 1), everything else 0.3 N(0, 1)."""
  state = nnx.state(model, nnx.Param)
  pure = nnx.to_pure_dict(state)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(pure))))

  def draw(path, a):
    norm = any("norm" in str(getattr(k, "key", k)) for k in path)
    return (1.0 if norm else 0.0) + (0.2 if norm else 0.3) * jax.random.normal(
        next(keys), a.shape, a.dtype)

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, pure))
  nnx.update(model, state)
  return model


def _qwen2(seed: int = 1, tied: bool = False):
  cfg = qwen2.ModelConfig(num_layers=2, vocab_size=V, embed_dim=32, hidden_dim=64, num_heads=4,
                          head_dim=8, num_kv_heads=2, rope_theta=10000, norm_eps=1e-6,
                          use_tied_embedding=tied)
  return _randomize(qwen2.Qwen2(cfg, rngs=nnx.Rngs(0)), seed)


def _llama3(seed: int = 2):
  cfg = llama3.ModelConfig(num_layers=2, vocab_size=V, embed_dim=32, hidden_dim=64, num_heads=4,
                           head_dim=8, num_kv_heads=2, rope_theta=500000, norm_eps=1e-5,
                           weight_tying=True)
  return _randomize(llama3.Llama3(cfg, rngs=nnx.Rngs(0)), seed)


def _backend(model, **kw):
  return sr.SpecRollRollout(rollout_actor=model, tokenizer=CharTokenizer(),
                            rollout_config=kw.pop("rollout_config", RC), **kw)


def _params(model) -> dict:
  """A snapshot of the model's Params (copies: tunix's trainer donates its buffers)."""
  return jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _state(model, pure: dict):
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, pure)
  return state


def _same(outs_a, outs_b) -> bool:
  return all(len(a) == len(b) and (a == b).all() for a, b in zip(outs_a, outs_b, strict=True))


@pytest.fixture(scope="module")
def model():
  return _qwen2()


@pytest.fixture(scope="module")
def vanilla(model):
  """(backend, [output of PROMPTS, output of PROMPTS_2]): two calls, sample ids 0..3 then 4..7."""
  b = _backend(model, num_generations=2)
  return b, [b.generate(PROMPTS, RC), b.generate(PROMPTS_2, RC)]


# --- (1) the mapping --------------------------------------------------------------------------


@pytest.mark.parametrize("build", [_qwen2, functools.partial(_qwen2, tied=True), _llama3],
                         ids=["qwen2", "qwen2-tied", "llama3"])
def test_logits_equal_tunix_model(build):
  m = build()
  config = sr.model_config_from_tunix(m)
  src = sr.tunix_source(config, m)
  # no copy: the source holds the model's own arrays
  assert src["embed"] is m.embedder.input_embedding.get_value()
  assert src["layers"][1]["q"] is m.layers[1].attn.q_proj.w.get_value()
  assert src["layers"][0]["gate"] is m.layers[0].mlp.gate_proj.kernel.get_value()
  b, t = 3, 11
  toks = jax.random.randint(jax.random.key(7), (b, t), 0, V)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  theirs, _ = m(toks, pos, None, mask)
  ours = decoder.forward(config, sr.params_from_tunix(config, src), toks, kernels="reference")
  assert float(jnp.std(theirs)) > 0.5  # not a degenerate model
  np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=ATOL, rtol=0)


def test_sampling_settings_read_as_tunix_reads_them():
  read = sr.sampling_from_rollout_config
  assert read(RC) == SamplingConfig(temperature=0.9, top_k=20, top_p=0.95)
  assert read(dataclasses.replace(RC, top_p=None)).greedy  # tunix: no top_p is greedy
  assert read(dataclasses.replace(RC, temperature=0.0)).greedy
  for off in (None, 0, -1):
    assert read(dataclasses.replace(RC, top_k=off)).top_k == 0


# --- (2) speculation changes nothing ------------------------------------------------------------


def test_speculative_returns_vanilla_tokens(model, vanilla):
  """Through the SpecRoll object: your proposer, and heads with the object's tree, slow path and
  store (the state carried over calls); the vanilla engine's tokens either way."""
  _, ref = vanilla
  lookup = _backend(model, proposer=PromptLookup(), proposer_params=(), num_generations=2,
                    specroll=FIXED)
  hd = heads.init(jax.random.key(4), lookup.config, 3, scale=0.05)
  with_heads = _backend(model, heads=hd, num_generations=2, specroll=FIXED)
  learned = _backend(model, heads="learn", num_generations=2, specroll=FIXED)  # heads from none
  for b in (lookup, with_heads, learned):
    outs = [b.generate(PROMPTS, RC), b.generate(PROMPTS_2, RC)]
    assert int(b.last_rollout.stats.nodes_verified) > 0  # trees were verified: not vanilla
    assert b.report.mode == "speculative" and int(b.state.batches) == 2  # carried over calls
    for got, want in zip(outs, ref, strict=True):
      assert _same(got.tokens, want.tokens)
      for a, c in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(a, c, atol=ATOL, rtol=0)
  assert with_heads.report.slow is not None and np.asarray(with_heads.state.store.count).sum()
  assert learned.report.slow.decision in ("bootstrap", "learning")  # the heads are learning
  with pytest.raises(ValueError, match="heads must be heads, None or 'learn'"):
    _backend(model, heads="fit", num_generations=2)


# --- sample ids, seeds and outputs --------------------------------------------------------------


def test_group_layout_sample_ids_and_seed(model, vanilla):
  b, (out, _) = vanilla
  # a group's members differ; responses do not depend on how the batch is split into calls
  assert not _same(out.tokens[:1], out.tokens[1:2]) and not _same(out.tokens[2:3], out.tokens[3:])
  split = _backend(model, num_generations=2)
  halves = split.generate(PROMPTS[:2], RC).tokens + split.generate(PROMPTS[2:], RC).tokens
  assert _same(halves, out.tokens)
  assert split.last_sample_ids.tolist() == [2, 3]
  # a raw jax key seed reads as its integer; another seed gives other responses
  again = _backend(model)
  keyed = again.generate(PROMPTS, dataclasses.replace(RC, seed=jax.random.PRNGKey(3)))
  assert _same(keyed.tokens, out.tokens)
  again.next_sample_id = 0
  other = again.generate(PROMPTS, dataclasses.replace(RC, seed=4))
  assert not _same(other.tokens, out.tokens)
  with pytest.raises(ValueError, match="not 2 copies of one prompt"):
    split.generate(["a", "b", "c", "c"], RC)
  with pytest.raises(ValueError, match="3 prompts is not a multiple of num_generations=2"):
    split.generate(["a", "a", "b"], RC)


def test_output_follows_tunix_conventions(model, vanilla):
  b, (out, _) = vanilla
  tok = CharTokenizer()
  left = out.left_padded_prompt_tokens
  assert left.shape == (4, RC.max_prompt_length)
  for i, p in enumerate(PROMPTS):
    ids = [BOS] + tok.encode(p)
    assert left[i, -len(ids):].tolist() == ids and (left[i, : -len(ids)] == PAD).all()
  assert all((t != EOS).all() for t in out.tokens)  # a sampled EOS is cut, as tunix's engine does
  assert out.text == [tok.decode(t.tolist()) for t in out.tokens]
  kept = _backend(model, keep_eos=True).generate(PROMPTS, RC)  # as tunix's vLLM engine does
  ended = [t for t in kept.tokens if len(t) < RC.max_tokens_to_generate]
  assert all(t[-1] == EOS and (t[:-1] != EOS).all() for t in ended)
  assert _same(out.tokens, [t[:-1] if t[-1] == EOS else t for t in kept.tokens])


# --- (4) rollout logprobs == trainer logprobs == get_per_token_logps -----------------------------


def test_logprobs_equal_trainer_and_per_token_logps(model, vanilla):
  b, (out, _) = vanilla
  m = RC.max_tokens_to_generate
  lens = np.array([len(t) for t in out.tokens])
  comp = np.stack([np.pad(t, (0, m - len(t)), constant_values=PAD) for t in out.tokens])
  rollout_lp = np.stack([np.pad(x, (0, m - len(x))) for x in out.logprobs])
  live = np.arange(m)[None] < lens[:, None]
  assert (rollout_lp[live] <= 0).all() and (rollout_lp[live] < -0.5).any()
  # our trainer's teacher-forced logprobs, prompts right-padded here (independently of the
  # engine's own conversion)
  left = out.left_padded_prompt_tokens
  plens = (left != PAD).sum(axis=1)
  right = np.zeros_like(left)
  for i, n in enumerate(plens):
    right[i, :n] = left[i, left.shape[1] - n:]
  sampling = sr.sampling_from_rollout_config(RC)
  params = sr.params_from_tunix(b.config, sr.tunix_source(b.config, model))
  trainer = trainer_logprobs(b.config, params, jnp.asarray(right), jnp.asarray(plens),
                             jnp.asarray(comp), jnp.asarray(lens), sampling).logprobs
  np.testing.assert_allclose(np.asarray(trainer), rollout_lp, atol=ATOL, rtol=0)
  # tunix's call (left-padded prompts, pad-padded completions), with and without a mask
  masked = b.get_per_token_logps(jnp.asarray(left), jnp.asarray(comp), jnp.asarray(live))
  np.testing.assert_allclose(np.asarray(masked), rollout_lp, atol=ATOL, rtol=0)
  plain = np.asarray(b.get_per_token_logps(jnp.asarray(left), jnp.asarray(comp)))
  tunix_mask = comp != PAD  # what tunix's GRPO loss keeps
  np.testing.assert_allclose(plain[tunix_mask], rollout_lp[tunix_mask], atol=ATOL, rtol=0)


# --- update_params ------------------------------------------------------------------------------


def test_update_params_changes_what_we_decode(vanilla):
  _, (want_a, _) = vanilla  # decoded from _qwen2(seed=1)
  other = _qwen2(seed=5)
  want_b = _backend(other).generate(PROMPTS, RC)
  target = _qwen2(seed=1)
  b = _backend(target)
  assert _same(b.generate(PROMPTS, RC).tokens, want_a.tokens)
  b.update_params(nnx.state(other, nnx.Param), (nnx.Param,))
  assert b.model().layers[0].attn.q_proj.w.get_value() is other.layers[0].attn.q_proj.w.get_value()
  b.next_sample_id = 0
  got = b.generate(PROMPTS, RC)
  assert _same(got.tokens, want_b.tokens) and not _same(got.tokens, want_a.tokens)
  bad = nnx.to_pure_dict(nnx.state(other, nnx.Param))
  bad["layers"][1]["mlp"]["up_proj"]["kernel"] = jnp.zeros((32, 65))
  with pytest.raises(ValueError, match=re.escape("layers.1.mlp.up_proj.kernel has shape (32, 65), "
                                                 "expected (32, 64)")):
    b.update_params(bad)


# --- (3) tunix's GRPOLearner with our backend ---------------------------------------------------


class _Recording(sr.SpecRollRollout):
  """Records each generate call: the prompts, the Params it decoded with, tokens and sample ids."""

  calls: list = []

  def generate(self, prompts, rollout_config, **kw):
    params = _params(self.model())
    out = super().generate(prompts, rollout_config, **kw)
    _Recording.calls.append((list(prompts), params, out.tokens, self.last_sample_ids.tolist()))
    return out


def test_grpo_learner_trains_with_our_rollout():
  actor = _qwen2(seed=1)
  initial = _params(actor)
  _Recording.calls = []
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  config = rlc.ClusterConfig(
      role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
      rollout_engine=functools.partial(_Recording, proposer=PromptLookup(), proposer_params=(),
                                       num_generations=2, specroll=FIXED),
      offload_to_cpu=False,
      training_config=rlc.RLTrainingConfig(actor_optimizer=optax.sgd(1.0), eval_every_n_steps=100,
                                           max_steps=2),
      rollout_config=RC)
  cluster = rlc.RLCluster(actor=actor, reference=None, tokenizer=CharTokenizer(),
                          cluster_config=config)
  assert isinstance(cluster.rollout, sr.SpecRollRollout)

  def reward(prompts, completions, **kw):  # varies within a group: non-zero advantages
    return [float(sum(c.count(x) for x in "aeiou")) + 0.1 * len(c) for c in completions]

  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=reward,
      algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.0))
  # tunix shares the trainer's module with a custom engine and then never calls update_params:
  # the rollout must follow the module itself
  assert cluster.rollout.model() is cluster.actor_trainer.model and not learner.should_sync_weights
  data = [{"prompts": np.array(PROMPTS[::2])}, {"prompts": np.array(PROMPTS_2[::2])},
          {"prompts": np.array(["unused", "unused too"])}]
  learner.train(data)

  calls = _Recording.calls
  assert len(calls) == 2
  assert [c[0] for c in calls] == [PROMPTS, PROMPTS_2]  # tunix's layout: each prompt G times
  assert [c[3] for c in calls] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # group_sample_ids(prompt, G)
  moved = lambda a, b: max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.abs(x - y).max()),
                                                        a, b)))
  assert moved(initial, calls[0][1]) == 0.0  # step 1 decoded the initial policy
  assert moved(calls[0][1], calls[1][1]) > 0.0  # the trainer updated the shared module
  # the second step's tokens are the updated policy's, not the initial one's
  probe = _backend(_qwen2(seed=9), num_generations=2)
  for params, same in ((calls[1][1], True), (calls[0][1], False)):
    probe.update_params(_state(probe.model(), params))
    probe.next_sample_id = 4
    assert _same(probe.generate(PROMPTS_2, RC).tokens, calls[1][2]) == same


# --- (5) bad input ------------------------------------------------------------------------------


def test_unmappable_model_and_tokenizer_are_refused(model):
  with pytest.raises(ValueError, match=r"cannot map flax\.nnx.*Linear onto specroll_jax's "
                                       r"decoder; supported model families: .*Qwen2.*Llama3"):
    _backend(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="tokenizer vocabulary size 72 exceeds the model's "
                                       "vocab_size 64"):
    sr.SpecRollRollout(rollout_actor=model, tokenizer=CharTokenizer(V + 8), rollout_config=RC)


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.5, "RolloutConfig.temperature=-0.5 is outside our limits: a finite "
                          "number >= 0"),
    ("temperature", float("nan"), "RolloutConfig.temperature=nan is outside our limits"),
    ("top_p", 1.5, "RolloutConfig.top_p=1.5 is outside our limits: None (greedy) or in (0, 1]"),
    ("top_k", -3, "RolloutConfig.top_k=-3 is outside our limits"),
    ("max_tokens_to_generate", 0, "RolloutConfig.max_tokens_to_generate=0 is outside our "
                                  "limits: an int >= 1"),
    ("max_prompt_length", 0, "RolloutConfig.max_prompt_length=0 is outside our limits"),
    ("max_prompt_length", 32760, "RolloutConfig.max_prompt_length=32760 + "
                                 "max_tokens_to_generate=12 = 32772 exceeds our "
                                 "max_position_embeddings 32768"),
    ("eos_tokens", [V], "RolloutConfig.eos_tokens=[64] is outside our limits: ids in "
                        "[0, vocab_size=64)"),
    ("seed", 2**32, "RolloutConfig.seed=4294967296 is outside our limits: [0, 2**32)"),
    ("data_type", jnp.int32, "RolloutConfig.data_type=int32 is outside our limits; supported: "
                             "['float32', 'bfloat16', 'float16']"),
])
def test_rollout_config_outside_limits(model, vanilla, field, value, message):
  bad = dataclasses.replace(RC, **{field: value})
  with pytest.raises(ValueError, match=re.escape(message)):
    _backend(model, rollout_config=bad)
  with pytest.raises(ValueError, match=re.escape(message)):
    vanilla[0].generate(PROMPTS, bad)


def test_prompt_wider_than_position_limit(model):
  b = _backend(model, max_position_embeddings=40)  # 16 + 12 fits
  with pytest.raises(ValueError, match=re.escape(
      "prompt width 32 (max_prompt_length=16, longest prompt 31 tokens) + "
      "max_tokens_to_generate=12 exceeds our max_position_embeddings 40")):
    b.generate(["x" * 30], RC)


# --- (6) a Hugging Face folder in tunix: tunix_qwen2_from_pretrained, experiments/tunix_grpo.py ---

# the example's --quick rollout settings: the vanilla program decoded here is the one its final
# check compiles (jax's persistent compilation cache, set in conftest, serves it the second time)
EMBEDDED_RC = base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=64,
                                         temperature=1.0, top_p=1.0, top_k=None, seed=0)


def test_qwen2_from_pretrained_is_our_model(tmp_path):
  """tunix's Qwen2 built from the embedded model's folder: our config, our decoder's logits, and
  SpecRollRollout on it (the folder's tokenizer through transformers) decodes the tokens of
  ``rollout.generate`` on our parameters for the same sample ids and seed."""
  import json
  import shutil

  from transformers import AutoTokenizer

  from app import pipeline
  from app.tasks import Task
  from specroll_jax import models, rollout
  from specroll_jax.data import gsm8k

  path = pipeline.default_model_path(progress=False)
  m = sr.tunix_qwen2_from_pretrained(path)
  config, params = models.load_pretrained(path)
  assert sr.model_config_from_tunix(m) == config.replace(
      max_position_embeddings=32768, eos_token_ids=(), bos_token_id=None)
  b, t = 2, 13
  toks = jax.random.randint(jax.random.key(7), (b, t), 0, config.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  theirs, _ = m(toks, pos, None, mask)
  ours = decoder.forward(config, params, toks, kernels="reference")
  assert float(jnp.std(theirs)) > 0.5
  np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=ATOL, rtol=0)

  tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
  questions = [gsm8k.format_prompt(e.question)
               for e in Task(name="synthetic", level=0, train_size=2).examples("train")]
  prompts = list(np.repeat(questions, 2))  # tunix's layout, G = 2
  out = sr.SpecRollRollout(m, tok, rollout_config=EMBEDDED_RC, num_generations=2).generate(
      prompts, EMBEDDED_RC)
  eos = tok.eos_token_id
  ref = rollout.generate(config, params, [tok.encode(p) for p in prompts],
                         sampling=sr.sampling_from_rollout_config(EMBEDDED_RC),
                         max_new_tokens=16, seed=0, sample_ids=np.arange(4), eos_ids=[eos])
  want = [r[:n - int(n > 0 and r[n - 1] == eos)]  # the engine cuts a sampled EOS
          for r, n in zip(np.asarray(ref.tokens), np.asarray(ref.lengths), strict=True)]
  assert _same(out.tokens, want) and sum(len(x) for x in want) > 8
  for got, r, n in zip(out.logprobs, np.asarray(ref.logprobs), map(len, want), strict=True):
    np.testing.assert_allclose(got, r[:n], atol=ATOL, rtol=0)

  # refused: a folder that is not Qwen2, missing files, a dtype outside our limits
  hf = json.loads((path / "config.json").read_text())
  llama = tmp_path / "llama"
  llama.mkdir()
  (llama / "config.json").write_text(json.dumps(
      {**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
  with pytest.raises(ValueError, match=re.escape("ModelConfig.architecture='llama' (qkv_bias="
                                                 "False) is not Qwen2")):
    sr.tunix_qwen2_from_pretrained(llama)
  bare = tmp_path / "bare"
  bare.mkdir()
  with pytest.raises(ValueError, match="config.json not found"):
    sr.tunix_qwen2_from_pretrained(bare)
  shutil.copy(path / "config.json", bare / "config.json")
  with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
    sr.tunix_qwen2_from_pretrained(bare)
  with pytest.raises(ValueError, match="is not a folder"):
    sr.tunix_qwen2_from_pretrained(tmp_path / "absent")
  with pytest.raises(ValueError, match=re.escape("dtype=int32 is outside our limits")):
    sr.tunix_qwen2_from_pretrained(path, dtype=jnp.int32)
  with pytest.raises(ValueError, match=re.escape("ModelConfig.rope_scaling=(('factor', 8.0),): "
                                                 "tunix's Qwen2 applies no rope scaling")):
    sr.tunix_qwen2_config(config.replace(rope_scaling=(("factor", 8.0),)))
  bf16 = sr.tunix_qwen2_config(config, dtype="bfloat16")
  assert bf16.dtype == bf16.param_dtype == jnp.bfloat16 and bf16.use_tied_embedding


def test_tunix_grpo_example_quick(tmp_path, capsys):
  """experiments/tunix_grpo.py --quick: tunix's GRPOLearner on the embedded model with SpecRoll
  rollouts (shipped heads), two steps; its first batch decoded again by the vanilla engine gives
  identical tokens (main exits 1 otherwise)."""
  from conftest import load_script

  res = load_script("tunix_grpo.py").main(["--quick", "--out", str(tmp_path / "run.json")])
  assert res["first_step_identical"] and [s["step"] for s in res["steps"]] == [1, 2]
  assert all(s["mode"] == "speculative" and s["tau"] > 1.0 for s in res["steps"])
  printed = capsys.readouterr().out
  assert "step 2  reward_mean" in printed and "identical tokens" in printed


# --- (6) on tunix's mesh -----------------------------------------------------------------------

_MESH_SCRIPT = '''
import functools, json, sys
sys.path.insert(0, {tests!r})
import jax, numpy as np, optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import test_tunix as tt
from tunix.rl import rl_cluster as rlc
from tunix.rl.grpo import grpo_learner
from specroll_jax.proposers import PromptLookup
assert jax.device_count() == 4
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("fsdp", "tp"))
one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))

def shard(model):  # the model's Params placed by tunix's own sharding annotations
  state = nnx.state(model, nnx.Param)
  specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s if isinstance(s, P) else P()))
  nnx.replace_by_pure_dict(state, jax.tree.map(put, nnx.to_pure_dict(state), specs,
                                               is_leaf=lambda x: x is None or isinstance(x, P)))
  nnx.update(model, state)
  return model

res = {{}}
m1, m4 = tt._qwen2(), shard(tt._qwen2())
res["specs"] = sorted({{str(x.sharding.spec) for x in
                        jax.tree.leaves(nnx.to_pure_dict(nnx.state(m4, nnx.Param)))}})
spec_kw = dict(proposer=PromptLookup(), proposer_params=(), specroll=tt.FIXED)
for name, kw in (("vanilla", {{}}), ("speculative", spec_kw)):
  a = tt._backend(m1, num_generations=2, **kw).generate(tt.PROMPTS, tt.RC)
  b4 = tt._backend(m4, num_generations=2, mesh=mesh, **kw)
  b = b4.generate(tt.PROMPTS, tt.RC)
  res[name] = tt._same(a.tokens, b.tokens)
  res[name + "_on_mesh"] = b4._model_mesh is not None

def learn(mesh):  # tunix's GRPOLearner with our backend, every role on ``mesh``
  tt._Recording.calls, rewards = [], []
  def reward(prompts, completions, **kw):
    r = [float(sum(c.count(x) for x in "aeiou")) + 0.1 * len(c) for c in completions]
    rewards.append(r)
    return r
  config = rlc.ClusterConfig(
      role_to_mesh={{rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh}},
      rollout_engine=functools.partial(tt._Recording, proposer=PromptLookup(), proposer_params=(),
                                       num_generations=2, specroll=tt.FIXED),
      offload_to_cpu=False,
      training_config=rlc.RLTrainingConfig(actor_optimizer=optax.sgd(1.0), eval_every_n_steps=100,
                                           max_steps=2),
      rollout_config=tt.RC)
  cluster = rlc.RLCluster(actor=tt._qwen2(seed=1), reference=None, tokenizer=tt.CharTokenizer(),
                          cluster_config=config)
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=reward,
      algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.0))
  learner.train([{{"prompts": np.array(tt.PROMPTS[::2])}},
                 {{"prompts": np.array(tt.PROMPTS_2[::2])}},
                 {{"prompts": np.array(["unused", "unused too"])}}])
  split = any(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated for x in
              jax.tree.leaves(nnx.to_pure_dict(nnx.state(cluster.rollout.model(), nnx.Param))))
  return [[t.tolist() for t in c[2]] for c in tt._Recording.calls], rewards, split

def error(fn):
  try:
    fn()
  except ValueError as e:
    return str(e)
res["bad_axes"] = error(lambda: tt._backend(m1, mesh=mesh, mesh_axes=("data", "model")))
res["kv_heads"] = error(lambda: tt._backend(
    m1, mesh=Mesh(np.array(jax.devices()).reshape(1, 4), ("fsdp", "tp"))))

# experiments/tunix_grpo.py on a mesh: rows over fsdp (the embedded model's one KV head allows no
# tp > 1: refused, naming it)
from conftest import load_script
script = load_script("tunix_grpo.py")
run = script.main(["--quick", "--mesh", "2x1", "--out", {out!r}])
res["script"] = {{"identical": run["first_step_identical"],
                  "modes": [s["mode"] for s in run["steps"]]}}
try:
  script.main(["--quick", "--mesh", "1x2", "--out", {out!r}])
except SystemExit as e:
  res["script"]["tp2_exit"] = e.code

t1, r1, _ = learn(one)
t4, r4, split = learn(mesh)
res["learner"] = {{"tokens": t1 == t4, "rewards": r1 == r4, "split": split, "steps": len(t4),
                   "rewards_vary": len(set(sum(r4, []))) > 1}}
print("RESULT " + json.dumps(res))
'''


def test_decodes_on_tunix_mesh_same_tokens_and_rewards(tmp_path):
  """On a ('fsdp', 'tp') = (2, 2) mesh with the weights sharded by tunix's annotations, the
  backend decodes on the mesh (rows over fsdp, weights and cache over tp) and gives the
  single-device tokens, vanilla and speculative; tunix's GRPOLearner with every role on that mesh
  records the same tokens and rewards as on one device; experiments/tunix_grpo.py --mesh runs on
  one and refuses a tp the model's KV heads do not allow."""
  from conftest import run_on_cpu_devices
  res = run_on_cpu_devices(tmp_path, _MESH_SCRIPT.format(
      tests=str(__import__("pathlib").Path(__file__).parent), out=str(tmp_path / "run.json")),
      timeout=900)
  assert "PartitionSpec('tp', 'fsdp')" in res["specs"] or "P('tp', 'fsdp')" in res["specs"], res
  assert res["vanilla"] and res["speculative"], res
  assert res["vanilla_on_mesh"] and res["speculative_on_mesh"], res
  lr = res["learner"]
  assert lr["steps"] == 2 and lr["split"] and lr["rewards_vary"], lr
  assert lr["tokens"] and lr["rewards"], lr
  assert "('fsdp', 'tp')" in res["bad_axes"] and "'model'" in res["bad_axes"], res["bad_axes"]
  assert "num_kv_heads=2" in res["kv_heads"] and "'tp' of size 4" in res["kv_heads"], res
  sc = res["script"]
  assert sc["identical"] and sc["modes"] == ["speculative"] * 2 and sc["tp2_exit"] == 2, sc



def test_nonfinite_flag_with_specroll():
  """``on_nonfinite="flag"`` through SpecRoll (not only the vanilla engine): a poisoned prompt's
  rows are flagged with a warning, not raised; "raise" raises."""
  model = _qwen2(seed=5)
  state = nnx.state(model, nnx.Param)
  pure = nnx.to_pure_dict(state)
  bad = CharTokenizer().encode("z")[0]
  pure["embedder"]["input_embedding"] = pure["embedder"]["input_embedding"].at[bad].set(jnp.nan)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(model, state)
  kw = dict(proposer=PromptLookup(), proposer_params=(), specroll=FIXED, num_generations=2)
  prompts = ["abc", "abc", "xyz", "xyz"]
  with pytest.raises(FloatingPointError, match="non-finite"):
    _backend(model, **kw).generate(prompts, RC)
  flag = _backend(model, on_nonfinite="flag", **kw)
  with pytest.warns(RuntimeWarning, match="non-finite"):
    out = flag.generate(prompts, RC)
  assert np.asarray(flag.last_rollout.stats.nonfinite)[2:].all() and len(out.tokens) == 4
