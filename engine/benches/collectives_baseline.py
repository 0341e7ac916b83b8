"""PyTorch baseline for benches/collectives.rs: the same bus-bandwidth measurement through
torch.distributed with the Gloo backend on 2 local ranks. Writes JSON rows to argv[1]."""
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANKS = 2
BUDGET = 0.4
SIZES = [4096 << (2 * i) for i in range(8)]


def timed(op):
    for _ in range(3):
        op()
    dist.barrier()
    start = time.perf_counter()
    op()
    once = max(time.perf_counter() - start, 1e-6)
    iters = torch.tensor([min(max(int(BUDGET / once), 5), 2000)], dtype=torch.int64)
    dist.broadcast(iters, 0)
    iters = int(iters.item())
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    return (time.perf_counter() - start) / iters


def rank_main(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    n = RANKS
    rows = []
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        t = timed(lambda: dist.all_reduce(x))
        rows.append({"op": "all_reduce", "bytes": nbytes, "busbw": nbytes * 2 * (n - 1) / n / t})
        y = torch.empty_like(x)
        t = timed(lambda: dist.all_to_all_single(y, x))
        rows.append({"op": "all_to_all", "bytes": nbytes, "busbw": nbytes * (n - 1) / n / t})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    mp.spawn(rank_main, args=(port, sys.argv[1]), nprocs=RANKS)


if __name__ == "__main__":
    main()
