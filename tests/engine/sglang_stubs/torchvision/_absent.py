"""What every name of the torchvision stand-in is: importable, and raising when used."""


def absent(module: str, name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def call(*args, **kwargs):
        raise RuntimeError(f"{module}.{name}: a test stand-in for torchvision, not torchvision")

    call.__name__ = name
    return call
