"""The GRPO steps on 4 devices give the same update as on 1 (docs/design.md, "GRPO"): the offline
step
over finished rollouts (seq_mean, KL to a reference) and the fully on-device step (vanilla rollouts
+ jnp reward + gradient, token_mean). One subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` set before jax is imported runs both meshes
(1 device and 4 devices), two steps each, and reports the differences."""

import json
import textwrap
from pathlib import Path

import pytest
from conftest import run_on_cpu_devices

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from specroll_jax import grpo, models, rollout
    from specroll_jax.sampling import SamplingConfig
    assert jax.device_count() == 4, jax.devices()
    config = models.ModelConfig.tiny(vocab_size=32, max_position_embeddings=128)
    params = models.init_params(jax.random.key(0), config)
    G, NP, M, EOS = 4, 8, 12, [5, 9]
    LR = 2e-4  # Adam turns gradient components at rounding level (e.g. the k_proj directions
    #   that softmax's shift invariance leaves at zero) into O(lr) steps; measured worst 1-vs-4
    #   device gap about 1% of lr, so lr 2e-4 keeps it well inside 1e-5 while updates are ~4e-4
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 32, rng.integers(2, 9)).tolist() for _ in range(NP)]
    targets = rng.integers(0, 32, NP).astype(np.int32)
    samp = SamplingConfig(temperature=1.0, top_k=24)
    meshes = {n: Mesh(np.array(jax.devices()[:n]), ("data",)) for n in (1, 4)}
    # data 2 x model 2: rows over data by hand, weights, optimizer moments and (in the on-device
    # step) the rollouts' KV cache over model (GSPMD); the same update as one device
    meshes["2x2"] = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))

    def reward_fn(prompt_tokens, prompt_lengths, tokens, lengths, data):
      live = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
      return ((tokens % 2 == 0) & live).sum(1) / 4 + (tokens[:, 0] == data)

    def diff(a, b):
      return max(float(np.abs(x - y).max()) for x, y in
                 zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    res = {}
    # offline step: rollouts from generate (sample id = prompt * G + member), rewards in numpy
    rep = [p for p in prompts for _ in range(G)]
    sids = np.arange(NP * G)
    b = rollout.prepare_batch(config, rep, max_new_tokens=M, eos_ids=EOS, sample_ids=sids)
    r = rollout.generate(config, params, rep, sampling=samp, max_new_tokens=M, seed=3,
                         eos_ids=EOS, sample_ids=sids)
    rewards = np.asarray(reward_fn(None, None, r.tokens, r.lengths, np.repeat(targets, G)))
    batch = grpo.Batch.from_rollout(b.tokens, b.lengths, r, rewards)
    cfg = grpo.GRPOConfig(group_size=G, learning_rate=LR, micro_batches=2, sampling=samp,
                          aggregation="seq_mean", beta=0.04)
    runs = {}
    for n, mesh in meshes.items():
      step = grpo.make_train_step(config, cfg, mesh=mesh)
      state = grpo.init_train_state(params, cfg)
      mets = []
      for _ in range(2):  # the second step reuses the batch: ratio != 1, clipping and KL active
        state, m = step(state, batch)
        mets.append({k: float(v) for k, v in jax.device_get(m).__dict__.items()})
      runs[n] = (jax.device_get(state.params), mets)
    res["offline"] = {"param_diff": diff(runs[1][0], runs[4][0]),
                      "param_diff_2x2": diff(runs[1][0], runs["2x2"][0]), "m2x2": runs["2x2"][1],
                      "update": diff(runs[1][0], params), "m1": runs[1][1], "m4": runs[4][1],
                      "lengths": np.asarray(r.lengths).tolist()}

    # fully on-device step: the same prompts, global indices 0..NP-1, seeds 3 then 4
    pb = grpo.StepPrompts(tokens=jnp.asarray(b.tokens[::G]), lengths=jnp.asarray(b.lengths[::G]),
                          indices=jnp.arange(NP, dtype=jnp.int32), reward_data=jnp.asarray(targets))
    cfg = grpo.GRPOConfig(group_size=G, learning_rate=LR, micro_batches=2, sampling=samp)
    runs = {}
    for n, mesh in meshes.items():
      step = grpo.make_rollout_train_step(config, cfg, reward_fn, max_new_tokens=M, eos_ids=EOS,
                                          mesh=mesh, rollout_kernels="reference")
      state = grpo.init_train_state(params, cfg)
      mets, toks = [], []
      for seed in (3, 4):
        state, m, ro = step(state, pb, seed)
        mets.append({k: float(v) for k, v in jax.device_get(m).__dict__.items()})
        toks.append(np.asarray(ro.tokens))
      runs[n] = (jax.device_get(state.params), mets, toks)
    res["on_device"] = {
        "param_diff": diff(runs[1][0], runs[4][0]), "update": diff(runs[1][0], params),
        "param_diff_2x2": diff(runs[1][0], runs["2x2"][0]), "m2x2": runs["2x2"][1],
        "m1": runs[1][1], "m4": runs[4][1],
        "tokens_equal": all(bool((a == c).all()) for a, c in zip(runs[1][2], runs[4][2])),
        "tokens_equal_2x2": all(bool((a == c).all()) for a, c in zip(runs[1][2],
                                                                    runs["2x2"][2])),
        "first_equals_generate": bool((runs[4][2][0] == np.asarray(r.tokens)).all())}
    print("RESULT " + json.dumps(res))
""")


@pytest.mark.slow  # a 4-device subprocess
def test_grpo_steps_same_update_on_1_and_4_devices_and_data_x_model(tmp_path):
  res = run_on_cpu_devices(tmp_path, _SCRIPT)
  print(json.dumps({k: {f: v[f] for f in ("param_diff", "update")} for k, v in res.items()}))
  off, dev = res["offline"], res["on_device"]
  assert min(off["lengths"]) < 12 and max(off["lengths"]) == 12  # ragged: EOS in some rows
  for name, r in (("offline", off), ("on_device", dev)):
    assert r["update"] > 2e-4, (name, r)  # two updates of about lr: 1e-5 below is meaningful
    assert r["param_diff"] <= 1e-5, (name, r)
    assert r["param_diff_2x2"] <= 1e-5, (name, r)  # data 2 x model 2
    for m1, m4 in [*zip(r["m1"], r["m4"], strict=True), *zip(r["m1"], r["m2x2"], strict=True)]:
      assert m1["tokens"] == m4["tokens"] and m1["sequences"] == m4["sequences"] == 32
      for k in ("loss", "grad_norm", "ratio_mean", "reward_mean", "ref_kl", "entropy"):
        assert abs(m1[k] - m4[k]) <= 1e-5 * max(1.0, abs(m1[k])), (name, k, m1, m4)
      assert m1["clip_fraction"] == m4["clip_fraction"], (name, m1, m4)
  # step 0 of a batch: ratio 1 (trainer logprobs == rollout logprobs); step 1 reuses the batch
  assert abs(off["m1"][0]["ratio_mean"] - 1) < 1e-5 and off["m1"][0]["clip_fraction"] == 0
  assert off["m1"][1]["clip_fraction"] > 0 and off["m1"][1]["ref_kl"] > 0
  assert dev["tokens_equal"] and dev["tokens_equal_2x2"] and dev["first_equals_generate"]
