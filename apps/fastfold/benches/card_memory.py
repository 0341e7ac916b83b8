"""The AlphaFold baselines' peak memory (`alphafold_baseline.py`, `alphafold_multimer_baseline.py`):
on the CPU the process's peak resident set; on a GPU the card's peak use through the run as
`nvidia-smi` counts it (`total - free` from NVML, read every 5 ms on a thread of its own, as
`engine::process::CardPeak` reads our side's), which covers what JAX's allocator holds and
the CUDA context and libraries beside it. NVML through ctypes, so that nothing that touches
CUDA is loaded for the reading. The card is NVML's device 0: the lent GPU machines have one.

Benchmark-only; never on the product's path.
"""
import ctypes
import resource
import threading


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class PeakMemory:
    """Started before the work, `finish()` after it: the peak in bytes."""

    def __init__(self, gpu):
        self.card = None
        if gpu:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            handle = ctypes.c_void_p()
            for name, call in [("nvmlInit_v2", lambda: nvml.nvmlInit_v2()),
                               ("nvmlDeviceGetHandleByIndex_v2",
                                lambda: nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)))]:
                status = call()
                if status != 0:
                    raise RuntimeError(f"NVML {name} failed with status {status}")
            self.nvml, self.handle, self.peak, self.done = nvml, handle, 0, threading.Event()
            self.read()
            self.card = threading.Thread(target=self.run, daemon=True)
            self.card.start()

    def read(self):
        memory = _Memory()
        if self.nvml.nvmlDeviceGetMemoryInfo(self.handle, ctypes.byref(memory)) == 0:
            self.peak = max(self.peak, memory.total - memory.free)

    def run(self):
        while not self.done.wait(0.005):
            self.read()

    def finish(self):
        if self.card is None:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.done.set()
        self.card.join()
        self.read()
        return self.peak
