"""Paged attention: a torch reference (runs anywhere) and Triton kernels (CUDA)."""
