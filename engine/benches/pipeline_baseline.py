"""PyTorch baseline for benches/pipeline.rs: the same model (layers of tanh(x W + b)), batch and
micro-batches through torch.distributed.pipelining with the Gloo backend on 2 local ranks, one
thread each; forward and backward only. Writes {schedule: seconds per step} to argv[1].

Usage: pipeline_baseline.py OUT LAYERS WIDTH BATCH MICRO WARMUP STEPS"""
import json
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

RANKS = 2


class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.b = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return torch.tanh(x @ self.w + self.b)


def rank_main(rank, port, out, layers, width, batch, micro, warmup, steps):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    torch.manual_seed(100)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    loss_fn = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    results = {}
    for name, schedule_cls, v in [
        ("gpipe", ScheduleGPipe, 1),
        ("1f1b", Schedule1F1B, 1),
        ("interleaved", ScheduleInterleaved1F1B, 2),
    ]:
        stages_total = RANKS * v
        per = layers // stages_total
        stages = []
        for stage in range(rank, stages_total, RANKS):
            module = nn.Sequential(*[Layer(width) for _ in range(per)])
            stages.append(PipelineStage(module, stage, stages_total, torch.device("cpu")))
        if v == 1:
            schedule = schedule_cls(stages[0], micro, loss_fn=loss_fn)
        else:
            schedule = schedule_cls(stages, micro, loss_fn=loss_fn)

        def run():
            for s in stages:
                s.submod.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            elif rank == RANKS - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()

        for _ in range(warmup):
            run()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            run()
        dist.barrier()
        results[name] = (time.perf_counter() - start) / steps
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main():
    out = sys.argv[1]
    layers, width, batch, micro, warmup, steps = (int(a) for a in sys.argv[2:8])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, out, layers, width, batch, micro, warmup, steps), nprocs=RANKS)


if __name__ == "__main__":
    main()
