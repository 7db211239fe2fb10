"""``rlkernel demo``: RL from a random init on a toy task, through rlkernel's public API.

task     the toy task (reverse a short digit string), its vocabulary and reward
policy   the tiny Qwen3-architecture policy (random init, no download)
grpo     the GRPO loop: generate -> reward -> group advantages -> fused policy loss -> AdamW
plot     the reward curve
cli      ``rlkernel demo`` options and entry point

Needs the ``demo`` extra (transformers, matplotlib); importing this package does not import them.
"""
