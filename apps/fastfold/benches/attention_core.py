"""The core of fastfold's gated attention on the CPU, two ways, at 600 residues in chunks of 32:
libtorch's composition (logits by einsum, the key mask's and pair biases added, softmax, the
averaged values), as `model/attention.rs` ran it before, and `scaled_dot_product_attention` with
the pair bias as its additive mask, as it runs now (without autograd: the flash kernel).

    .venv/bin/python apps/fastfold/benches/attention_core.py

Prints milliseconds per call (the mean of 3 after a warm-up) and the largest difference from the
composition. Run it with nothing else on the machine.
"""
import time

import torch

torch.set_num_threads(2)
torch.manual_seed(0)


def run(b, n, c, h, d, what, reps=3):
    x = torch.randn(b, n, c)
    wq, wk, wv = (torch.randn(c, h, d) * c**-0.5 for _ in range(3))
    bias = torch.randn(h, n, n)
    mask = torch.ones(b, n)

    def composition(mask_added=True):
        q = torch.einsum("bqa,ahc->bqhc", x, wq) * d**-0.5
        k = torch.einsum("bka,ahc->bkhc", x, wk)
        v = torch.einsum("bka,ahc->bkhc", x, wv)
        logits = torch.einsum("bqhc,bkhc->bhqk", q, k)
        if mask_added:
            logits.add_((1e9 * (mask - 1))[:, None, None, :])
        logits.add_(bias)
        return torch.einsum("bhqk,bkhc->bqhc", logits.softmax(-1), v)

    def fused():
        q = torch.einsum("bqa,ahc->bhqc", x, wq)
        k = torch.einsum("bka,ahc->bhkc", x, wk)
        v = torch.einsum("bka,ahc->bhkc", x, wv)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0))
        return out.transpose(1, 2)

    with torch.no_grad():
        reference = composition()
        for name, f in [
            ("composition", composition),
            ("composition without the all-ones mask", lambda: composition(False)),
            ("scaled_dot_product_attention", fused),
        ]:
            f()
            start = time.perf_counter()
            for _ in range(reps):
                out = f()
            ms = (time.perf_counter() - start) / reps * 1e3
            diff = (out - reference).abs().max().item()
            print(f"{what} ({b} x {n} x {c}, {h} heads of {d}): {name} {ms:.1f} ms, max difference {diff:.2e}")


run(32, 600, 128, 4, 32, "Evoformer triangle attention")
run(32, 600, 64, 4, 16, "template triangle attention")
run(8, 600, 256, 8, 32, "MSA row attention")
