"""Native kernels compiled on the target machine (CPU today), with torch fallbacks."""

from minisgl.kernels.cpu import CpuKernels, cpu_kernels

__all__ = ["CpuKernels", "cpu_kernels"]
