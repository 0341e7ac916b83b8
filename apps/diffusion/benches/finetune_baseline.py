"""diffusers' UNet2DConditionModel fine-tuning steps in PyTorch eager, the baseline of
`benches/finetune.rs` (run by it; not part of the product).

The step of diffusers' `train_text_to_image.py` on random data: fp32 weights, the forward under
autocast in the compute precision (with a GradScaler for fp16 on a GPU), mean squared error
against the noise, backward, torch's AdamW (diffusers' default hyperparameters). No memory
cap. Weights are diffusers' random initialisation of the given config. An SDXL config
(`addition_embed_type: text_time`) also gets random pooled text and the time ids of an uncropped
image at the resolution, as ours.

    python finetune_baseline.py CONFIG.json --device cpu --resolution 256 --batch 1 \
        --precision fp32 --steps 3 --warmup 1 [--gradient-checkpointing]
prints one JSON line: seconds_per_step, peak_bytes and, on a GPU, card_peak_bytes (the card's
peak use through the run as `nvidia-smi` counts it, `total - free` read every 5 ms, as
`engine::process::CardPeak` reads ours).
"""
import argparse
import json
import resource
import threading
import time

import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class CardPeak:
    """The card's largest `total - free` (torch.cuda.mem_get_info) seen every 5 ms until stopped."""

    def __init__(self, device):
        self.device, self.peak, self.done = device, 0, threading.Event()
        self.read()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def read(self):
        free, total = torch.cuda.mem_get_info(self.device)
        self.peak = max(self.peak, total - free)

    def run(self):
        while not self.done.wait(0.005):
            self.read()

    def finish(self):
        self.done.set()
        self.thread.join()
        self.read()
        return self.peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--precision", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    a = ap.parse_args()

    with open(a.config) as f:
        config = json.load(f)
    torch.manual_seed(0)
    device = torch.device(a.device)
    card = CardPeak(device) if device.type == "cuda" else None
    unet = UNet2DConditionModel.from_config(config).to(device)
    unet.train()
    if a.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    dtype = DTYPES[a.precision]
    scaler = torch.amp.GradScaler("cuda", enabled=a.precision == "fp16" and device.type == "cuda")
    side = a.resolution // 8

    def step(i):
        g = torch.Generator(device="cpu").manual_seed(i + 1)
        noisy = torch.randn(a.batch, 4, side, side, generator=g).to(device)
        noise = torch.randn(a.batch, 4, side, side, generator=g).to(device)
        context = torch.randn(a.batch, 77, config["cross_attention_dim"], generator=g).to(device)
        t = torch.randint(0, 1000, (a.batch,), generator=g).to(device)
        added = None
        if config.get("addition_embed_type") == "text_time":
            pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
            r = float(a.resolution)
            added = {"text_embeds": torch.randn(a.batch, pooled, generator=g).to(device),
                     "time_ids": torch.tensor([[r, r, 0.0, 0.0, r, r]] * a.batch, device=device)}
        with torch.autocast(device.type, dtype=dtype, enabled=a.precision != "fp32"):
            pred = unet(noisy, t, context, added_cond_kwargs=added).sample
        loss = F.mse_loss(pred.float(), noise)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    for i in range(a.warmup):
        step(i)
    start = time.perf_counter()
    for i in range(a.steps):
        step(a.warmup + i)
    seconds = (time.perf_counter() - start) / max(a.steps, 1)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    card_peak = card.finish() if card else None
    print(json.dumps({"seconds_per_step": seconds, "peak_bytes": peak, "card_peak_bytes": card_peak}))


if __name__ == "__main__":
    main()
