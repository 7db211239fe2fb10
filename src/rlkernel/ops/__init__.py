"""Public differentiable primitives: validate inputs, dispatch to kernels or the reference."""
