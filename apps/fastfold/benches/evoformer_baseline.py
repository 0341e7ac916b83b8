"""One AlphaFold 2 Evoformer block in plain PyTorch eager, the baseline of
`benches/evoformer.rs` (run by it; not part of the product).

Written for the benchmark from the formulas of AlphaFold's `modules.py` (monomer order: MSA row
attention with pair bias, MSA column attention, MSA transition, outer product mean, triangle
multiplication outgoing and incoming, triangle attention around the starting and ending node,
pair transition), reading the same AlphaFold-named weights (`.npz`, one stacked block) and the
same inputs as the Rust side. It first checks that its outputs equal the Rust block's (saved
by the benchmark), then times forward and forward+backward. With `--trace DIR` it then profiles
one forward+backward with torch.profiler: a table of its kernels by name (the host's operators
on the CPU) on stderr, in the form of the Rust side's, and the Chrome trace in
`DIR/eager-forward-backward.json`.

    python evoformer_baseline.py PARAMS.npz INPUTS.npz --device cpu --iters 3 --warmup 1
prints one JSON line.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

P = "alphafold/alphafold_iteration/evoformer/evoformer_iteration/"


class Block:
    def __init__(self, arrays, device, dtype):
        self.w = {k[len(P):]: torch.from_numpy(np.asarray(v)[0]).to(device=device, dtype=dtype).requires_grad_(True)
                  for k, v in arrays.items() if k.startswith(P)}

    def p(self, name):
        return self.w[name]

    def ln(self, x, mod):
        return F.layer_norm(x, x.shape[-1:], self.p(mod + "//scale"), self.p(mod + "//offset"), 1e-5)

    def lin(self, x, mod):
        return x @ self.p(mod + "//weights") + self.p(mod + "//bias")

    def attention(self, q_data, m_data, bias, nonbatched, mod, gating=True):
        qw, kw, vw = self.p(mod + "//query_w"), self.p(mod + "//key_w"), self.p(mod + "//value_w")
        q = torch.einsum("bqa,ahc->bqhc", q_data, qw) * qw.shape[-1] ** -0.5
        k = torch.einsum("bka,ahc->bkhc", m_data, kw)
        v = torch.einsum("bka,ahc->bkhc", m_data, vw)
        logits = torch.einsum("bqhc,bkhc->bhqk", q, k) + bias
        if nonbatched is not None:
            logits = logits + nonbatched[None]
        avg = torch.einsum("bhqk,bkhc->bqhc", torch.softmax(logits, -1), v)
        if gating:
            gate = torch.einsum("bqc,chv->bqhv", q_data, self.p(mod + "//gating_w")) + self.p(mod + "//gating_b")
            avg = avg * torch.sigmoid(gate)
        return torch.einsum("bqhc,hco->bqo", avg, self.p(mod + "//output_w")) + self.p(mod + "//output_b")

    def row_attention(self, msa, mask, pair):
        m = "msa_row_attention_with_pair_bias"
        bias = (1e9 * (mask - 1.0))[:, None, None, :]
        x = self.ln(msa, m + "/query_norm")
        nb = torch.einsum("qkc,ch->hqk", self.ln(pair, m + "/feat_2d_norm"), self.p(m + "//feat_2d_weights"))
        return self.attention(x, x, bias, nb, m + "/attention")

    def column_attention(self, msa, mask):
        m = "msa_column_attention"
        msa, mask = msa.transpose(0, 1), mask.transpose(0, 1)
        bias = (1e9 * (mask - 1.0))[:, None, None, :]
        x = self.ln(msa, m + "/query_norm")
        return self.attention(x, x, bias, None, m + "/attention").transpose(0, 1)

    def transition(self, x, m):
        x = self.ln(x, m + "/input_layer_norm")
        return self.lin(torch.relu(self.lin(x, m + "/transition1")), m + "/transition2")

    def outer_product_mean(self, msa, mask):
        m = "outer_product_mean"
        mk = mask[..., None]
        x = self.ln(msa, m + "/layer_norm_input")
        left = mk * self.lin(x, m + "/left_projection")
        right = mk * self.lin(x, m + "/right_projection")
        outer = torch.einsum("sic,sje->ijce", left, right)
        act = torch.einsum("ijce,cef->ijf", outer, self.p(m + "//output_w")) + self.p(m + "//output_b")
        norm = torch.einsum("si,sj->ij", mask, mask)[..., None]
        return act / (1e-3 + norm)

    def triangle_multiplication(self, pair, mask, m, outgoing):
        mk = mask[..., None]
        x = self.ln(pair, m + "/layer_norm_input")
        left = mk * self.lin(x, m + "/left_projection") * torch.sigmoid(self.lin(x, m + "/left_gate"))
        right = mk * self.lin(x, m + "/right_projection") * torch.sigmoid(self.lin(x, m + "/right_gate"))
        eq = "ikc,jkc->ijc" if outgoing else "kjc,kic->ijc"
        act = self.ln(torch.einsum(eq, left, right), m + "/center_layer_norm")
        return self.lin(act, m + "/output_projection") * torch.sigmoid(self.lin(x, m + "/gating_linear"))

    def triangle_attention(self, pair, mask, m, starting):
        if not starting:
            pair, mask = pair.transpose(0, 1), mask.transpose(0, 1)
        bias = (1e9 * (mask - 1.0))[:, None, None, :]
        x = self.ln(pair, m + "/query_norm")
        nb = torch.einsum("qkc,ch->hqk", x, self.p(m + "//feat_2d_weights"))
        out = self.attention(x, x, bias, nb, m + "/attention")
        return out if starting else out.transpose(0, 1)

    def forward(self, msa, pair, msa_mask, pair_mask):
        msa = msa + self.row_attention(msa, msa_mask, pair)
        msa = msa + self.column_attention(msa, msa_mask)
        msa = msa + self.transition(msa, "msa_transition")
        pair = pair + self.outer_product_mean(msa, msa_mask)
        pair = pair + self.triangle_multiplication(pair, pair_mask, "triangle_multiplication_outgoing", True)
        pair = pair + self.triangle_multiplication(pair, pair_mask, "triangle_multiplication_incoming", False)
        pair = pair + self.triangle_attention(pair, pair_mask, "triangle_attention_starting_node", True)
        pair = pair + self.triangle_attention(pair, pair_mask, "triangle_attention_ending_node", False)
        pair = pair + self.transition(pair, "pair_transition")
        return msa, pair


def timed(fn, device, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def traced(fn, device, path, title, top=25):
    """`fn` once under torch.profiler: its events summed by name, largest first, as a markdown
    table on stderr (GPU kernels where there are any, else host operators), after a line with
    the wall time and the time they took; the Chrome trace at `path`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    prof.export_chrome_trace(path)
    events = prof.profiler.kineto_results.events()
    gpu = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA]
    chosen = gpu or [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU]
    sums = {}
    for e in chosen:
        calls, ns = sums.get(e.name(), (0, 0))
        sums[e.name()] = (calls + 1, ns + e.duration_ns())
    busy = sum(ns for _, ns in sums.values()) * 1e-9
    lines = [f"{title}: wall {wall * 1e3:.2f} ms, "
             + (f"GPU busy {busy * 1e3:.2f} ms ({100 * busy / wall:.0f}%)" if gpu
                else f"host operators {busy * 1e3:.2f} ms (nested operators each count their own time)"),
             f"| {'kernel' if gpu else 'operator'} | calls | ms | share |", "|---|---:|---:|---:|"]
    for name, (calls, ns) in sorted(sums.items(), key=lambda kv: (-kv[1][1], kv[0]))[:top]:
        short = name[:100].replace("|", "/")
        lines.append(f"| `{short}` | {calls} | {ns * 1e-6:.3f} | {100 * ns * 1e-9 / max(busy, 1e-300):.1f}% |")
    print("\n" + "\n".join(lines), file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("params")
    ap.add_argument("inputs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--fp32-matmul", choices=["tf32", "ieee"], default="tf32")
    ap.add_argument("--trace")
    a = ap.parse_args()
    # The legacy switch keeps libtorch's two records of the setting in step (CUDA only).
    torch.backends.cuda.matmul.allow_tf32 = a.fp32_matmul == "tf32"
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    block = Block(np.load(a.params), device, dtype)
    x = np.load(a.inputs)
    t = {k: torch.from_numpy(x[k]).to(device) for k in x.files}
    msa, pair = t["msa"].to(dtype), t["pair"].to(dtype)
    msa_mask, pair_mask = t["msa_mask"].to(dtype), t["pair_mask"].to(dtype)
    with torch.no_grad():
        m, z = block.forward(msa, pair, msa_mask, pair_mask)
    diff = max((m.float() - t["ours_msa"].float()).abs().max().item(), (z.float() - t["ours_pair"].float()).abs().max().item())
    wm, wz = t["weight_msa"].to(dtype), t["weight_pair"].to(dtype)

    def forward():
        with torch.no_grad():
            block.forward(msa, pair, msa_mask, pair_mask)

    def forward_backward():
        m, z = block.forward(msa, pair, msa_mask, pair_mask)
        ((m * wm).sum() + (z * wz).sum()).backward()
        for p in block.w.values():
            p.grad = None

    out = {"max_abs_diff": diff, "forward_ms": timed(forward, device, a.warmup, a.iters)}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out["forward_backward_ms"] = timed(forward_backward, device, a.warmup, a.iters)
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    if a.trace:
        traced(forward_backward, device, os.path.join(a.trace, "eager-forward-backward.json"),
               "PyTorch eager, forward+backward, traced")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
