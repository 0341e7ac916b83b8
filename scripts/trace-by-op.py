"""GPU time of a Chrome trace (libtorch's profiler, as the benchmarks' --trace writes it) by
kernel and the operators that launched it, as a markdown table.

    python3 scripts/trace-by-op.py TRACE.json [TOP]

A benchmark's own table sums kernels by name; a copy or element-wise kernel's name says nothing
of where it came from. Here each kernel (and device copy and fill) is joined through its
correlation id to the runtime call that launched it, and that call to the operators open on
the launching thread at the time (the innermost three, an autograd node's name first when the
launch came from backward). `scripts/gpu-check.sh` runs it on every trace before the large
ones are left behind. Standard library only.
"""

import collections
import json
import sys


def launch_stacks(events):
    """Each runtime launch's correlation id -> the names of the operators open on its thread
    when it was made, outermost first: one sweep per thread in time order, a stack of the open
    operators popped as they end (not a search of every operator per kernel: a predict pass
    has tens of thousands of each)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            by_thread[e["tid"]].append((e["ts"], 0, -e["dur"], e))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            by_thread[e["tid"]].append((e["ts"], 1, 0, e))
    stacks = {}
    for timeline in by_thread.values():
        # Operators before launches at the same instant, outer (longer) before inner.
        timeline.sort(key=lambda item: item[:3])
        open_ops = []
        for ts, is_launch, _, e in timeline:
            while open_ops and open_ops[-1]["ts"] + open_ops[-1]["dur"] < ts + e["dur"]:
                open_ops.pop()
            if is_launch:
                stacks[e["args"]["correlation"]] = [o["name"] for o in open_ops]
            else:
                open_ops.append(e)
    return stacks


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not device:
        print(f"{path}: no GPU events")
        return
    stacks = launch_stacks(events)
    sums = collections.defaultdict(lambda: [0, 0.0])
    for k in device:
        stack = stacks.get(k.get("args", {}).get("correlation"))
        if stack is None:
            where = "?"
        else:
            # Our fused operations' backward nodes (engine::autograd::apply) by a short name.
            names = [n.replace("torch::autograd::CppNode<(anonymous namespace)::RustFunction>", "fused backward") for n in stack]
            node = [n.split(": ", 1)[1] for n in names if n.startswith("autograd::engine::evaluate_function")]
            inner = [n for n in names if not n.startswith("autograd::engine")][-3:]
            chain = [n for i, n in enumerate(node[-1:] + inner) if i == 0 or n != (node[-1:] + inner)[i - 1]]
            where = " > ".join(chain) or "(no operator: a fused kernel's forward)"
        key = (k["name"][:70], where)
        sums[key][0] += 1
        sums[key][1] += k["dur"]
    busy = sum(v[1] for v in sums.values())
    print(f"{path}: GPU busy {busy / 1e3:.2f} ms in {len(device)} kernels, copies and fills")
    print("| kernel | launched in | calls | ms | share |")
    print("|---|---|---:|---:|---:|")
    for (name, where), (calls, us) in sorted(sums.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| `{name.replace('|', '/')}` | {where.replace('|', '/')} | {calls} | {us / 1e3:.3f} | {100 * us / busy:.1f}% |")


if __name__ == "__main__":
    main()
