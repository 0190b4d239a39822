"""Random-weight checkpoints in the Hugging Face layout, for tests and benchmarks: the
models load them through the same loaders as real weights."""
