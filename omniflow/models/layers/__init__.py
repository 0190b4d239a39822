"""Layers shared by the model families: rotary embeddings and CPU weight layouts."""
