"""Caches: what the training scripts compute once and keep on disk, so that a step does not compute it again.

- The image cache (`image_cache`, `ImageCache`, opt-in with --image_cache): every image of a dataset decoded and
  resized once, kept as uint8 pixels in one .npy read memory-mapped; `image_reader` gives a dataset's
  data.ImageReader, with the cache or without it; `ResidentPixels`, the training images' pixels from the cache
  held in the GPU's memory (--resident_pixels).
- `IntraTokens`: each image's intra-image tokens, when the intra-image blocks are frozen (adapt.py --freeze_intra,
  and stage 2 finetuning on such an encoder), computed once per weights and images and shared by both stages.
- Stage 2's feature cache (`cached_features`, `feature_paths`, `FeatureItems`): every pair's tokens from a stage-1
  encoder that stays frozen, so that the decoder trains on them alone; caption.py's encode_pairs computes them,
  this file keeps them.

Each is named by what it depends on (file sizes and times, weights, image size), so a changed input gets a new
file, and each is written whole or not at all. Under torchrun the master builds it while the others wait.

Shape letters: R image side (224), N+1 tokens per image and D vision width (encoder.py's intra-image tokens),
M visual tokens per pair (100), E width (512).
"""
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import clip
from data import IMAGE_SIZE, CaptionItems, DataError, ImagePair, ImageReader, preprocess_uint8, usable_cpus
from plumbing.files import (NO_SPACE, NOT_WRITABLE, DiskFull, no_space, out_of_space, process_alive,
                            remove_partial_files, reserve_space, size_text, unwritable)
from plumbing.flags import ConfigError
from plumbing.processes import by_master
from plumbing.progress import Progress

# -----------------------------------------------------------------------------
# The image cache: preprocessed pixels


class ImageCache:
    """Preprocessed uint8 pixels of a list of image files: one .npy (n, R, R, 3), read memory-mapped.

    The index beside it (.json) lists the files and a fingerprint of their sizes and modification times;
    a cache whose files changed is built again. The array is opened in each process on first use, so a
    DataLoader worker shares the page cache instead of receiving a copy.
    """

    def __init__(self, array_path: Path, paths: list[str]):
        self.array_path = array_path
        self.row = {p: i for i, p in enumerate(paths)}
        self.pixels = None

    def __getitem__(self, path: Path) -> np.ndarray:
        if self.pixels is None:  # copy-on-write: writable views (as torch wants them) that nothing ever writes
            self.pixels = np.load(self.array_path, mmap_mode="c")  # (n, R, R, 3) uint8
        if str(path) not in self.row:
            raise DataError(f"image {path} is not in the cache {self.array_path}; delete the cache to build it again")
        return self.pixels[self.row[str(path)]]  # (R, R, 3)

    def __getstate__(self):  # a worker opens its own memory map
        return {**self.__dict__, "pixels": None}


class _Preprocess(Dataset):
    def __init__(self, paths: list[Path], image_size: int):
        self.paths, self.image_size = paths, image_size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return torch.from_numpy(preprocess_uint8(self.paths[i], self.image_size))


def add_file_stamps(digest, paths: list) -> None:
    """Feed each file's path, size and modification time to a hashlib digest: a changed file changes the digest."""
    for path in paths:
        stat = os.stat(path)
        digest.update(f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())


def fingerprint(paths: list[Path], image_size: int) -> str:
    digest = hashlib.sha256(str(image_size).encode())
    add_file_stamps(digest, paths)
    return digest.hexdigest()


def image_cache(pairs: list[ImagePair], cache_dir: str | os.PathLike, name: str, image_size: int = IMAGE_SIZE,
                workers: int | None = None) -> ImageCache:
    """The cache of every image of pairs (before, after, distractor) in cache_dir/<name>_<R>.npy, built if needed
    by `workers` processes (default: one per usable CPU; 0: this process alone).

    It takes 3 x R x R bytes per image (150 KB at 224): about 0.9 GB for the default synthetic set,
    18 GB for all of CLEVR-Change.
    """
    paths = list(dict.fromkeys(p for pair in pairs for p in (pair.before, pair.after, pair.distractor) if p))
    cache_dir = Path(cache_dir)
    array_path, index_path = cache_dir / f"{name}_{image_size}.npy", cache_dir / f"{name}_{image_size}.json"
    stamp = fingerprint(paths, image_size)
    if array_path.is_file() and index_path.is_file():
        problem = cache_problem(array_path, index_path, stamp, [str(p) for p in paths], image_size)
        if problem is None:
            return ImageCache(array_path, [str(p) for p in paths])
        if problem:  # damaged, not merely out of date
            print(f"image cache {array_path}: {problem}; building it again", file=sys.stderr)
    fix = "free some space there, or train with --no-image_cache (every image is decoded instead)"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(cache_dir)
        partial = array_path.with_suffix(f".partial-{os.getpid()}.npy")
        partial.unlink(missing_ok=True)
    except OSError as error:
        raise unwritable_cache(cache_dir, error) from None
    pixels = loader = None
    try:  # an error or an interrupt (Ctrl-C) anywhere from here on leaves no partial file behind
        try:
            pixels = np.lib.format.open_memmap(partial, mode="w+", dtype=np.uint8,
                                               shape=(len(paths), image_size, image_size, 3))  # (n, R, R, 3)
            # the whole file's blocks, reserved before a byte is written: a disk that fills while the cache is
            # built would otherwise end the process with SIGBUS ("Bus error") at the first page without a block
            with open(partial, "r+b") as file:
                reserve_space(file, os.fstat(file.fileno()).st_size, array_path, fix)
        except DiskFull:
            raise
        except OSError as error:
            if error.errno in NO_SPACE:
                raise no_space(array_path, cache_dir, cache_bytes(len(paths), image_size), fix) from None
            raise unwritable_cache(cache_dir, error) from None
        # a generator of its own: iterating a DataLoader draws a seed from the global generator, so building the
        # cache (first run) or not (later runs) would otherwise change every random number of the training after it
        workers = usable_cpus() if workers is None else workers
        loader = DataLoader(_Preprocess(paths, image_size), batch_size=64, num_workers=workers,
                            generator=torch.Generator())
        print(f"image cache {array_path}: {len(paths):,} images, {size_text(cache_bytes(len(paths), image_size))} on "
              f"disk, built once (--no-image_cache decodes the image files at every step instead)", file=sys.stderr)
        progress = Progress(len(paths), what=f"image cache {array_path}")
        row = 0
        for batch in loader:
            pixels[row:row + len(batch)] = batch.numpy()  # (b, R, R, 3)
            row += len(batch)
            progress.show(row)
        pixels.flush()
        pixels = None
        os.replace(partial, array_path)
        # the index last, atomically: an index beside an array always describes a whole array
        index = json.dumps({"image_size": image_size, "fingerprint": stamp, "paths": [str(p) for p in paths]})
        index_partial = index_path.with_suffix(f".partial-{os.getpid()}.json")
        try:
            index_partial.write_text(index, encoding="utf-8")
            os.replace(index_partial, index_path)
        except OSError as error:
            index_partial.unlink(missing_ok=True)
            if error.errno in NO_SPACE:
                raise no_space(index_path, cache_dir, len(index), fix) from None
            raise
    except BaseException:
        pixels = loader = None  # the memory map and the workers let go of the file first
        partial.unlink(missing_ok=True)
        raise
    return ImageCache(array_path, [str(p) for p in paths])


def cache_bytes(n: int, image_size: int) -> int:
    """The size of an image cache of n images without its header (a few hundred bytes)."""
    return n * image_size * image_size * 3


def unwritable_cache(cache_dir: Path, error: OSError) -> DataError:
    """The one-line error of an image cache that cannot be written (a read-only data folder)."""
    return DataError(f"cannot write the image cache in {cache_dir} ({error.strerror or error}); train with "
                     f"--no-image_cache (every image is decoded instead), or copy the dataset to a writable "
                     f"folder and pass --data_root")


def cache_problem(array_path: Path, index_path: Path, stamp: str, paths: list[str], image_size: int) -> str | None:
    """None when the cache at array_path with its index is whole and describes these files; "" when it describes
    other files or sizes (out of date); else what is damaged: an index that does not parse, an array whose
    header or size does not match (a copy cut short, a disk that filled)."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        if not isinstance(index, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as error:
        return f"its index {index_path} is damaged ({error})"
    if index.get("fingerprint") != stamp or index.get("paths") != paths:
        return ""
    try:
        with open(array_path, "rb") as file:
            version = np.lib.format.read_magic(file)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(file)
            size = file.tell() + int(np.prod(shape)) * dtype.itemsize
            actual = os.fstat(file.fileno()).st_size
    except (OSError, ValueError) as error:
        return f"its header is damaged ({error})"
    if shape != (len(paths), image_size, image_size, 3) or dtype != np.uint8:
        return f"it holds {shape} {dtype}, not {len(paths)} images of {image_size} x {image_size}"
    if actual != size:
        return f"it has {actual:,} bytes, its header says {size:,} (cut short?)"
    return None


def remove_stale_partials(cache_dir: Path) -> None:
    """Remove the partial caches and indexes (*.partial-PID.npy, .json) and intra-image tokens
    (intra_tokens_*.partial-PID) that a killed process left: their PID runs no more."""
    for partial in [*cache_dir.glob("*.partial-*.npy"), *cache_dir.glob("*.partial-*.json"),
                    *cache_dir.glob("intra_tokens_*.partial-*")]:
        pid = partial.name.rpartition(".partial-")[2].partition(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            partial.unlink(missing_ok=True)


def image_reader(splits: dict, root: Path, resolution: int, cached: bool, dist_) -> ImageReader:
    """The image reader of a dataset's splits, of resolution x resolution images: decoding each file, or with
    cached, reading the image cache of every pair of every split (root/.cache/all_<R>.npy). The cache is built
    once, by the master, while the other processes wait (dist_: processes.Distributed, its master and ddp)."""
    if not cached:
        return ImageReader(resolution)
    every_pair = [p for s in splits.values() for p in s]
    if dist_.master:
        image_cache(every_pair, Path(root) / ".cache", "all", resolution)
    if dist_.ddp:
        dist.barrier()
    return ImageReader(resolution, image_cache(every_pair, Path(root) / ".cache", "all", resolution))


# The image cache resident on the training device: no loader between the pixels and the step

RESIDENT_SHARE = 0.5  # --resident_pixels auto: the training images' pixels take at most this share of free memory


class ResidentPixels:
    """The uint8 pixels of the training images held in the training device's memory, read from the image cache.

    The loader then hands over no pixels: a sample carries its image's row in `table` (path -> a 0-dim int64
    tensor), and data.to_device looks a batch's rows up on the device and normalises them there. On a GPU this
    frees stage 1 from the loader, which decoding PNGs or reading the cache feeds more slowly than the step takes
    pairs (BENCHMARKS.md sections 7 and 11); the pixels are the cache's, so the batches are the same to the byte.
    CLEVR-Change's training images (before, after and distractor views) are about 15 GB.
    """

    def __init__(self, reader: ImageReader, pairs: list, device: torch.device):
        paths = sorted({str(path) for pair in pairs for path in pair_paths(pair)})
        self.row = {path: i for i, path in enumerate(paths)}
        R = reader.image_size
        self.table = torch.empty((len(paths), R, R, 3), dtype=torch.uint8, device=device)  # (n, R, R, 3)
        progress = Progress(len(paths), what=f"training pixels into {device.type} memory ({size_text(self.bytes)})")
        for start in range(0, len(paths), 1024):  # a chunk at a time: the host never holds the whole table
            chunk = np.stack([reader.cache[path] for path in paths[start:start + 1024]])  # (c, R, R, 3)
            self.table[start:start + len(chunk)].copy_(torch.from_numpy(chunk))
            progress.show(start + len(chunk))

    @property
    def bytes(self) -> int:
        return self.table.numel()

    @property
    def cache_dir(self) -> Path | None:
        return None

    def __call__(self, path) -> torch.Tensor:
        return torch.tensor(self.row[str(path)])  # the row the sample carries in place of its pixels

    def __getstate__(self):  # a loader worker hands over rows: it needs no pixels
        return {**self.__dict__, "table": None}


def pair_paths(pair: ImagePair) -> list:
    """A training pair's image files: before, after and the distractor view where there is one."""
    return [pair.before, pair.after] + ([pair.distractor] if pair.distractor is not None else [])


def resident_pixels(choice: str, reader: ImageReader, pairs: list, device: torch.device) -> bool:
    """Whether stage 1 trains from ResidentPixels: --resident_pixels on, off, or auto: on a GPU, with the image
    cache, when the training images' pixels take at most RESIDENT_SHARE of the GPU's free memory."""
    if choice not in ("auto", "on", "off"):
        raise ConfigError(f"--resident_pixels {choice}: it must be auto, on or off")
    if choice == "off" or (choice == "auto" and (device.type != "cuda" or reader.cache is None)):
        return False
    if reader.cache is None:
        raise ConfigError("--resident_pixels on reads the image cache: add --image_cache")
    if choice == "on":
        return True
    R = reader.image_size
    needed = len({str(path) for pair in pairs for path in pair_paths(pair)}) * R * R * 3
    return needed <= RESIDENT_SHARE * torch.cuda.mem_get_info(device)[0]


def draw_synthetic(config, root: Path, dist_) -> None:
    """The synthetic set (--data synth), drawn by synth.py on first use (by the master, while the other processes
    wait), and checked against --synth_pairs when it is there. Other datasets are downloaded, not drawn."""
    if config.data != "synth":
        return
    import synth  # the synthetic world's code, loaded only for it: a run on a downloaded dataset never reads it
    by_master(dist_, synth.ensure_synth, root, synth.SynthConfig(pairs=config.synth_pairs))


# -----------------------------------------------------------------------------
# Intra-image tokens: the frozen intra-image blocks' output

TORCH_SAVE_SLACK = 64 << 10  # what torch.save's zip archive adds to a tensor's bytes, at most (a few KB)


class IntraTokens:
    """path -> the image's intra-image tokens (N+1, D), computed once for every image of `pairs`.

    Used in place of the image reader when the intra-image blocks are frozen (adapt.py --freeze_intra, and
    caption.py --finetune_encoder on such a stage-1 checkpoint): they, and so their output, never change, and a
    training step then starts at the join (PairEncoder.intra_pair). Evaluation still encodes the
    pixels, all the way through. model is encoder.py's PairEncoder (its intra_image and intra_image_weights are
    read); images is a function path -> uint8 pixels (R, R, 3), such as an ImageReader.

    The tokens are kept in a file in cache_dir, named by what they depend on (the weights that compute them,
    each image file's size and modification time, the precision): stage 2 then reads the tokens stage 1
    computed instead of computing them again, and a changed image or weight gets a new file. Under DDP
    (dist_) the master computes them while the other processes wait, and every process reads the file
    memory-mapped: the processes of a machine share one copy in the page cache.
    """

    def __init__(self, model: torch.nn.Module, pairs: list, images, batch_size: int, device, ctx,
                 cache_dir: Path, dist_=None):
        paths = sorted({path for p in pairs for path in (p.before, p.after, p.distractor) if path is not None})
        self.row = {path: i for i, path in enumerate(paths)}
        master = dist_ is None or dist_.master
        # named by the master alone (the key reads every intra-image weight and stats every image file)
        file = Path(cache_dir) / f"intra_tokens_{self.key(model, paths, ctx)}.pt" if master else None
        if dist_ is not None and dist_.ddp:  # the master's file: its weights are those DDP gives every process
            shared = [file]
            dist.broadcast_object_list(shared, src=0)
            file = shared[0]
        self.read_from = file if file.is_file() and (not master or self.readable(file, len(paths))) else None
        if self.read_from is None and master:
            self.compute(model, paths, images, batch_size, device, ctx, file)
        if dist_ is not None and dist_.ddp:
            dist.barrier()
        self.tokens = torch.load(file, weights_only=True, mmap=True)  # (images, N+1, D), a plain tensor

    @staticmethod
    def readable(file: Path, images: int) -> bool:
        """Whether the tokens kept in file read back whole, one row per image; a damaged file (a copy cut short)
        is said so on stderr, and computed again."""
        try:
            tokens = torch.load(file, weights_only=True, mmap=True)
            if not torch.is_tensor(tokens) or tokens.dim() != 3 or len(tokens) != images:
                raise ValueError(f"it holds {type(tokens).__name__} {tuple(getattr(tokens, 'shape', ()))}, "
                                 f"not {images} images' tokens")
            return True
        except Exception as error:  # torch.load's errors of a damaged zip are RuntimeErrors
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:120]
            print(f"intra-image tokens {file} are damaged ({reason}): computing them again", file=sys.stderr)
            return False

    @staticmethod
    def compute(model: torch.nn.Module, paths: list, images, batch_size: int, device, ctx, file: Path) -> None:
        """Every image's intra-image tokens, written whole to file, then renamed: an interrupted run leaves no
        half-written file. Their space is reserved first (files.reserve_space): a disk too full for them is one line
        naming the file and the space it needs (DiskFull), before the write, instead of torch.save's "unexpected
        pos" midway."""
        chunks = []
        with torch.no_grad():
            for start in range(0, len(paths), batch_size):
                pixels = torch.stack([images(path) for path in paths[start:start + batch_size]])  # (b, R, R, 3)
                with ctx:
                    chunks.append(model.intra_image(clip.normalize(pixels.to(device))).float().cpu())  # (b, N+1, D)
        tokens = torch.cat(chunks)  # (images, N+1, D)
        size = tokens.numel() * tokens.element_size() + TORCH_SAVE_SLACK
        fix = ("free some space there (the intra-image tokens are kept beside the dataset's image cache, else in "
               "--out_dir), or copy the dataset to a disk with room and pass --data_root")
        partial = file.with_suffix(f".partial-{os.getpid()}")
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(file.parent)  # a killed run's
            with open(partial, "wb") as handle:
                reserve_space(handle, size, file, fix)
                torch.save(tokens, handle)
                handle.truncate()  # the reserved blocks past torch.save's last byte
            os.replace(partial, file)
        except BaseException as error:
            partial.unlink(missing_ok=True)
            if isinstance(error, OSError) and error.errno in NOT_WRITABLE:
                raise unwritable(file.parent, error, "the intra-image tokens are kept there: make it writable for "
                                                     "this user, or copy the dataset to a writable folder and "
                                                     "pass --data_root") from None
            if not isinstance(error, DiskFull) and out_of_space(error):
                raise no_space(file, file.parent, size, fix) from None
            raise

    @staticmethod
    def key(model: torch.nn.Module, paths: list, ctx) -> str:
        """A digest of what the tokens depend on: the intra-image weights, the image files, the precision."""
        digest = hashlib.sha256(str(getattr(ctx, "fast_dtype", "float32")).encode())
        for name, tensor in model.intra_image_weights().items():
            digest.update(name.encode() + tensor.detach().float().cpu().numpy().tobytes())
        add_file_stamps(digest, paths)
        return digest.hexdigest()[:16]

    @property
    def origin(self) -> str:
        """Where the tokens came from, for the scripts to say."""
        return f"read from {self.read_from}" if self.read_from is not None else "computed once"

    def __call__(self, path) -> torch.Tensor:
        return self.tokens[self.row[path]]  # (N+1, D)


# -----------------------------------------------------------------------------
# Stage 2's feature cache: every pair encoded once


def cached_features(encoder_sha: str, pairs, shape: tuple, cache_dir: Path, name: str, encode) -> Path:
    """cache_dir/<name>_<key>.npy, float16 (rows, M, E) = shape, filled by encode(pairs, out, what) once per stage-1
    checkpoint (encoder_sha), split and set of image files. The key reads each image file's size and modification
    time, as the image cache and the intra-image tokens do: a replaced image gets a new file."""
    described = "\n".join(f"{p.id}\t{p.before}\t{p.after}" for p in pairs)
    digest = hashlib.sha256(f"{encoder_sha}\n{IMAGE_SIZE}\n{described}".encode())
    add_file_stamps(digest, [path for p in pairs for path in (p.before, p.after)])
    path = cache_dir / f"{name}_{digest.hexdigest()[:16]}.npy"
    if path.is_file():
        return path
    partial = path.with_name(f".{path.name}.tmp{os.getpid()}")
    size = int(np.prod(shape)) * 2  # float16
    fix = ("free some space there, or choose an --out_dir on a disk with room (the pair features are kept in its "
           "features/)")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        remove_partial_files(cache_dir)  # the partial files of killed runs (gigabytes at CLEVR-Change's size)
        array = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float16, shape=shape)
        # the whole file's blocks, reserved before a byte is written: a disk that fills while the features are
        # written would otherwise end the process with SIGBUS ("Bus error") at the first page without a block
        with open(partial, "r+b") as file:
            reserve_space(file, os.fstat(file.fileno()).st_size, path, fix)
    except OSError as error:
        array = None  # the memory map lets go of the file first
        partial.unlink(missing_ok=True)
        if isinstance(error, DiskFull):
            raise
        if error.errno in NO_SPACE:
            raise no_space(path, cache_dir, size, fix) from None
        if error.errno not in NOT_WRITABLE:
            raise
        raise unwritable(cache_dir, error, "the pair features are kept there: make it writable for this user, or "
                                           "choose another --out_dir") from None
    try:
        encode(pairs, array, f"{name} ({len(pairs)} pairs)")
        array.flush()
        del array
        partial.replace(path)
    finally:  # an interrupt or an error leaves no partial file behind
        partial.unlink(missing_ok=True)
    return path


class FeatureItems(Dataset):
    """data.CaptionItems with each pair's cached tokens (float16) in place of its images ("visual",
    "no_change_visual")."""

    def __init__(self, items: CaptionItems, features_path: Path):
        self.items, self.features_path, self.features = items, features_path, None

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        if self.features is None:  # opened in each process (DataLoader workers too), memory-mapped
            self.features = np.load(self.features_path, mmap_mode="r")
        item = self.items[i]
        # float16 as cached: half the bytes to hand over; data.to_device widens them to float32 on the device
        item["visual"] = torch.from_numpy(np.array(self.features[item["row"]]))  # (M, E)
        if "no_change_row" in item:
            item["no_change_visual"] = torch.from_numpy(np.array(self.features[item["no_change_row"]]))
        return item

    def __getstate__(self):
        return {**self.__dict__, "features": None}


def feature_paths(encoder_sha: str, eval_pairs: dict, names, shape: tuple, out_dir: Path, dist_, encode) -> dict:
    """{split: the .npy file of its pair tokens} for the splits `names`, in out_dir/features (cached_features; shape:
    a row's (M, E)): encoded by the master while the others wait, then found in the cache by the others."""
    def find_or_encode():
        return {s: cached_features(encoder_sha, eval_pairs[s], (len(eval_pairs[s]), *shape), out_dir / "features", s,
                                   encode) for s in names}
    paths = find_or_encode() if dist_.master else {}
    if dist_.ddp:
        dist.barrier()
        paths = paths or find_or_encode()
    return paths
