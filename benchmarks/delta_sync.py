"""Delta weight syncs (core/weights/delta.py): how many bf16 elements change per optimizer step, and
which encoding of the change is smallest at which change fraction.

    python benchmarks/delta_sync.py                      # one Qwen2.5-3B layer, lr 1e-6 and 1e-5, 10 steps
    python benchmarks/delta_sync.py --sweep-only          # the change-fraction sweep alone

Part 1: an fp32 master of one 3B-shaped transformer layer (q, k, v, o, gate, up, down, two norms) trained
by Adam on a least-squares loss through each matrix (real gradients of a fixed target, so the direction
persists from step to step as in RL); after every step the master is cast to bf16 as a sync would send it
and encoded against the previous step's bf16 (`DeltaEncoder`). Printed per step: the fraction of bf16
elements that changed, bytes by each encoding and by the encoder's per-tensor choice, encode and apply
seconds. Part 2: bf16 tensors with a chosen fraction of elements moved by one ulp: bytes and seconds of
``sparse`` and ``xor`` (zlib level 1) against the full tensor, the fraction where each stops paying.
"""

from __future__ import annotations

import argparse
import platform
import time
import zlib

import torch

from slime_rl.core.weights.delta import DeltaEncoder, apply_delta_bucket, bits, encode_tensor

# (name, shape) of one Qwen2.5-3B decoder layer (hidden 2048, 2 KV heads of 128, MLP 11008)
LAYER_3B = [("q_proj", (2048, 2048)), ("k_proj", (256, 2048)), ("v_proj", (256, 2048)), ("o_proj", (2048, 2048)),
            ("gate_proj", (11008, 2048)), ("up_proj", (11008, 2048)), ("down_proj", (2048, 11008)),
            ("input_layernorm", (2048,)), ("post_attention_layernorm", (2048,))]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def make_master(scale: float, seed: int) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    master = {}
    for name, shape in LAYER_3B:
        shape = tuple(max(1, int(d * scale)) for d in shape)
        if len(shape) == 1:
            master[name] = torch.nn.Parameter(torch.ones(shape))
        else:
            master[name] = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
    return master


def loss_of(master: dict[str, torch.nn.Parameter], inputs: dict[str, torch.Tensor],
            targets: dict[str, torch.Tensor]) -> torch.Tensor:
    total = torch.zeros(())
    for name, weight in master.items():
        out = inputs[name] @ weight.T if weight.dim() == 2 else inputs[name] * weight
        total = total + ((out - targets[name]) ** 2).mean()
    return total


def run_lr(lr: float, steps: int, scale: float, seed: int) -> list[dict[str, float]]:
    master = make_master(scale, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = {n: torch.randn(32, w.shape[-1], generator=gen) for n, w in master.items()}
    targets = {n: torch.randn(32, w.shape[0] if w.dim() == 2 else w.shape[-1], generator=gen) * 0.1
               for n, w in master.items()}
    opt = torch.optim.Adam(master.values(), lr=lr)
    encoder = DeltaEncoder()
    engine = {n: w.detach().to(torch.bfloat16) for n, w in master.items()}  # what the engine holds
    version = 0
    list(encoder.encode(iter([list(engine.items())]), version=0, engines_hold=None))  # the initial full sync
    rows = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss_of(master, inputs, targets).backward()
        opt.step()
        synced = [(n, w.detach().to(torch.bfloat16)) for n, w in master.items()]
        per_encoding = {"sparse": 0, "xor": 0}
        for name, new in synced:
            for enc in per_encoding:
                per_encoding[enc] += encode_tensor(name, new, engine[name], ("full", enc)).nbytes
        t0 = time.perf_counter()
        buckets = list(encoder.encode(iter([synced]), version=step, engines_hold=version))
        encode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        applied = apply_delta_bucket(buckets[0], engine.__getitem__, held_version=version)
        apply_s = time.perf_counter() - t0
        engine.update(applied)
        version = step
        exact = all(torch.equal(bits(engine[n]), bits(t)) for n, t in synced)
        s = encoder.last
        rows.append({"lr": lr, "step": step, "changed": s.changed / s.numel, "full": s.full_bytes,
                     "sparse": per_encoding["sparse"], "xor": per_encoding["xor"], "chosen": s.bytes_moved,
                     "encode_s": encode_s, "apply_s": apply_s, "exact": exact})
    return rows


# (vocab, hidden, intermediate, layers, heads, kv_heads): Qwen2.5's shapes, for --model
MODEL_SHAPES = {"qwen2.5-3b": (151936, 2048, 11008, 36, 16, 2), "qwen2.5-0.5b": (151936, 896, 4864, 24, 14, 2),
                "tiny": (4096, 128, 352, 4, 4, 2)}


def run_model(shape: str, lr: float, steps: int, device: str, folder: str, seq: int, batch: int,
              encodings: tuple[str, ...]) -> list[dict[str, float]]:
    """A whole random Qwen2 model of ``shape``: fp32 master trained by Adam on next-token loss over random
    tokens (real gradients of the model), synced in bf16 each step. Per step: change fraction, bytes by the
    encoder's choice, and seconds to write (fsync) and read back the full bf16 weights against the delta, by
    disk under ``folder`` (safetensors), plus encode and apply seconds on the host."""
    import os
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    vocab, hidden, inter, layers, heads, kv = MODEL_SHAPES[shape]
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                      tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    encoder = DeltaEncoder(encodings)
    gen = torch.Generator(device=device).manual_seed(1)

    def synced() -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]

    engine = dict((n, t.cpu()) for n, t in synced())
    list(encoder.encode(iter([synced()]), version=0, engines_hold=None))
    out = []
    for step in range(1, steps + 1):
        tokens = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
        opt.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        weights = synced()
        t0 = time.perf_counter()
        buckets = list(encoder.encode(iter([weights]), version=step, engines_hold=step - 1))
        encode_s = time.perf_counter() - t0
        timings = {}
        for kind, tensors in (("full", {n: t.cpu() for n, t in weights}), ("delta", dict(buckets[0]))):
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            path = os.path.join(folder, f"{kind}.safetensors")
            t0 = time.perf_counter()
            save_file({n: t.contiguous() for n, t in tensors.items()}, path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            loaded = load_file(path)
            timings[kind] = time.perf_counter() - t0
            del loaded
        t0 = time.perf_counter()
        engine.update(apply_delta_bucket(buckets[0], engine.__getitem__, held_version=step - 1))
        apply_s = time.perf_counter() - t0
        exact = all(torch.equal(bits(engine[n]), bits(t.cpu())) for n, t in weights)
        st = encoder.last
        out.append({"lr": lr, "step": step, "changed": st.changed / st.numel, "full": st.full_bytes,
                    "chosen": st.bytes_moved, "encode_s": encode_s, "apply_s": apply_s,
                    "disk_full_s": timings["full"], "disk_delta_s": timings["delta"], "exact": exact,
                    "encodings": dict(st.encodings)})
    shutil.rmtree(folder, ignore_errors=True)
    return out


def sweep(numel: int, fractions: list[float], seed: int) -> list[dict[str, float]]:
    gen = torch.Generator().manual_seed(seed)
    old = (torch.randn(numel, generator=gen) * 0.02).to(torch.bfloat16)
    rows = []
    for fraction in fractions:
        moved = torch.rand(numel, generator=gen) < fraction
        new_bits = bits(old).clone()
        new_bits[moved] += 1  # one ulp (away from zero for either sign: the magnitude bits grow)
        new = new_bits.view(torch.bfloat16)
        row = {"fraction": fraction, "full": numel * 2}
        for enc in ("sparse", "xor"):
            t0 = time.perf_counter()
            delta = encode_tensor("w", new, old, ("full", enc))
            row[f"{enc}_s"] = time.perf_counter() - t0
            row[enc] = delta.nbytes if delta.encoding == enc else _forced_size(enc, new, old)
        rows.append(row)
    return rows


def _forced_size(encoding: str, new: torch.Tensor, old: torch.Tensor) -> int:
    """The encoding's size where the encoder chose full instead (for the table)."""
    diff = torch.bitwise_xor(bits(new), bits(old))
    if encoding == "sparse":
        return int((diff != 0).sum()) * (4 + new.element_size())
    return len(zlib.compress(diff.numpy().tobytes(), 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the layer's dimensions by this factor")
    parser.add_argument("--sweep-numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--sweep-only", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default=None,
                        help="a whole model of this shape with real next-token gradients (the GPU stage)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--disk", default="/tmp/delta-sync-bench", help="--model: where the disk syncs are written")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--encodings", nargs="+", default=["full", "sparse", "xor"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {cpu_name()}, torch {torch.__version__}, {args.threads} thread(s)")
    if args.model is not None:
        if args.device.startswith("cuda"):
            print(f"# {torch.cuda.get_device_name()}")
        print(f"\n## {args.model} (fp32 master, Adam, next-token loss, bf16 sync, disk under {args.disk}): MB, s")
        print("| lr | step | changed | full MB | delta MB | delta/full | encode s | apply s | disk full s | "
              "disk delta s | bit-exact | encodings |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for lr in args.lrs:
            for r in run_model(args.model, lr, args.steps, args.device, args.disk, args.seq, args.batch,
                               tuple(args.encodings)):
                print(f"| {lr:g} | {r['step']} | {r['changed']:.2%} | {r['full'] / 1e6:.0f} | {r['chosen'] / 1e6:.0f} | "
                      f"{r['chosen'] / r['full']:.3f} | {r['encode_s']:.1f} | {r['apply_s']:.1f} | "
                      f"{r['disk_full_s']:.2f} | {r['disk_delta_s']:.2f} | {r['exact']} | {r['encodings']} |",
                      flush=True)
        return
    if not args.sweep_only:
        print(f"\n## one Qwen2.5-3B layer x{args.scale} (fp32 master, Adam, bf16 sync): bytes in MB")
        print("| lr | step | changed | full | sparse | xor+zlib | chosen | chosen/full | encode s | apply s | "
              "bit-exact |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for lr in args.lrs:
            for r in run_lr(lr, args.steps, args.scale, args.seed):
                print(f"| {lr:g} | {r['step']} | {r['changed']:.2%} | {r['full'] / 1e6:.1f} | {r['sparse'] / 1e6:.1f} "
                      f"| {r['xor'] / 1e6:.1f} | {r['chosen'] / 1e6:.1f} | {r['chosen'] / r['full']:.3f} | "
                      f"{r['encode_s']:.3f} | {r['apply_s']:.3f} | {r['exact']} |")
    print(f"\n## change-fraction sweep: {args.sweep_numel / 1e6:.1f}M bf16 elements moved by one ulp; size / full")
    print("| changed | sparse | xor+zlib | smallest | sparse encode s | xor encode s |")
    print("|---|---|---|---|---|---|")
    fractions = [0.001, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.8]
    for r in sweep(args.sweep_numel, fractions, args.seed):
        sizes = {"full": r["full"], "sparse": r["sparse"], "xor": r["xor"]}
        smallest = min(sizes, key=sizes.get)
        print(f"| {r['fraction']:.1%} | {r['sparse'] / r['full']:.3f} | {r['xor'] / r['full']:.3f} | {smallest} | "
              f"{r['sparse_s']:.3f} | {r['xor_s']:.3f} |")


if __name__ == "__main__":
    main()
