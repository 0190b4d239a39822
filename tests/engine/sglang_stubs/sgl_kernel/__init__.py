"""Test stand-in for sgl_kernel (SGLang's compiled kernels; its wheel needs CUDA).

SGLang imports a few of its names at module level (KV-cache copies, request-to-token pool
assignment, speculative-decoding helpers). On CPU, with no ``torch.ops.sgl_kernel`` ops
registered, SGLang takes its PyTorch (forward_native) paths and never calls them: every
name imports, using one raises. On PYTHONPATH only in the SGLang tests."""

__version__ = "0.0.0+omniflow.test.stub"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def call(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name}: a test stand-in, not SGLang's kernels")

    call.__name__ = name
    return call
