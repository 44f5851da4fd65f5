"""GSM8K loading and gold extraction on the shipped records."""

import dataclasses

import pytest

from specroll_jax.data import gsm8k


def test_records_ship_as_package_data_with_their_licence():
  """The data sits beside a module of the same name: the import must resolve to the module and
  the records (and the MIT licence) must be package resources, not files from a checkout."""
  import importlib.resources
  import inspect
  assert inspect.isfunction(gsm8k.load) and gsm8k.SPLITS == ("train", "test")
  root = importlib.resources.files("specroll_jax.data").joinpath("gsm8k")
  for split, n in (("train", 7473), ("test", 1319)):
    with root.joinpath(f"{split}.jsonl").open("r", encoding="utf-8") as f:
      assert sum(1 for line in f if line.strip()) == n
  assert "MIT" in root.joinpath("LICENSE").read_text()


def test_counts():
  assert len(gsm8k.load("train")) == 7473
  assert len(gsm8k.load("test")) == 1319


def test_first_train_record():
  ex = gsm8k.load("train")[0]
  assert ex.question.startswith("Natalia sold clips to 48 of her friends")
  assert ex.answer.endswith("#### 72")
  assert ex.gold == "72"


@pytest.mark.parametrize("split", gsm8k.SPLITS)
def test_every_gold_is_a_number_and_strictly_extractable(split):
  for ex in gsm8k.load(split):
    assert "," not in ex.gold and "$" not in ex.gold
    norm = gsm8k.normalize_number(ex.gold)
    assert norm is not None, ex.gold
    assert gsm8k.extract_answer(ex.answer, "strict") == norm
    assert gsm8k.has_answer_line(ex.answer)


def test_gold_strips_commas():
  golds = {ex.gold for ex in gsm8k.load("train")}
  assert "1200" in golds and "-7" in golds  # written "#### 1,200" and "#### -7" in train.jsonl


def test_load_is_cached_but_returns_fresh_lists():
  a, b = gsm8k.load("test"), gsm8k.load("test")
  assert a == b and a is not b
  assert a[0] is b[0]
  with pytest.raises(dataclasses.FrozenInstanceError):
    a[0].gold = "0"


@pytest.mark.parametrize("split", ["validation", "Train", ""])
def test_bad_split_raises(split):
  with pytest.raises(ValueError, match=r"split must be one of \('train', 'test'\)"):
    gsm8k.load(split)


def test_extract_gold():
  assert gsm8k.extract_gold("So 1,000 + 234.\n#### $1,234 ") == "1234"
  assert gsm8k.extract_gold("#### 1\n#### -3") == "-3"
  with pytest.raises(ValueError, match="####"):
    gsm8k.extract_gold("The answer is 4.")


@pytest.mark.parametrize(
  "s, want",
  [
    ("5", "5"),
    ("5.0", "5"),
    ("5.00", "5"),
    ("2.50", "2.5"),
    ("1,234", "1234"),
    ("$1,234.50", "1234.5"),
    ("-3", "-3"),
    ("-$3", "-3"),
    ("$-3", "-3"),
    ("-0.0", "0"),
    ("007", "7"),
    ("42.", "42"),
    (".5", "0.5"),
    ("1000000", "1000000"),
    ("  12 ", "12"),
    ("abc", None),
    ("1/2", None),
    ("1e5", None),
    ("", None),
    ("-", None),
    ("1.2.3", None),
  ],
)
def test_normalize_number(s, want):
  assert gsm8k.normalize_number(s) == want


def test_prompt_and_target():
  ex = gsm8k.load("train")[0]
  prompt = gsm8k.format_prompt(ex.question)
  assert prompt.startswith("Question: " + ex.question + "\n")
  assert prompt.endswith("Answer:")
  assert "####" in prompt
  target = gsm8k.format_target(ex.answer)
  assert target == " " + ex.answer
  assert gsm8k.extract_answer(prompt + target) == "72"
