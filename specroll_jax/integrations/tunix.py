"""SpecRoll as a rollout engine of google/tunix (``tunix.rl.rollout.base_rollout.BaseRollout``).

tunix's RL cluster builds a custom engine itself::

    cluster_config = rl_cluster.ClusterConfig(
        ..., rollout_engine=functools.partial(SpecRollRollout, heads=heads, num_generations=G))

and calls it with ``rollout_actor=`` (the trainer's own nnx model: tunix shares it with a custom
engine), ``tokenizer=``, ``mesh=`` and ``rollout_config=``. ``SpecRollRollout`` then decodes
through ``specroll_jax.SpecRoll`` (``heads=``: the object's defaults, its state carried from call
to call; ``proposer=`` with ``proposer_params=``: your proposer in the same object; ``specroll=``:
settings of the object, e.g. ``{"budget": "fixed"}``), or through the vanilla engine without
heads or a proposer (``experiments/tunix_grpo.py`` is a whole run).
Either way every token is the target's own sample under the counter-based noise
u(seed, sample id, position, token) (docs/design.md, "The central invariant"), so speculation
changes the cost of a rollout, never its tokens.

Parameters. Decoding reads ``model()``'s current ``nnx.Param`` state at every call. The tunix
arrays go into the jitted rollout as they are and are mapped onto our parameter tree inside the
compiled program (``params_from_tunix``): embedding, norms, biases, MLP kernels and ``lm_head``
have our layout already; the attention kernels ``[D, N, H]`` / ``[N, H, D]`` become ``[D, N*H]`` /
``[N*H, D]`` by a reshape XLA does as a bitcast (the compiled forward holds no weight-shaped
copy). No weight is copied (a cast to another
``RolloutConfig.data_type`` is the one exception). ``update_params`` writes new ``Param`` state
into ``model()``; tunix skips that call when ``model()`` is the trainer's module, and decoding then
follows the trainer directly.

Sampling. ``RolloutConfig`` maps onto ``SamplingConfig`` as tunix's own sampler reads it: greedy
when ``top_p`` is None or ``temperature`` is 0, else temperature with ``top_k`` (None, 0 or -1: off)
and ``top_p``. The logprobs returned are ours: the chosen token's under the tempered, top-k/top-p
restricted, renormalised distribution (tunix's sampler reports the unrestricted tempered one).
``get_per_token_logps`` scores tokens with the same decoder and rule (``grpo.trainer_logprobs``)
under the ``rollout_config`` the engine was built with.

Sample ids (docs/design.md, "The sample-id rule for GRPO"). tunix repeats each prompt G times,
prompt-major (``np.repeat(prompts, G)``), and its rollout micro-batches hold whole groups, so the
k-th row this engine decodes (counting across calls) is member ``k % G`` of global prompt
``k // G``. That row gets sample id k, which is ``sampling.group_sample_ids(prompt, G)``: GRPO
members differ, ids never repeat, and a response does not depend on how tunix splits the batch
into micro-batches. ``num_generations=G`` also checks that layout; ``next_sample_id`` (settable)
moves the counter, e.g. after a restart.

Outputs follow tunix's conventions: prompts are tokenized as its sampler does (BOS added unless
already there), left-padded with ``pad_id`` to ``max_prompt_length`` (to the next power of two when
a prompt is longer); completions are unpadded and end before a sampled EOS, as tunix's own
(vanilla) engine cuts it (``keep_eos=True`` keeps it, as its vLLM engine does).
``RolloutOutput.logits`` is empty (no [M, V] logits are kept), as tunix's vanilla engine returns
it.

Not covered: LoRA models, sharding the decode over ``mesh`` (the rollout runs under ``jax.jit``
with whatever sharding the parameters carry), multimodal prompts, beam search.

This module is the public entry point; the code lives in ``tunix_params`` (tunix's Qwen2 / Llama3
config and parameters <-> ours, and a Hugging Face folder -> tunix's Qwen2), ``tunix_settings``
(``RolloutConfig`` -> our sampling and seed) and ``tunix_rollout`` (``SpecRollRollout``).
"""

from specroll_jax.integrations.tunix_params import (
  SUPPORTED_MODELS,
  TunixLayer,
  TunixSource,
  model_config_from_tunix,
  params_from_tunix,
  tunix_qwen2_config,
  tunix_qwen2_from_pretrained,
  tunix_qwen2_params,
  tunix_source,
)
from specroll_jax.integrations.tunix_rollout import SpecRollRollout
from specroll_jax.integrations.tunix_settings import sampling_from_rollout_config

__all__ = ["SUPPORTED_MODELS", "SpecRollRollout", "TunixLayer", "TunixSource",
           "model_config_from_tunix", "params_from_tunix", "sampling_from_rollout_config",
           "tunix_qwen2_config", "tunix_qwen2_from_pretrained", "tunix_qwen2_params",
           "tunix_source"]
