# `OMP_NUM_THREADS=1 .venv/bin/python apps/fastfold/benches/triangle_product_layouts.py 64` (c: 64 the
# template stack's width, 128 the Evoformer's); docs/benchmarks.md, "Where our time goes at 300 + 300".
# Stand-in for issue 39: one triangle multiplication's product over k at 600 residues in
# chunks of 32 rows, libtorch's einsum per chunk (before) against bmm on a channel-first
# projection laid out once (after). Same libtorch as fastfold's.
import sys, time, torch
r, c, chunk = 600, int(sys.argv[1]), 32
left, right = torch.randn(r, r, c), torch.randn(r, r, c)
def before():
    out = torch.empty(r, r, c)
    for s in range(0, r, chunk):
        out[s:s+chunk] = torch.einsum('ikc,jkc->ijc', left[s:s+chunk], right)
    return out
def after():
    out = torch.empty(r, r, c)
    R = right.permute(2, 1, 0).contiguous()
    for s in range(0, r, chunk):
        out[s:s+chunk] = torch.bmm(left[s:s+chunk].permute(2, 0, 1), R).permute(1, 2, 0)
    return out
assert (before() - after()).abs().max() < 1e-3
for f in (before, after, before, after):
    t = time.perf_counter(); f(); print(f.__name__, c, round(time.perf_counter() - t, 2), flush=True)
