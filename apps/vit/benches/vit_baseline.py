"""PyTorch eager baseline for `vit bench` (apps/vit/src/bench.rs): training images/s of the same
Vision Transformer written in plain torch, timm's `VisionTransformer` layout (conv patch
embedding, class token, learned position embedding, pre-norm blocks with LayerNorm eps 1e-6, a
fused qkv projection, F.scaled_dot_product_attention, an exact-GELU MLP, final norm, class-token
head), trained with torch.optim.AdamW (its default foreach choice) on cross-entropy against
random labels and a fixed synthetic batch.

Weight decay applies to parameters of two or more dimensions only, as the engine's AdamW does.

Each step: forward, cross-entropy in fp32, backward, optimizer step, gradients set to None.
After --warmup untimed steps, steps run until --seconds have passed (or --steps have run).

Precision (--precision, and --bf16 for the bf16 recipe):
  fp32                       everything in float32.
  bf16 --bf16 master         bf16 model weights and activations, fp32 master weights that
                             AdamW updates and that are copied back each step (as ours does).
  bf16 --bf16 autocast       fp32 weights under torch.autocast(dtype=bfloat16), for reference.

--compile wraps the model in torch.compile (inductor, default mode): forward and backward
are compiled during the warm-up steps, the optimizer stays eager.

Prints one JSON line: images_per_s, steps, seconds, threads, torch, and on CUDA
peak_memory_bytes (torch.cuda.max_memory_allocated over warm-up and measurement).
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, image_size, patch, channels, classes, width, depth, heads, mlp_ratio):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(channels, width, patch, stride=patch)
        tokens = (image_size // patch) ** 2 + 1
        self.cls_token = nn.Parameter(torch.randn(1, 1, width) * 1e-6)
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, width) * 0.02)
        self.blocks = nn.Sequential(*[Block(width, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.head = nn.Linear(width, classes)

    def forward(self, images):
        x = self.patch_embed.proj(images).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--mlp-ratio", type=float, default=4.0)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=None, help="measure exactly this many steps")
    p.add_argument("--seconds", type=float, default=10.0, help="else measure about this long")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--bf16", choices=["master", "autocast"], default="master", help="bf16 regime")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    return p.parse_args()


def main():
    a = parse()
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("vit_baseline.py: --device cuda but torch sees no CUDA device")
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    model = VisionTransformer(
        a.image_size, a.patch, a.channels, a.classes, a.width, a.depth, a.heads, a.mlp_ratio
    ).to(device)

    master_mode = a.precision == "bf16" and a.bf16 == "master"
    autocast = a.precision == "bf16" and a.bf16 == "autocast"
    if master_mode:
        model = model.to(torch.bfloat16)
        model_params = list(model.parameters())
        params = [p.detach().float().requires_grad_() for p in model_params]
    else:
        model_params = params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": a.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=a.lr)
    if a.compile:
        # `vit bench` gives each run a cache of its own, where a precompiled header (120 MB
        # for the CPU's C++ kernels, about 3 s to build) would never be used again.
        from torch._inductor import config as inductor_config

        inductor_config.cpp_cache_precompile_headers = False
        # Parameters stay the module's own: the optimizer and master copies above hold them.
        model = torch.compile(model)

    input_kind = torch.bfloat16 if master_mode else torch.float32
    images = torch.randn(a.batch, a.channels, a.image_size, a.image_size, device=device, dtype=input_kind)
    labels = torch.randint(0, a.classes, (a.batch,), device=device)

    def step():
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=autocast):
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        if master_mode:
            for m, p in zip(params, model_params):
                m.grad = p.grad.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if master_mode:
            with torch.no_grad():
                for m, p in zip(params, model_params):
                    p.copy_(m)
                    p.grad = None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(a.warmup):
        step()
    sync()
    def done(steps, start):
        if a.steps is not None:
            return steps >= a.steps
        return time.perf_counter() - start >= a.seconds

    # Until --steps have run or --seconds have passed, then one synchronisation (on CUDA the
    # host may be ahead of the device; the time includes waiting for it).
    steps, start = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        if done(steps, start):
            break
    sync()
    seconds = time.perf_counter() - start
    out = {
        "images_per_s": steps * a.batch / seconds,
        "steps": steps,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "compiled": a.compile,
    }
    if device.type == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
