from torchvision._absent import absent


def __getattr__(name):
    if name == "InterpolationMode":
        from torchvision.transforms.functional import InterpolationMode

        return InterpolationMode
    return absent(__name__, name)
