"""The data-parallel GRPO step across processes, on one machine (README, "GPU, TPU, several hosts").

Two processes join one JAX run through ``specroll_jax.distributed.initialize`` (coordinator on
127.0.0.1, a free port; gloo CPU collectives; two CPU devices each, so ``jax.devices()`` lists
four). Each builds the same tiny model and the same global batch, feeds only its own rows
(``jax.make_array_from_process_local_data`` over ``Mesh(jax.devices(), ("data",))``), runs two
GRPO steps, saves an orbax checkpoint collectively and restores it. One process with four CPU
devices then runs the same two steps on the whole batch: the parameters agree within float
rounding, and the restored checkpoint equals the parameters after step 2 bit for bit.

Also: a process whose coordinator is unreachable fails within ``timeout_s`` with an error naming
the address (jax alone aborts the process after ``initialization_timeout``, 5 minutes by default).
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import PYTHONPATH, xla_flags

ROOT = Path(__file__).resolve().parents[1]

_WORKER = textwrap.dedent("""
    import json, sys
    mode, out, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    import jax
    if mode.startswith("multi"):
      from specroll_jax import distributed
      distributed.initialize(f"127.0.0.1:{port}", 2, pid, timeout_s=60)
      assert jax.process_count() == 2 and jax.local_device_count() == 2, jax.devices()
    assert jax.device_count() == 4, jax.devices()
    import jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from specroll_jax import grpo, models, rollout
    from app.checkpoint import Checkpointer
    from specroll_jax.sampling import SamplingConfig

    config = models.ModelConfig.tiny(vocab_size=256, max_position_embeddings=256)
    params = models.init_params(jax.random.key(0), config)
    G, NP, M, EOS, V = 4, 8, 12, [5, 9], 256
    LR = 2e-4  # as tests/test_grpo_sharded.py: well above the 1-vs-4-device rounding gap
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, rng.integers(2, 9)).tolist() for _ in range(NP)]
    samp = SamplingConfig(temperature=1.0, top_k=24)
    # the global batch, the same in every process: rollouts on this process's own devices
    rep = [p for p in prompts for _ in range(G)]
    sids = np.arange(NP * G)
    b = rollout.prepare_batch(config, rep, max_new_tokens=M, eos_ids=EOS, sample_ids=sids)
    r = rollout.generate(config, params, rep, sampling=samp, max_new_tokens=M, seed=3,
                         eos_ids=EOS, sample_ids=sids)
    live = np.arange(M)[None] < np.asarray(r.lengths)[:, None]
    rewards = ((np.asarray(r.tokens) % 2 == 0) & live).sum(1) / 4.0
    rows = {"prompt_tokens": np.asarray(b.tokens, np.int32),
            "prompt_lengths": np.asarray(b.lengths, np.int32),
            "tokens": np.asarray(r.tokens, np.int32), "lengths": np.asarray(r.lengths, np.int32),
            "logprobs": np.asarray(r.logprobs, np.float32),
            "rewards": np.asarray(rewards, np.float32)}
    B = NP * G
    mesh = Mesh(np.array(jax.devices()), ("data",))
    if mode == "multi2x2":
      # data 2 x model 2: a process's two devices hold one data shard, the weights split over them
      mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
      assert {d.process_index for d in mesh.devices[jax.process_index()]} == {
          jax.process_index()}
      # and the rollouts on this process's own devices as model 2: the single-device tokens
      from specroll_jax.mesh import ModelMesh
      local = ModelMesh(Mesh(np.array(jax.local_devices()).reshape(1, 2), ("data", "model")))
      lr = rollout.generate(config, local.shard_params(config, params), rep, sampling=samp,
                            max_new_tokens=M, seed=3, eos_ids=EOS, sample_ids=sids,
                            options=rollout.DecodeOptions(mesh=local))
      local_tokens_equal = bool((np.asarray(lr.tokens) == np.asarray(r.tokens)).all())
    if mode.startswith("multi"):
      # this process's rows of the global batch: the ones its devices hold under P("data")
      sharding = NamedSharding(mesh, P("data"))
      idx = sorted(s[0].indices(B)[:2] for s in sharding.addressable_devices_indices_map(
          (B,)).values())
      lo, hi = idx[0][0], idx[-1][1]
      assert hi - lo == B // 2, idx
      batch = grpo.Batch(**{k: jax.make_array_from_process_local_data(sharding, v[lo:hi])
                            for k, v in rows.items()})
      assert batch.tokens.shape == (B, M) and not batch.tokens.is_fully_addressable
    else:
      lo, hi = 0, B
      batch = grpo.Batch(**{k: jnp.asarray(v) for k, v in rows.items()})
    # Adam's eps well above rounding: GRPO's gradient is a group-centred sum with large
    # cancellations, and with eps 1e-8 Adam turns a component at rounding level (its sign set by
    # the reduction order of a model-split matmul) into a full +-lr step (measured: one embedding
    # row 3e-4 apart); with eps 1e-4 such components move by ~1e-3 lr, real ones still by ~lr
    cfg = grpo.GRPOConfig(group_size=G, learning_rate=LR, micro_batches=2, sampling=samp,
                          aggregation="seq_mean", beta=0.04, adam_eps=1e-4)
    step = grpo.make_train_step(config, cfg, mesh=mesh)
    state = grpo.init_train_state(params, cfg)
    mets = []
    for _ in range(2):
      state, m = step(state, batch)
      mets.append({k: float(v) for k, v in jax.device_get(m).__dict__.items()})
    flat = lambda t: {jax.tree_util.keystr(p): np.asarray(x)
                      for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
    after = flat(state.params)
    res = {"rows": [lo, hi], "metrics": mets, "process": jax.process_index(),
           "checksum": float(sum(np.abs(x).astype(np.float64).sum() for x in after.values()))}
    if mode == "multi2x2":
      res["local_tokens_equal"] = local_tokens_equal
      q = jax.tree.leaves(state.params["layers"]["q_proj"])[-1]
      res["q_split"] = list(q.sharding.shard_shape(q.shape)) != list(q.shape)
    if mode.startswith("multi"):
      # every process saves (orbax coordinates: process 0 writes the metadata and commits the
      # step after a barrier); every process restores into the same global shardings
      ck = Checkpointer(out + "/ckpt", async_save=False)
      ck.save(2, state, {"step": 2})
      ck.wait()
      restored, meta = ck.restore(2, like=state)
      ck.close()
      back = flat(restored.params)
      res["meta"] = meta
      res["restored_sharding"] = str(jax.tree.leaves(restored.params)[0].sharding)
      res["restored_same_sharding"] = all(
          x.sharding.is_equivalent_to(y.sharding, x.ndim) for x, y in
          zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True))
      res["restored_equal"] = all(bool((back[k] == after[k]).all()) for k in after)
      res["restored_step"] = int(np.asarray(restored.step))
      if jax.process_index() == 0:
        np.savez(out + "/restored.npz", **back)
    if jax.process_index() == 0:
      np.savez(out + f"/{mode}.npz", **after)
      np.savez(out + "/initial.npz", **flat(params))
    print("RESULT " + json.dumps(res), flush=True)
""")


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  return dict(os.environ, XLA_FLAGS=xla_flags(devices), PYTHONPATH=PYTHONPATH,
              JAX_PLATFORMS="cpu")


def _run_all(cmds, envs, timeout: float) -> list[dict]:
  """Start every command, wait for all (``timeout`` s in total); on a failure or timeout kill the
  rest and fail with every process's stderr. Returns each one's parsed ``RESULT`` line."""
  procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for c, e in zip(cmds, envs, strict=True)]
  deadline = time.monotonic() + timeout
  outs = [None] * len(procs)
  try:
    while any(o is None for o in outs):
      for i, p in enumerate(procs):
        if outs[i] is None and p.poll() is not None:
          outs[i] = p.communicate()
          if p.returncode != 0:
            raise RuntimeError(f"process {i} exited with {p.returncode}")
      if time.monotonic() > deadline:
        raise TimeoutError(f"not done within {timeout} s")
      time.sleep(0.2)
  except (RuntimeError, TimeoutError) as e:
    for p in procs:
      if p.poll() is None:
        p.kill()
    logs = []
    for i, p in enumerate(procs):
      o = outs[i] or p.communicate()
      logs.append(f"--- process {i} (rc {p.returncode}) stderr:\n{o[1][-3000:]}")
    pytest.fail(f"{e}\n" + "\n".join(logs))
  res = []
  for out, _ in outs:
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    res.append(json.loads(line[len("RESULT "):]))
  return res


@pytest.mark.slow  # three subprocesses, about a minute
def test_grpo_step_two_processes_equals_one_process_and_checkpoints(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  port = _free_port()
  t0 = time.monotonic()
  # the two processes of the multi-process run and the 4-device reference, side by side
  cmds = [[sys.executable, str(script), "multi", str(tmp_path), str(port), str(i)]
          for i in range(2)] + [[sys.executable, str(script), "single", str(tmp_path), "0", "0"]]
  *multi, single = _run_all(cmds, [_env(2), _env(2), _env(4)], timeout=300)
  print(json.dumps({"wall_s": round(time.monotonic() - t0, 1), "multi": multi,
                    "single": single}))
  assert [m["rows"] for m in multi] == [[0, 16], [16, 32]]  # each process fed its own half
  assert multi[0]["checksum"] == multi[1]["checksum"]  # replicated: the same params everywhere
  a, b, init = (np.load(tmp_path / f"{n}.npz") for n in ("multi", "single", "initial"))
  keys = sorted(init.files)
  diff = max(float(np.abs(a[k] - b[k]).max()) for k in keys)
  update = max(float(np.abs(a[k] - init[k]).max()) for k in keys)
  print(json.dumps({"param_diff": diff, "update": update}))
  assert update > 2e-4, update  # two updates of about lr: the 1e-5 below is meaningful
  assert diff <= 1e-5, diff
  for m_multi, m_single in zip(multi[0]["metrics"], single["metrics"], strict=True):
    assert m_multi["sequences"] == m_single["sequences"] == 32
    for k in ("loss", "grad_norm", "ratio_mean", "ref_kl"):
      assert abs(m_multi[k] - m_single[k]) <= 1e-5 * max(1.0, abs(m_single[k])), (k, m_multi)
  # the checkpoint: written collectively, restored in both processes, equal to step 2's params
  for m in multi:
    assert m["restored_equal"] and m["restored_step"] == 2 and m["meta"] == {"step": 2}, m
  back = np.load(tmp_path / "restored.npz")
  assert all((back[k] == a[k]).all() for k in keys)
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["2"]



@pytest.mark.slow  # three subprocesses, about a minute
def test_data_x_model_two_processes_equals_one_process(tmp_path):
  """Data 2 x model 2 over two processes of two devices (each process one data shard, the
  weights, the reference and Adam's moments split over its two devices) gives one process x 4
  devices' update; each process's own rollouts on its devices as model 2 give the single-device
  tokens; the model-split state checkpoints and restores with its shardings."""
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  port = _free_port()
  cmds = [[sys.executable, str(script), "multi2x2", str(tmp_path), str(port), str(i)]
          for i in range(2)] + [[sys.executable, str(script), "single", str(tmp_path), "0", "0"]]
  *multi, single = _run_all(cmds, [_env(2), _env(2), _env(4)], timeout=300)
  print(json.dumps({"multi": multi, "single": single}))
  assert [m["rows"] for m in multi] == [[0, 16], [16, 32]]
  assert all(m["local_tokens_equal"] and m["q_split"] for m in multi), multi
  a, b, init = (np.load(tmp_path / f"{n}.npz") for n in ("multi2x2", "single", "initial"))
  keys = sorted(init.files)
  diff = max(float(np.abs(a[k] - b[k]).max()) for k in keys)
  update = max(float(np.abs(a[k] - init[k]).max()) for k in keys)
  assert update > 2e-4 and diff <= 1e-5, (diff, update)
  for m_multi, m_single in zip(multi[0]["metrics"], single["metrics"], strict=True):
    for k in ("loss", "grad_norm", "ratio_mean", "ref_kl"):
      assert abs(m_multi[k] - m_single[k]) <= 1e-5 * max(1.0, abs(m_single[k])), (k, m_multi)
  for m in multi:
    assert m["restored_equal"] and m["restored_same_sharding"] and m["restored_step"] == 2, m



def _main_job_runs(tmp_path, flags, kind, timeout, multi_flags=()):
  """``experiments/gsm8k.py`` with ``flags`` as two processes of two CPU devices (plus
  ``multi_flags``; outputs under ``multi``) and as one process of four (``single``), side by
  side; each run's metrics records of rollout ``kind`` (the test fails with a process's log if it
  exits non-zero)."""
  port = _free_port()
  job = [sys.executable, str(ROOT / "experiments" / "gsm8k.py"), *flags]
  cmds = [job + ["--out", str(tmp_path / "multi"), *multi_flags, "--coordinator",
                 f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
          for i in range(2)]
  cmds.append(job + ["--out", str(tmp_path / "single")])
  envs = [dict(e, HOME=str(tmp_path / "home")) for e in (_env(2), _env(2), _env(4))]
  procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for c, e in zip(cmds, envs, strict=True)]
  try:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
    assert p.returncode == 0, f"process {i}:\n{log[-3000:]}"
  read = lambda d: [json.loads(x) for x in (tmp_path / d / kind / "metrics.jsonl")
                    .read_text().splitlines()]
  return read("multi"), read("single")


@pytest.mark.slow  # three subprocesses of the main job on a widened model, a few minutes
def test_main_job_data_x_model_on_two_processes(tmp_path):
  """``experiments/gsm8k.py --model-axis 2`` in two processes of two devices (data 2 x model 2:
  the weights, the reference and Adam's moments split over each process's two devices, its
  rollouts with SpecRoll on them) against one process of four devices with the whole model on
  every device: the same rewards and tokens' figures, updates equal within float rounding. The
  model is the embedded one widened to 6 query / 2 KV heads (a folder and heads file written
  here); the embedded model itself (3 query heads, one KV head) is refused."""
  import shutil

  import jax

  import specroll_jax
  from app.widen import WideShape, widen
  from specroll_jax import models
  from specroll_jax.heads import conditioned as cond_heads
  asset = Path(specroll_jax.__file__).parent / "assets" / "gsm8k-tiny"
  config, params = models.load_pretrained(asset)
  shape = WideShape(hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=2, head_dim=64,
                    intermediate_size=512)
  wc, wp, wh = widen(config, params, shape, key=jax.random.key(0),
                     heads=cond_heads.load(asset / "cond_heads.safetensors"))
  model = tmp_path / "wide"
  models.save_pretrained(model, wc, wp)
  for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(asset / f, model / f)
  cond_heads.save(tmp_path / "heads.safetensors", wh)
  flags = ["--model", str(model), "--heads", str(tmp_path / "heads.safetensors"),
           "--task", "synthetic", "--rollout", "specroll", "--budget", "fixed", "--steps", "2",
           "--prompts", "4", "--group", "4", "--max-new-tokens", "16", "--eval-prompts", "8",
           "--lr", "1e-3", "--warmup", "0", "--no-compare", "--buckets", "1.0"]
  multi, single = _main_job_runs(tmp_path, flags, "specroll", 900,
                                 multi_flags=["--model-axis", "2"])
  assert len(multi) == len(single) == 2
  for a, b in zip(multi, single, strict=True):
    for k in ("reward_mean", "accuracy", "response_tokens", "groups_mixed"):
      assert a[k] == b[k], (k, a[k], b[k])
    assert a["mode"] == b["mode"] == "speculative" and a["tau"] > 1.0
    for k in ("loss", "grad_norm", "entropy"):
      assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (k, a[k], b[k])
  assert any(r["grad_norm"] > 0 for r in single)
  summary = lambda d: json.loads((tmp_path / d / "summary.json").read_text())["table"]["specroll"]
  assert summary("multi")["held_out"] == summary("single")["held_out"]  # evaluated on the mesh
  refused = subprocess.run([sys.executable, str(ROOT / "experiments" / "gsm8k.py"),
                            "--model-axis", "2", "--steps", "1", "--out", str(tmp_path / "no")],
                           env=_env(2), capture_output=True, text=True, timeout=300)
  assert refused.returncode == 2 and "num_heads=3" in refused.stderr, refused.stderr[-2000:]


_UNREACHABLE = textwrap.dedent("""
    import sys, time
    from specroll_jax import distributed
    t = time.monotonic()
    try:
      distributed.initialize(sys.argv[1], 2, 1, timeout_s=3)
    except TimeoutError as e:
      print(f"RESULT {time.monotonic() - t:.2f} {e}", flush=True)
""")


def test_unreachable_coordinator_fails_fast_naming_the_address(tmp_path):
  script = tmp_path / "unreachable.py"
  script.write_text(_UNREACHABLE)
  addr = f"127.0.0.1:{_free_port()}"  # nothing listens there
  t = time.monotonic()
  proc = subprocess.run([sys.executable, str(script), addr], env=_env(1), capture_output=True,
                        text=True, timeout=60)
  took = time.monotonic() - t
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  assert addr in line and float(line.split()[1]) < 6, line
  assert took < 20, took


@pytest.mark.parametrize("args,field", [
    (("127.0.0.1", 2, 0), "coordinator"), (("127.0.0.1:x", 2, 0), "coordinator"),
    ((":1234", 2, 0), "coordinator"), (("h:70000", 2, 0), "coordinator"),
    (("h:1234", 0, 0), "num_processes"), (("h:1234", 2, 2), "process_id"),
    (("h:1234", 2, -1), "process_id"), (("h:1234", 2, True), "process_id")])
def test_initialize_refuses_bad_arguments(args, field):
  from specroll_jax import distributed
  with pytest.raises(ValueError, match=field):
    distributed.initialize(*args)


@pytest.mark.slow  # three main-job subprocesses, two to six minutes
@pytest.mark.parametrize("kind", ["vanilla", "specroll"])
def test_main_job_on_two_processes_equals_one_process(tmp_path, kind):
  """``experiments/gsm8k.py --coordinator --num-processes --process-id``: two processes (two CPU
  devices each) each decode and score their half of every batch and take one data-parallel step
  together; one process on four devices runs the same job. Same rewards, tokens and held-out
  accuracy, and updates equal within float rounding. With ``--rollout specroll`` the SpecRoll
  state is the same in both processes after every batch (checked by the object itself: its
  statistics and records are all-reduced; a split would raise) and tau is the whole batch's."""
  flags = ["--rollout", kind, "--steps", "2", "--prompts", "4", "--group", "4",
           "--max-new-tokens", "32", "--eval-prompts", "16", "--lr", "1e-3", "--warmup", "0",
           "--no-compare", "--buckets", "1.0"]  # one row bucket: one decode loop per program
  if kind == "specroll":  # every row verifies trees (goodput would verify none on this CPU)
    flags += ["--budget", "fixed", "--max-new-tokens", "16"]
  multi, single = _main_job_runs(tmp_path, flags, kind, 600)
  assert len(multi) == len(single) == 2
  for a, b in zip(multi, single, strict=True):
    for k in ("reward_mean", "accuracy", "response_tokens", "groups_mixed"):
      assert a[k] == b[k], (k, a[k], b[k])  # the same samples, whichever process drew them
    if kind == "vanilla":
      assert a["forwards"] == b["forwards"]
    if kind == "specroll":  # the whole batch's figures, whichever process wrote them
      assert a["mode"] == b["mode"] == "speculative" and a["tau"] > 1.0
      assert a["slow"]["decision"] == b["slow"]["decision"]
    for k in ("loss", "grad_norm", "entropy"):
      assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (k, a[k], b[k])
  assert any(r["grad_norm"] > 0 for r in single)  # a real update (some groups were mixed)
  summary = lambda d: json.loads((tmp_path / d / "summary.json").read_text())["table"][kind]
  assert summary("multi")["held_out"] == summary("single")["held_out"]
  assert (tmp_path / "multi" / kind / "checkpoints" / "1").is_dir()  # saved collectively
