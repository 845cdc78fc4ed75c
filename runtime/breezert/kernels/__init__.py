"""Hand-written Triton kernels (CUDA, or CPU through ``TRITON_INTERPRET=1`` in tests).

Imported only where a config turns them on: CPU installs without Triton never import this package.
"""
