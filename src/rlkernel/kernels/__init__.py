"""Triton kernels and their launch wrappers, one module per op family. No autograd here."""
