# `OMP_NUM_THREADS=2 .venv/bin/python apps/fastfold/benches/triangle_product_layouts.py 64` (c: 64 the
# template stack's width, 128 the Evoformer's); docs/benchmarks.md, "Where our time goes at 300 + 300".
# Stand-in for issue 39: one triangle multiplication's product over k at 600 residues in
# chunks of 32 rows: libtorch's einsum per chunk (einsum), bmm on a channel-first projection
# laid out whole once (whole_layout), and bmm on a projection laid out channel-first a chunk
# of rows at a time as it is made, read transposed as a view (chunk_layout, what fastfold
# runs). Same libtorch as fastfold's.
import sys, time, torch
r, c, chunk = 600, int(sys.argv[1]), 32
left, right = torch.randn(r, r, c), torch.randn(r, r, c)
def product(R):
    out = torch.empty(r, r, c)
    for s in range(0, r, chunk):
        out[s:s+chunk] = torch.bmm(left[s:s+chunk].permute(2, 0, 1), R).permute(1, 2, 0)
    return out
def einsum():
    out = torch.empty(r, r, c)
    for s in range(0, r, chunk):
        out[s:s+chunk] = torch.einsum('ikc,jkc->ijc', left[s:s+chunk], right)
    return out
def whole_layout():
    # [j, k, c] to [c, k, j] in one copy: the copy reads one float per cache line.
    return product(right.permute(2, 1, 0).contiguous())
def chunk_layout():
    R = torch.empty(c, r, r)
    for s in range(0, r, chunk):
        R[:, s:s+chunk] = right[s:s+chunk].permute(2, 0, 1).contiguous()
    return product(R.transpose(1, 2))
def layout_copy(f):
    # The layout alone: the projection made channel-first, no product.
    def whole():
        return right.permute(2, 1, 0).contiguous()
    def chunks():
        R = torch.empty(c, r, r)
        for s in range(0, r, chunk):
            R[:, s:s+chunk] = right[s:s+chunk].permute(2, 0, 1).contiguous()
        return R
    return {'whole_layout': whole, 'chunk_layout': chunks}[f.__name__]
reference = einsum()
for f in (whole_layout, chunk_layout):
    assert (f() - reference).abs().max() < 1e-3
for f in (einsum, whole_layout, chunk_layout, einsum, whole_layout, chunk_layout):
    t = time.perf_counter(); f(); print(f.__name__, c, 'product', round(time.perf_counter() - t, 3), flush=True)
for f in (whole_layout, chunk_layout, whole_layout, chunk_layout):
    copy = layout_copy(f)
    t = time.perf_counter(); copy(); print(f.__name__, c, 'layout alone', round(time.perf_counter() - t, 3), flush=True)
