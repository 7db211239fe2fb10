"""Time and peak memory of one GRPO micro-batch's loss + backward: TRL 1.16's ``GRPOTrainer._compute_loss``
next to ``RLKernelGRPOTrainer._compute_loss`` on the same model and batch.

    python scripts/profile_trl_loss.py                      # GPU: Qwen3 vocabulary, bf16, 8 x (256 + 1024)
    python scripts/profile_trl_loss.py --tiny --device cpu  # a seconds-long smoke run

The model is a random-init Qwen3 (``--layers`` decoder layers, hidden ``--hidden``, vocabulary
``--vocab``); the batch follows the users' call pattern (DESIGN.md): left-padded prompts, completion
lengths uniform in [T/4, T], group advantages. Each row: the median of ``--repeats`` timed calls
(after one warm-up) of loss + backward, the peak memory above what the model, its gradients and the
batch hold, and |Δloss| against TRL. ``off-policy`` gives old log-probs (rlkernel's fused path),
``on-policy`` none (TRL's default; rlkernel's one ``fused_policy_loss(old_logp=None)`` call). The loss head of
both is the only difference, so the rows compare TRL's fused LM head + [B, T] loss with rlkernel's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def build_trainers(args, path):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["profile the loss"], trainers.BpeTrainer(special_tokens=["<eos>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")
    heads = max(args.hidden // 128, 1)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
        head_dim=args.hidden // heads, max_position_embeddings=args.prompt + args.completion + 8,
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    out = []
    for cls in (GRPOTrainer, RLKernelGRPOTrainer):
        model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).to(args.device)
        grpo = GRPOConfig(
            output_dir=f"{path}/out", per_device_train_batch_size=args.batch, num_generations=args.batch,
            max_completion_length=args.completion, bf16=args.dtype == "bf16", use_cpu=args.device == "cpu",
            report_to="none", loss_type=args.loss_type, gradient_checkpointing=True,
        )  # fmt: skip
        trainer = cls(
            model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=grpo,
            train_dataset=Dataset.from_dict({"prompt": ["x"] * args.batch}), processing_class=tok,
        )  # fmt: skip
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        out.append(trainer)
    return out


def make_batch(args, trainer, on_policy: bool):
    g = torch.Generator().manual_seed(0)
    B, P, T, dev = args.batch, args.prompt, args.completion, args.device
    prompt_len = torch.randint(P // 2, P + 1, (B,), generator=g)
    lengths = torch.randint(max(T // 4, 1), T + 1, (B,), generator=g)
    batch = dict(
        prompt_ids=torch.randint(0, args.vocab, (B, P), generator=g),
        prompt_mask=(torch.arange(P)[None] >= (P - prompt_len)[:, None]).long(),
        completion_ids=torch.randint(0, args.vocab, (B, T), generator=g),
        completion_mask=(torch.arange(T)[None] < lengths[:, None]).long(),
        advantages=torch.randn(B, generator=g),
        num_items_in_batch=lengths.sum(),
    )
    batch = {k: v.to(dev) for k, v in batch.items()}
    if not on_policy:
        with torch.no_grad():
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            logp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, T)
        batch["old_per_token_logps"] = logp + 0.1 * torch.randn(logp.shape, generator=g).to(dev)
    return batch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(args, trainer, compute_loss, batch):
    """(median ms, peak extra bytes, loss) of loss + backward."""
    cuda = args.device.startswith("cuda")
    times, loss = [], None
    for i in range(args.repeats + 1):
        trainer.model.zero_grad(set_to_none=False)
        sync(args.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = compute_loss(trainer, trainer.model, batch)
        loss.backward()
        sync(args.device)
        if i:  # the first call warms up (Triton compilation, cuBLAS handles)
            times.append(1000 * (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated() - base if cuda else float("nan")
    return statistics.median(times), peak, loss.detach().float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=1024)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="vocab 1000, hidden 64, 2 x (8 + 16): a smoke")
    args = parser.parse_args()
    if args.tiny:
        args.vocab, args.hidden, args.batch, args.prompt, args.completion = 1000, 64, 2, 8, 16
        args.dtype, args.repeats = "fp32", 2
    from trl import GRPOTrainer

    with tempfile.TemporaryDirectory() as path:
        trl_trainer, rk_trainer = build_trainers(args, path)
        print(
            f"device {args.device}, {args.dtype}, vocab {args.vocab}, hidden {args.hidden}, "
            f"layers {args.layers}, B {args.batch}, prompt {args.prompt}, completion <= {args.completion}, "
            f"loss_type {args.loss_type}"
        )
        print(f"{'variant':11s} {'trainer':9s} {'ms':>9s} {'peak extra GB':>14s} {'|Δloss| vs TRL':>15s}")
        for variant in ("off-policy", "on-policy"):
            batch = make_batch(args, trl_trainer, variant == "on-policy")
            ref = None
            for name, trainer, fn in (
                ("TRL", trl_trainer, GRPOTrainer._compute_loss),
                ("rlkernel", rk_trainer, type(rk_trainer)._compute_loss),
            ):
                ms, peak, loss = measure(args, trainer, fn, batch)
                ref = loss if ref is None else ref
                diff = (loss - ref).abs().item()
                print(f"{variant:11s} {name:9s} {ms:9.2f} {peak / 2**30:14.3f} {diff:15.2e}")


if __name__ == "__main__":
    main()
