"""Pallas kernels for specroll_jax, each beside a plain-jnp reference of the same function.

GPU lowering goes through the Pallas Triton backend, TPU through Mosaic; on CPU the kernels run in
interpret mode (tests) and the engine uses the references.

  tree_attention          public tree-verify / prefill attention, its reference and BlockSizes
  tree_attention_triton   its Triton body;  tree_attention_tpu  its Mosaic body
  _flash                  online softmax, split combine and query tiling shared by both bodies
  fused_sampler           fused unembed + Gumbel-max sampling + logsumexp, and its reference
  counter_hash            the counter-based sampling noise (shared with specroll_jax.sampling)
  lowering                jax.export for cuda / tpu without the device (tests, checks)

Nothing here imports ``specroll_jax`` (imports flow one way).
"""
