"""Pallas kernels for specroll_jax, each beside a plain-jnp reference of the same function.

GPU lowering goes through the Pallas Triton backend, TPU through Mosaic; on CPU the kernels run in
interpret mode (tests) and the engine uses the references.
"""
