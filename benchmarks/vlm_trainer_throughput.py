"""Qwen2.5-VL: the Megatron trainer (vision tower + mRoPE, trainer_megatron/vlm.py) against transformers'
Qwen2_5_VLForConditionalGeneration on the same batch of samples with images: one GRPO update (old log-probs,
then forward, backward, Adam) each, tokens/s, and the two sides' log-prob gap on that batch.

CPU (checked here; a tiny random model):
    python benchmarks/vlm_trainer_throughput.py --device cpu --shape tiny-vl --samples 8 --steps 1
GPU (scripts/gpu/run.sh stage bench-vlm; random weights of the shape, bf16, nothing downloaded):
    python benchmarks/vlm_trainer_throughput.py --device cuda --shape qwen2.5-vl-3b-reduced --samples 32

Each sample: a short text prompt around ``--images`` images of ``--grid`` patches (14-pixel patches: 32 x 32 is a
448 x 448 image, 256 image tokens after the 2 x 2 merge), then a response of ``--response-len`` tokens.
The trainer packs micro-batches of ``--max-tokens-per-gpu`` tokens. transformers runs micro-batches of
``--baseline-micro-batch-size`` samples, right-padded with an attention mask, the LM head and an fp32
log-softmax over the response's predicting positions only, fp32 weights under bf16 autocast (on CUDA), SDPA,
fused AdamW, gradients clipped to 1: what a user would write with transformers alone. Tokens/s counts every
token of the batch (image tokens too) per train step; the vision tower's patches are 4x the image tokens.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import time
from pathlib import Path

import torch
from trainer_throughput import init_single_rank, sync  # sibling script

IMAGE, START, END = 151655, 151652, 151653  # Qwen2.5-VL's <|image_pad|>, <|vision_start|>, <|vision_end|>

SHAPES = {
    # name: (text fields, vision fields)
    "tiny-vl": (dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, mrope=[2, 3, 3]),
                dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=2, fullatt_block_indexes=[1, 3],
                     out_hidden_size=64)),
    # Qwen2.5-VL-3B-Instruct's shape; -reduced: the first 12 of its 36 language-model layers (every vision block)
    "qwen2.5-vl-3b": (dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                           num_attention_heads=16, num_key_value_heads=2, mrope=[16, 24, 24]),
                      dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                           fullatt_block_indexes=[7, 15, 23, 31], out_hidden_size=2048)),
}
SHAPES["qwen2.5-vl-3b-reduced"] = ({**SHAPES["qwen2.5-vl-3b"][0], "num_hidden_layers": 12}, SHAPES["qwen2.5-vl-3b"][1])


def make_model(shape: str, folder: Path, device: str) -> Path:
    """A random Qwen2.5-VL folder of ``shape`` in bf16 (built on ``device``: a 3B init on the CPU takes minutes)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text, vision = SHAPES[shape]
    text = {**text, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": text["mrope"]},
            "max_position_embeddings": 32768, "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": True}
    del text["mrope"]
    vision = {**vision, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
              "hidden_act": "silu"}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=151656,
                              vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=True,
                              architectures=["Qwen2_5_VLForConditionalGeneration"])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    return folder


def make_samples(args):
    from slime_rl.core.sample import Sample

    g = torch.Generator().manual_seed(args.seed)
    gh, gw = args.grid
    per_image = (gh // 2) * (gw // 2)
    samples = []
    for i in range(args.samples):
        tokens = torch.randint(0, 150000, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.images):
            tokens += [START] + [IMAGE] * per_image + [END] + torch.randint(0, 150000, (4,), generator=g).tolist()
        r = args.response_len
        tokens += torch.randint(0, 150000, (r,), generator=g).tolist()
        inputs = {"pixel_values": torch.randn(args.images * gh * gw, 3 * 2 * 14 * 14, generator=g),
                  "image_grid_thw": torch.tensor([[1, gh, gw]] * args.images)}
        adv = float(torch.randn((), generator=g))
        samples.append(Sample(index=i, group_index=i // 8, tokens=tokens, response_length=r, loss_mask=[1] * r,
                              rollout_log_probs=[-1.0] * r, reward=adv, advantages=[adv] * r,
                              multimodal_train_inputs=inputs))
    return samples


# ---------------------------------------------------------------- the contenders


def megatron_update(args, folder: Path, samples) -> tuple[list[float], list[float], torch.Tensor]:
    """(log-prob seconds, train-step seconds) of each timed update and the last old log-probs."""
    from slime_rl.core.batch import RolloutBatch
    from slime_rl.core.config import load_config
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    init_single_rank()
    overrides = [f"model.path={folder}", f"cluster.device={args.device}", "trainer.lr=1e-5", "trainer.adam_beta2=0.99",
                 f"model.dtype={args.dtype}", f"trainer.max_tokens_per_gpu={args.max_tokens_per_gpu}"]
    trainer = MegatronTrainer.from_config(load_config(None, overrides, check=False))
    batch = RolloutBatch.from_samples(samples)
    batch.advantages = torch.tensor([a for s in samples for a in s.advantages], dtype=torch.float32)
    lp_s, train_s, first = [], [], None
    for it in range(args.warmup + args.steps):
        sync(args.device)
        t0 = time.perf_counter()
        batch.old_log_probs = trainer.compute_log_probs(batch)
        sync(args.device)
        t1 = time.perf_counter()
        trainer.train_step(batch)
        sync(args.device)
        t2 = time.perf_counter()
        first = batch.old_log_probs if first is None else first
        if it >= args.warmup:
            lp_s.append(t1 - t0)
            train_s.append(t2 - t1)
    del trainer
    return lp_s, train_s, first


class TransformersVL:
    """transformers' Qwen2.5-VL doing the same update (see the module docstring)."""

    def __init__(self, folder: Path, args):
        from transformers import Qwen2_5_VLForConditionalGeneration

        self.args, self.device = args, args.device
        self.autocast = args.dtype == "bfloat16"
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation="sdpa").to(args.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, betas=(0.9, 0.99), fused=args.device == "cuda")
        # transformers 5.x finds image tokens through mm_token_type_ids; 4.x and 5.12 from the ids themselves
        self.token_types = "mm_token_type_ids" in inspect.signature(self.model.model.forward).parameters

    def _micro_batches(self, samples):
        size = self.args.baseline_micro_batch_size
        return [samples[k:k + size] for k in range(0, len(samples), size)]

    def _response_log_probs(self, part) -> list[torch.Tensor]:
        longest = max(len(s.tokens) for s in part)
        ids = torch.zeros(len(part), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(part):
            ids[row, :len(s.tokens)] = torch.tensor(s.tokens)
            mask[row, :len(s.tokens)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pixels = torch.cat([s.multimodal_train_inputs["pixel_values"] for s in part]).to(self.device)
        grid = torch.cat([s.multimodal_train_inputs["image_grid_thw"] for s in part]).to(self.device)
        extra = {"mm_token_type_ids": (ids == IMAGE).int()} if self.token_types else {}
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
            hidden = self.model.model(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                                      **extra).last_hidden_state
            out = []
            for row, s in enumerate(part):
                start = len(s.tokens) - s.response_length - 1
                logits = self.model.lm_head(hidden[row, start:len(s.tokens) - 1]).float()
                target = ids[row, start + 1:len(s.tokens)]
                out.append(torch.log_softmax(logits, -1).gather(1, target[:, None]).squeeze(1))
        return out

    def log_probs(self, samples) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([lp for part in self._micro_batches(samples) for lp in self._response_log_probs(part)])

    def train_step(self, samples, old: torch.Tensor) -> None:
        tokens = sum(s.response_length for s in samples)
        k = 0
        for part in self._micro_batches(samples):
            logps = self._response_log_probs(part)
            loss = 0.0
            for s, lp in zip(part, logps, strict=True):
                ratio = torch.exp(lp - old[k:k + len(lp)].to(lp.device))
                loss = loss - (ratio * torch.tensor(s.advantages, device=lp.device)).sum()
                k += len(lp)
            (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def transformers_update(args, folder: Path, samples) -> tuple[list[float], list[float], torch.Tensor]:
    hf = TransformersVL(folder, args)
    lp_s, train_s, first = [], [], None
    for it in range(args.warmup + args.steps):
        sync(args.device)
        t0 = time.perf_counter()
        old = hf.log_probs(samples)
        sync(args.device)
        t1 = time.perf_counter()
        hf.train_step(samples, old)
        sync(args.device)
        t2 = time.perf_counter()
        first = old.cpu() if first is None else first
        if it >= args.warmup:
            lp_s.append(t1 - t0)
            train_s.append(t2 - t1)
    del hf
    return lp_s, train_s, first


def main(argv: list[str] | None = None) -> tuple[list[dict], torch.Tensor]:
    """The table's rows (transformers, then megatron) and the old log-probs' |megatron - transformers| per token."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="qwen2.5-vl-3b-reduced", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--images", type=int, default=2, help="images per sample")
    parser.add_argument("--grid", type=int, nargs=2, default=[32, 32], help="patch rows and columns of each image")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    parser.add_argument("--baseline-micro-batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", default=None, help="where to write the random model (default: a temp dir)")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    import tempfile

    folder = Path(args.folder or tempfile.mkdtemp(prefix="vlm-bench-")) / args.shape
    if not (folder / "config.json").exists():
        make_model(args.shape, folder, args.device)
    samples = make_samples(args)
    tokens = sum(len(s.tokens) for s in samples)
    image_tokens = sum(s.tokens.count(IMAGE) for s in samples)
    rows = []
    results = {}
    for name, run in (("transformers", transformers_update), ("megatron", megatron_update)):
        lp_s, train_s, first = run(args, folder, samples)
        results[name] = first
        gc.collect()
        if args.device == "cuda":
            rows.append(dict(peak_gib=torch.cuda.max_memory_allocated() / 2**30))
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            rows.append({})
        rows[-1].update(contender=name, log_probs_s=min(lp_s), train_step_s=min(train_s),
                        train_tok_s=tokens / min(train_s), update_tok_s=tokens / (min(lp_s) + min(train_s)))
    gap = (results["megatron"].float() - results["transformers"].float()).abs()
    print(f"\n{args.shape}, {args.device} {args.dtype}: {len(samples)} samples x {args.images} images of"
          f" {args.grid[0]}x{args.grid[1]} patches; {tokens} tokens ({image_tokens} image tokens,"
          f" {4 * image_tokens} patches), {sum(s.response_length for s in samples)} response tokens; trainer packed at"
          f" {args.max_tokens_per_gpu} tokens, transformers {args.baseline_micro_batch_size} samples a micro-batch")
    print("| contender | log-probs s | train step s | train tokens/s | update tokens/s | peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
        print(f"| {r['contender']} | {r['log_probs_s']:.3f} | {r['train_step_s']:.3f} | {r['train_tok_s']:,.0f} |"
              f" {r['update_tok_s']:,.0f} | {peak} |")
    speedup = rows[0]["train_step_s"] / rows[1]["train_step_s"]
    print(f"trainer / transformers train tokens/s: {speedup:.2f}x")
    print(f"old log-probs |megatron - transformers| over {gap.numel()} response tokens: mean {gap.mean():.2e},"
          f" max {gap.max():.2e}")
    return rows, gap


if __name__ == "__main__":
    main()
