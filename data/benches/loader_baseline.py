"""torchvision's side of data/benches/loader.rs: DataLoader images/s for a JPEG folder
(torchvision.datasets.ImageFolder) and for the same images in an HDF5 file (h5py, one handle
per worker process), with RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize.
Prints `folder <images/s>` and `h5 <images/s>`."""
import argparse
import time

import h5py
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets, transforms


class H5Images(Dataset):
    """Rows of `images` ([N, H, W, C] uint8) with `labels`; the file is opened in each worker."""

    def __init__(self, path, transform):
        self.path, self.transform, self.file = path, transform, None
        with h5py.File(path, "r") as f:
            self.labels = f["labels"][:]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        if self.file is None:
            self.file = h5py.File(self.path, "r")
        return self.transform(Image.fromarray(self.file["images"][i])), int(self.labels[i])


def rate(dataset, args):
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0, drop_last=True)
    images, start, warm = 0, None, False
    while True:
        for x, _ in loader:
            assert x.shape == (args.batch, 3, args.crop, args.crop), x.shape
            if not warm:
                warm, start = True, time.perf_counter()
                continue
            images += args.batch
            if time.perf_counter() - start >= args.seconds:
                return images / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--h5", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--crop", type=int, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    t = transforms.Compose([
        transforms.RandomResizedCrop(args.crop),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    print("folder", rate(datasets.ImageFolder(args.folder, t), args), flush=True)
    print("h5", rate(H5Images(args.h5, t), args), flush=True)


if __name__ == "__main__":
    main()
