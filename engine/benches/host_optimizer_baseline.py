"""PyTorch baseline for benches/host_optimizer.rs: torch.optim.AdamW(fused=True) on CPU tensors,
over the same parameter count in the same chunk sizes, and the whole host step of fp16 training
with clipping as PyTorch writes it (GradScaler's unscale, clip_grad_norm_, the fused AdamW
step, the fp16 copy of the weights, zero_grad). Prints one JSON line of seconds per step
(median of --steps after one warm-up step)."""
import argparse
import json
import statistics
import time

import torch


def median_seconds(step, steps, before=None):
    times = []
    for i in range(steps + 1):
        if before is not None:
            before()
        start = time.perf_counter()
        step()
        if i > 0:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--loss-scale", type=float, default=1024.0)
    ap.add_argument("--max-norm", type=float, default=1.0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    sizes = [min(a.chunk, a.params - at) for at in range(0, a.params, a.chunk)]
    params = [torch.nn.Parameter(torch.randn(n) * 0.02) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * a.loss_scale

    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    adamw = median_seconds(opt.step, a.steps)

    # The whole step under fp16 loss scaling and clipping: GradScaler.unscale_ (one fused
    # multi-tensor kernel with the overflow check), clip_grad_norm_ (foreach norm and scale),
    # the fused step, the weights' fp16 copy, and zero_grad keeping the buffers.
    halves = [torch.empty(n, dtype=torch.float16) for n in sizes]
    grads = [p.grad for p in params]
    found_inf = torch.zeros(1)
    inv_scale = torch.full((1,), 1.0 / a.loss_scale)

    def refill():
        for g in grads:
            g.normal_().mul_(a.loss_scale)

    def full_step():
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        torch.nn.utils.clip_grad_norm_(params, a.max_norm, foreach=True)
        if found_inf.item() == 0:
            opt.step()
        torch._foreach_copy_(halves, [p.detach() for p in params])
        opt.zero_grad(set_to_none=False)

    full = median_seconds(full_step, a.steps, refill)
    print(json.dumps({"adamw_s": adamw, "full_step_s": full, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
