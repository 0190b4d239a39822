"""Native kernels built on the machine that runs them (see cpu.py); every caller keeps a
PyTorch path for where they are unavailable."""

from omniflow.kernels.cpu import CpuKernels, cpu_kernels, unavailable_reason

__all__ = ["CpuKernels", "cpu_kernels", "unavailable_reason"]
