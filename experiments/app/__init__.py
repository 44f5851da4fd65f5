"""The app beside the library: what the experiment scripts share, and nothing a library user needs.

The scripts run as ``python experiments/X.py`` (``experiments/`` is then ``sys.path[0]``) and
import it as ``app``; the tests put ``experiments/`` on ``sys.path`` (``tests/conftest.py``).
``specroll_jax`` never imports it. Modules: ``cli`` (flag errors), ``pipeline`` (models, prompts,
fitted heads), ``sft`` (SFT and the embedded model's recipe), ``loop`` (the main job's ``Run``)
around ``trainer`` (its host-scored GRPO step, ``GRPOTrainer``), ``checkpoint`` (orbax),
``traces`` (tensorstore rollout traces), ``widen`` (a small model inside a real shape), ``tasks``
with ``synthetic`` and ``synthetic_templates`` (the training tasks in GSM8K's format).
"""
