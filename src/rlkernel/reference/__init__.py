"""Readable PyTorch ground truth, one module per op family: the CPU backend and the test oracle."""
