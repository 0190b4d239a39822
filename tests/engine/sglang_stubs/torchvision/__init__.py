"""Test stand-in for torchvision (installing the real one replaces torch with a CUDA build).

SGLang's multimodal config helpers, and transformers' image utilities that it pulls in,
import names from torchvision at module level; a text model's forward never calls them.
Every name imports; using one raises. On PYTHONPATH only in the SGLang tests."""

from torchvision._absent import absent

__version__ = "0.0.0+omniflow.test.stub"


def __getattr__(name):
    return absent(__name__, name)
