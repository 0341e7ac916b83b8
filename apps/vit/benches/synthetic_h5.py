"""A synthetic image set in the suite's HDF5 schema (`data::h5`, `suite-images-v1`): N random
RGB images of SIZE x SIZE pixels in 1,000 classes, for timing `vit pretrain` from HDF5 where no
ImageNet is at hand (the GPU check's 32k-batch row). The pixels are 256 distinct random images
repeated, each copy with its own label: the loader's work (a row read, the random resized crop,
the flip, the normalisation) does not depend on what the pixels are, and writing stays fast.

    python synthetic_h5.py OUT.h5 --images 32768 --size 224

Benchmark-only; never on the product's path. Needs numpy and h5py.
"""
import argparse
import os

import h5py
import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--images", type=int, required=True)
    p.add_argument("--size", type=int, default=224)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    distinct = rng.integers(0, 256, size=(256, a.size, a.size, 3), dtype=np.uint8)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp = a.out + ".partial"
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = "suite-images-v1"
        f["classes"] = np.array([f"class{i:04d}" for i in range(1000)], dtype=h5py.string_dtype())
        f["labels"] = (np.arange(a.images) * 7919 % 1000).astype("int64")
        images = f.create_dataset("images", shape=(a.images, a.size, a.size, 3), dtype=np.uint8)
        for start in range(0, a.images, len(distinct)):
            n = min(len(distinct), a.images - start)
            images[start:start + n] = distinct[:n]
    os.replace(tmp, a.out)
    print(f"wrote {a.out}: {a.images} images of {a.size} px")


if __name__ == "__main__":
    main()
