"""Every experiment script answers a bad flag value with one line naming the flag and exit code 2,
never a traceback (and never after minutes of work: flags are checked first). The scripts' own
``main(argv)`` runs in-process (the same code path as the command line, without an interpreter
launch per case)."""


import pytest
from conftest import load_script

CASES = [
    ("bench_decode.py", ["--batches", "0"], "--batches"),
    ("bench_kernels.py", ["--reps", "0"], "--reps"),
    ("device_check.py", ["--budget-s", "-1"], "--budget-s"),
    ("bench_rollout.py", ["--prompts", "0"], "--prompts"),
    ("bench_rollout.py", ["--top-p", "2"], "--top-p"),
    ("bench_rollout.py", ["--top-k", "-1"], "--top-k"),
    ("bench_engine.py", ["--rounds", "0"], "--rounds"),
    ("bench_engine.py", ["--compare-to", "no-such-ref"], "--compare-to"),
    ("bench_adaptation.py", ["--batches", "1"], "--batches"),
    ("bench_adaptation.py", ["--arms", "fastest"], "--arms"),
    ("bench_adaptation.py", ["--slow-steps", "0"], "--slow-steps"),
    ("bench_adaptation.py", ["--slow-z", "nan"], "--slow-z"),
    ("bench_adaptation.py", ["--slow-budget", "-1"], "--slow-budget"),
    ("bench_adaptation.py", ["--slow-acc-drop", "2"], "--slow-acc-drop"),
    ("bench_adaptation.py", ["--reflex-stride-rows", "0"], "--reflex-stride-rows"),
    ("bench_adaptation.py", ["--start-heads", "best"], "--start-heads"),
    ("bench_adaptation.py", ["--reflex-sleep", "-1"], "--reflex-sleep"),
    ("bench_proposals.py", ["--nodes", "0"], "--nodes"),
    ("bench_proposals.py", ["--temperatures", "-1"], "--temperatures"),
    ("build_default_model.py", ["--steps", "0"], "--steps"),
    ("gsm8k.py", ["--prompts", "x"], "--prompts"),
    ("gsm8k.py", ["--steps", "0"], "--steps"),
    ("gsm8k.py", ["--group", "-1"], "--group"),
    ("gsm8k.py", ["--temperature", "-1"], "--temperature"),
    ("gsm8k.py", ["--top-p", "1.5"], "--top-p"),
    ("gsm8k.py", ["--lr", "0"], "--lr"),
    ("gsm8k.py", ["--warmup", "-1"], "--warmup"),
    ("gsm8k.py", ["--task", "math"], "--task"),
    ("gsm8k.py", ["--level", "7"], "--level"),
    ("bench_adaptation.py", ["--level", "-1"], "--level"),
    ("gsm8k.py", ["--model", "/no/such/folder"], "--model"),
    ("gsm8k.py", ["--rollout", "fast"], "--rollout"),
    ("gsm8k.py", ["--buckets", "0.5", "1.0"], "--buckets"),
    ("gsm8k.py", ["--reflex-sleep", "-1"], "--reflex-sleep"),
    ("gsm8k.py", ["--reflex", "maybe"], "--reflex"),
    ("gsm8k.py", ["--reflex-sleep-max", "-1"], "--reflex-sleep-max"),
    ("bench_adaptation.py", ["--reflex-sleep-max", "-1"], "--reflex-sleep-max"),
    ("gsm8k.py", ["--records-per-batch", "0"], "--records-per-batch"),
    ("gsm8k.py", ["--slow-bootstrap", "-1"], "--slow-bootstrap"),
    ("gsm8k.py", ["--slow-step-chunks", "-1"], "--slow-step-chunks"),
    ("bench_adaptation.py", ["--slow-step-chunks", "-2"], "--slow-step-chunks"),
    ("bench_adaptation.py", ["--slow-chunk-size", "0"], "--slow-chunk-size"),
    ("gsm8k.py", ["--slow-refresh-budget", "inf"], "--slow-refresh-budget"),
    ("gsm8k.py", ["--slow-learn-budget", "-1"], "--slow-learn-budget"),
    ("bench_adaptation.py", ["--slow-refresh-budget", "-0.1"], "--slow-refresh-budget"),
    ("gsm8k.py", ["--steps", "many"], "--steps"),
    ("gsm8k.py", ["--resume"], "--resume"),
    ("gsm8k.py", ["--coordinator", "127.0.0.1:1234"], "--num-processes"),
    ("gsm8k.py", ["--num-processes", "2", "--process-id", "0"], "--coordinator"),
    ("gsm8k.py", ["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
     "--coordinator"),
    ("gsm8k.py", ["--coordinator", "h:1234", "--num-processes", "0", "--process-id", "0"],
     "--num-processes"),
    ("gsm8k.py", ["--coordinator", "h:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id"),
]


@pytest.mark.parametrize("script,flags,name", CASES, ids=lambda x: str(x))
def test_bad_flag_is_one_line_and_exit_2(script, flags, name, tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  main = load_script(script).main
  extra = ["--out", str(tmp_path / "out")] if script == "gsm8k.py" else []
  with pytest.raises(SystemExit) as e:
    main([*flags, *extra])
  err = capsys.readouterr().err
  lines = [x for x in err.splitlines() if x.strip()]
  assert e.value.code == 2, err[-2000:]
  assert len(lines) == 1 and name in lines[0] and "Traceback" not in err, err
