"""Llama-family decoders (Llama, Qwen2, Mistral layouts): config and model."""
