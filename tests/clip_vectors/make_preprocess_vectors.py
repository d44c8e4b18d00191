"""Remake preprocess_vectors/expected.npz and images.json by running OpenAI's own image transform on the PNGs.

Run by hand, never by the tests (see README.md beside this file). It needs openai/CLIP at commit
d05afc436d78f1c48dc0dbf8e5980a9d471f35f6, in a checkout outside the repository, and torchvision 0.28.0 with
Pillow 13.0.0 (CLIP_DIR and TV_DIR are placeholders for folders of your choice; torchvision goes into a
folder of its own, so that the project's environment stays without it):

    git clone https://github.com/openai/CLIP CLIP_DIR
    git -C CLIP_DIR checkout d05afc436d78f1c48dc0dbf8e5980a9d471f35f6
    pip install --no-deps --target TV_DIR torchvision==0.28.0
    PYTHONPATH=TV_DIR python tests/clip_vectors/make_preprocess_vectors.py CLIP_DIR           # writes both files
    PYTHONPATH=TV_DIR python tests/clip_vectors/make_preprocess_vectors.py CLIP_DIR --check   # compares only

OpenAI's `clip.clip._transform(224)` runs on each PNG as read back from disk: `<name>` is its float32
(3, 224, 224) output, `<name>__rgb_uint8` the (224, 224, 3) image after its first three steps (resize, crop,
convert("RGB")). images.json records each image's mode, size, resize target and crop offsets, and the
largest difference between torchvision's output and the same steps written with Pillow and numpy here.

The six PNGs are the inputs: synthetic drawings (stripes, gradients, shapes, alpha, a palette) made
earlier for this project by code that was not kept, so they cannot be remade, only carried over.

The PyPI wheel of torchvision is built for CUDA builds of torch: against a CPU-only torch its compiled
operators do not load, and `import torchvision` fails while registering their meta kernels. The transforms
used here are plain Python on Pillow images, so in that case the two registration modules are replaced by
empty stand-ins and torchvision is imported again.
"""
import argparse
import io
import json
import sys
import types
from pathlib import Path

import numpy as np
from PIL import Image

from make_tiny_clip import import_openai_clip  # the same import of OpenAI's package, beside this file

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "preprocess_vectors"
N_PX = 224
NAMES = ["rgb_480x320", "rgba_320x480", "gray_300x200", "rgb_388x320_oddcrop", "palette_200x150",
         "rgb_60x100_upscale"]  # the PNGs, in the files' order
STEPS = ["Resize(224, BICUBIC) shorter side", "CenterCrop(224)", "convert('RGB')", "ToTensor (/255)",
         "Normalize(mean, std)"]


def import_torchvision():
    try:
        import torchvision  # noqa: F401
    except RuntimeError:  # "operator torchvision::nms does not exist": the compiled operators did not load
        for name in [name for name in sys.modules if name.startswith("torchvision")]:
            del sys.modules[name]
        for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
            sys.modules[name] = types.ModuleType(name)
        import torchvision  # noqa: F401


def pil_numpy(image: Image.Image, mean, std) -> np.ndarray:
    """The same steps with Pillow and numpy alone, as a cross-check of torchvision's output."""
    w, h = image.size
    size = (N_PX, int(N_PX * h / w)) if w <= h else (int(N_PX * w / h), N_PX)  # the shorter side to 224, the long
    resized = image.resize(size, Image.Resampling.BICUBIC)                      # side truncated, as torchvision's
    left, top = int(round((size[0] - N_PX) / 2.0)), int(round((size[1] - N_PX) / 2.0))  # its center crop's offsets
    pixels = np.asarray(resized.crop((left, top, left + N_PX, top + N_PX)).convert("RGB"))
    x = pixels.astype(np.float32).transpose(2, 0, 1) / np.float32(255)
    return (x - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]


def make(openai_clip):
    transform = openai_clip._transform(N_PX)
    to_rgb = type(transform)(transform.transforms[:3])  # resize, center crop, convert("RGB")
    normalize = transform.transforms[-1]
    mean, std = list(normalize.mean), list(normalize.std)
    arrays, images = {}, {}
    for name in NAMES:
        image = Image.open(FOLDER / f"{name}.png")
        image.load()
        out = transform(image).numpy()
        resized = transform.transforms[0](image)
        w, h = resized.size
        arrays[name] = out
        arrays[f"{name}__rgb_uint8"] = np.asarray(to_rgb(image))
        images[name] = {"mode": image.mode, "size_wh": list(image.size), "resized_wh": [w, h],
                        "crop_left_top": [int(round((w - N_PX) / 2.0)), int(round((h - N_PX) / 2.0))],
                        "produced_by": "torchvision (OpenAI clip.clip._transform(224))",
                        "max_abs_diff_torchvision_vs_pil_numpy": float(np.abs(out - pil_numpy(image, mean, std)).max())}
    info = {"transform": {"n_px": N_PX, "mean": mean, "std": std, "steps": STEPS}, "images": images}
    return arrays, info


def npz_bytes(arrays: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of openai/CLIP at d05afc4")
    parser.add_argument("--check", action="store_true", help="compare with the files here; write nothing")
    args = parser.parse_args(argv)
    import_torchvision()
    openai_clip, _, _ = import_openai_clip(args.checkout)
    arrays, info = make(openai_clip)
    made = {"expected.npz": npz_bytes(arrays), "images.json": json.dumps(info, indent=1).encode("utf-8")}
    if not args.check:
        for filename, data in made.items():
            (FOLDER / filename).write_bytes(data)
            print(f"{filename}: {len(data):,} bytes")
        return 0
    shipped = np.load(FOLDER / "expected.npz")
    same_arrays = list(shipped.files) == list(arrays) and all(
        shipped[k].dtype == v.dtype and np.array_equal(shipped[k], v) for k, v in arrays.items())
    same_info = json.loads((FOLDER / "images.json").read_text()) == info
    for filename, same in (("expected.npz", same_arrays), ("images.json", same_info)):
        same_bytes = (FOLDER / filename).read_bytes() == made[filename]
        print(f"{filename}: {'the same bytes' if same_bytes else 'DIFFERENT bytes'}, "
              f"{'the same content' if same else 'DIFFERENT content'}")
    return 0 if same_arrays and same_info else 1


if __name__ == "__main__":
    sys.exit(main())
