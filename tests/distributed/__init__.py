"""Tests of rlkernel.distributed (gloo, CPU processes)."""
