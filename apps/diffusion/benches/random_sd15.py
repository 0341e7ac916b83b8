"""A full-size Stable Diffusion 1.5 folder in diffusers' layout with random weights, and a
captioned folder of random training images: what the GPU check runs `diffusion finetune
--model sd15/ --data imgs/ --gpu-mem 4G` on as a user types it, on a machine with no internet
(so no released weights).

The weights are diffusers' and transformers' own initialisation of `UNet2DConditionModel`,
`AutoencoderKL` and `CLIPTextModel` from the configs the app ships for SD 1.x
(`assets/sd/sd1/`, `assets/sd/common/vae.json`: the released folder's), saved as their
`save_pretrained` writes them; the tokenizer is OpenAI CLIP's, its merges from
`assets/clip/merges.txt.gz` and `vocab.json` built from them as open_clip (and the app's
`diffusion convert`) builds it. The images are random 512 px RGB PNGs with `.txt` captions.

    python random_sd15.py MODEL_DIR IMAGES_DIR [--images 8] [--size 512]

Benchmark-only; never on the product's path. Needs torch, transformers, diffusers, numpy and
pillow.
"""
import argparse
import gzip
import json
import os
import shutil

import numpy as np
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
ASSETS = os.path.join(HERE, "..", "assets")


def asset(*parts):
    with open(os.path.join(ASSETS, *parts)) as f:
        return json.load(f)


def byte_chars():
    """GPT-2's and CLIP's map of the 256 bytes to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tokenizer(folder):
    """CLIP's merges and the vocabulary built from them (49,408 entries)."""
    os.makedirs(folder, exist_ok=True)
    merges = gzip.open(os.path.join(ASSETS, "clip", "merges.txt.gz")).read().decode()
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write(merges)
    symbols = sorted(byte_chars())
    vocab = symbols + [s + "</w>" for s in symbols]
    vocab += ["".join(line.split(" ", 1)) for line in merges.splitlines()[1:] if " " in line]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(vocab) == 49408, len(vocab)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump({s: i for i, s in enumerate(vocab)}, f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(asset("sd", "sd1", "tokenizer_config.json"), f)


def model(out):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(out, "scheduler"))
    torch.manual_seed(0)
    UNet2DConditionModel.from_config(asset("sd", "sd1", "unet.json")).save_pretrained(os.path.join(out, "unet"))
    AutoencoderKL.from_config(asset("sd", "common", "vae.json")).save_pretrained(os.path.join(out, "vae"))
    text = CLIPTextModel(CLIPTextConfig.from_dict(asset("sd", "sd1", "text_encoder.json")))
    text.save_pretrained(os.path.join(out, "text_encoder"))
    tokenizer(os.path.join(out, "tokenizer"))
    shutil.copy(os.path.join(ASSETS, "sd", "sd1", "scheduler.json"), os.path.join(out, "scheduler", "scheduler_config.json"))
    shutil.copy(os.path.join(ASSETS, "sd", "sd1", "model_index.json"), os.path.join(out, "model_index.json"))


def images(out, n, size):
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(out, f"{i:04d}.png"))
        with open(os.path.join(out, f"{i:04d}.txt"), "w") as f:
            f.write(f"a photo of random pixels number {i}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("images")
    p.add_argument("--images", dest="count", type=int, default=8)
    p.add_argument("--size", type=int, default=512)
    a = p.parse_args()
    model(a.model)
    images(a.images, a.count, a.size)
    print(f"wrote {a.model} (random SD 1.5 weights) and {a.count} images in {a.images}")


if __name__ == "__main__":
    main()
