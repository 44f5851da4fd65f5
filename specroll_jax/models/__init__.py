"""Qwen2/Llama-family decoder, KV cache, Hugging Face checkpoint I/O and tokenizer."""

from specroll_jax.models.config import ModelConfig
from specroll_jax.models.decoder import (
    KVCache,
    StepOutput,
    final_norm,
    forward,
    init_cache,
    init_params,
    logits_from_hidden,
    prefill,
    step,
    unembedding,
    write_cache,
)
from specroll_jax.models.hf import load_pretrained, save_pretrained

__all__ = [
    "KVCache", "ModelConfig", "StepOutput", "final_norm", "forward", "init_cache", "init_params",
    "load_pretrained", "logits_from_hidden", "prefill", "save_pretrained", "step", "unembedding",
    "write_cache",
]
