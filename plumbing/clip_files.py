"""CLIP's files: the checksummed download cache of its weights and vocabulary, and OpenAI's weight files read
without running them. clip.py is the model, the tokenizer and preprocessing; this is how their files reach the
machine, as openai/CLIP keeps clip/clip.py (downloads, load) apart from clip/model.py.

It holds, top to bottom:
    1. the download cache: each named model's URL and sha256 (MODELS), the vocabulary's (BPE_URL), a download
       kept only when its sha256 matches, the one-line errors of an offline machine or an unwritable cache;
    2. weight files: OpenAI's TorchScript archives unpickled with a whitelist, never executed; every other
       weights file through torch.load(weights_only=True) (load_state_dict);
    3. load(), which puts them together with clip.py's model and preprocessing, as openai/CLIP's clip.load, and
       get_tokenizer(), the tokenizer of a vocabulary file found in this order: given, $CLIP_BPE_PATH, the cache;
and nothing else.

What differs from the reference (openai/CLIP clip/clip.py): the archive is read for its tensors only (there is no
jit=True mode); a download is checked by sha256 before it gets its name, and again on every load.

Environment: CLIP_CACHE (cache folder, default ~/.cache/clip), CLIP_BPE_PATH (vocabulary file).
"""
import collections
import hashlib
import os
import pickle
import tempfile
import urllib.parse
import urllib.request
import warnings
import zipfile
from pathlib import Path

import torch

import clip
from clip import FileError


# ---------------------------------------------------------------------------------------------------
# 1. The download cache: weights and vocabulary, checked by sha256
# ---------------------------------------------------------------------------------------------------

# What is trusted. Loading never runs code from a weights file. OpenAI's released `.pt` files are
# TorchScript archives: a zip holding Python-like code and a pickle of the module tree. We never read the
# code, and we read the pickle with an unpickler that accepts only what rebuilding tensors needs (tensor
# rebuilding, storage types, OrderedDict) plus an inert stand-in for TorchScript's module classes; any
# other name is refused. Every other weights file goes through torch.load(weights_only=True). A named model
# (MODELS) is downloaded into the cache and kept only if its sha256 matches (OpenAI's URL embeds it); it is
# checked again on every load. The synthetic CLIP, "synth-ViT/32", takes the same path from a file URL into
# this repository's assets/, so the default run exercises the loading of OpenAI's weights. The BPE vocabulary
# is downloaded with its pinned sha256. Files you name yourself (a path, CLIP_BPE_PATH) and a vocabulary
# already in the cache are used as found: they are read as data, never executed, but their contents are trusted.

# The named models: where each weights file comes from, and its sha256, checked on download and on every load.
# OpenAI's published weights: the folder name in the URL is the file's sha256 (openai/CLIP clip/clip.py).
# "synth-ViT/32" is this project's CLIP of the synthetic world (width 128, 6 + 2 blocks, 32-pixel patches),
# pretrained like OpenAI's but on single synthetic scenes (`python pretrain.py`, stage 0) and
# shipped in assets/; it reaches the cache through the same download-and-check path as OpenAI's file.
MODELS = {
    "ViT-B/32": ("https://openaipublic.azureedge.net/clip/models/"
                 "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af/ViT-B-32.pt",
                 "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af"),
    "synth-ViT/32": ((Path(__file__).resolve().parents[1] / "assets" / "synth-ViT-32.pt").as_uri(),
                     "01de576b323b67d2a93cc2170aec12946f92c4ac5af322d3c17dd61bd1a4ec37"),
}
BPE_URL = "https://raw.githubusercontent.com/openai/CLIP/main/clip/bpe_simple_vocab_16e6.txt.gz"
BPE_SHA256 = "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"
DEFAULT_CACHE = "~/.cache/clip"
DOWNLOAD_CHUNK = 1 << 20  # bytes per read while downloading
DOWNLOAD_TIMEOUT_S = 30   # give up on a silent connection instead of hanging


def cache_dir(download_root: str | os.PathLike | None = None) -> Path:
    """The folder for downloaded weights and vocabulary: the argument, else $CLIP_CACHE, else ~/.cache/clip."""
    return Path(download_root or os.environ.get("CLIP_CACHE") or DEFAULT_CACHE).expanduser()


def sha256_of(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(DOWNLOAD_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def unwritable_cache(root: Path, error: OSError) -> FileError | None:
    """The one-line FileError of a cache folder this user may not write (an unwritable HOME), or None for any
    other error (offline, a failed connection)."""
    if not isinstance(error, PermissionError):
        return None
    return FileError(f"cannot write CLIP's cache folder {root} ({error.strerror or error}); set CLIP_CACHE to a "
                     f"folder this user can write (e.g. CLIP_CACHE=/tmp/clip_cache), or make {root} writable")


def download(url: str, root: str | os.PathLike, expected_sha256: str) -> Path:
    """root/<file name in url>, downloaded unless a file with the right sha256 is already there.

    The bytes go to a temporary file in root and are hashed on the way; only a file whose sha256
    matches is renamed (atomically, os.replace) to its final name, so a crash or a bad download never
    leaves a file that looks valid. A bad download is deleted. A failed connection raises OSError.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / Path(urllib.parse.urlparse(url).path).name
    if target.is_file():
        if sha256_of(target) == expected_sha256:
            return target
        warnings.warn(f"{target} exists but its sha256 is not {expected_sha256}; downloading it again")
    fd, partial = tempfile.mkstemp(dir=root, prefix=f".{target.name}.", suffix=".part")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as source:
            while chunk := source.read(DOWNLOAD_CHUNK):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != expected_sha256:
            raise FileError(f"the file downloaded from {url} has sha256 {digest.hexdigest()}, expected "
                            f"{expected_sha256}; it was deleted. Try again, or download it by hand and check it")
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)  # a no-op after the rename; deletes a partial or bad download
    return target


def find_bpe_vocabulary(bpe_path: str | os.PathLike | None = None) -> Path:
    """The vocabulary file: bpe_path, else $CLIP_BPE_PATH, else the cache (downloaded there when missing)."""
    for given, where in ((bpe_path, "the bpe_path argument"), (os.environ.get("CLIP_BPE_PATH"), "CLIP_BPE_PATH")):
        if given:
            if not Path(given).is_file():
                raise FileNotFoundError(f"BPE vocabulary {given} (from {where}) does not exist")
            return Path(given)
    root = cache_dir()
    cached = root / Path(urllib.parse.urlparse(BPE_URL).path).name
    if cached.is_file():  # only a verified download gets this name (see download), so it is used as found
        return cached
    try:
        return download(BPE_URL, root, BPE_SHA256)
    except OSError as error:
        if unwritable_cache(root, error):
            raise unwritable_cache(root, error) from None
        raise FileNotFoundError(
            f"CLIP's BPE vocabulary {cached.name} is not in {root} and could not be downloaded from {BPE_URL} "
            f"({error}). Get it on a machine with internet access:\n  curl -L -o {cached.name} {BPE_URL}\n"
            f"  sha256sum {cached.name}   # must print {BPE_SHA256}\nthen put it in {root} (or set CLIP_CACHE to "
            f"its folder), or point CLIP_BPE_PATH at it") from error


# ---------------------------------------------------------------------------------------------------
# 2. Weight files: OpenAI's TorchScript archives, read without running them
# ---------------------------------------------------------------------------------------------------

# TorchScript archives are read by unpickling their data.pkl with a whitelist (see "What is trusted").
STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}


class _ScriptModule:
    """An inert stand-in for a TorchScript module class: it only keeps the attributes it is given."""
    attributes: dict = {}

    def __setstate__(self, attributes):
        self.attributes = attributes


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    return torch.as_strided(storage, size, stride, storage_offset)


class _ArchiveUnpickler(pickle.Unpickler):
    """Unpickles a TorchScript data.pkl, allowing only the names that rebuilding tensors needs."""

    def __init__(self, archive: zipfile.ZipFile, prefix: str, path: Path):
        super().__init__(archive.open(f"{prefix}/data.pkl"))
        self.archive, self.prefix, self.path = archive, prefix, path
        self.storages = {}

    def find_class(self, module, name):
        if module.startswith("__torch__"):  # a module class of the traced model, e.g. __torch__.clip.model.CLIP
            return _ScriptModule
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        raise FileError(f"{self.path}: refusing to load {module}.{name}; a CLIP TorchScript archive holds "
                        f"only tensors and modules, so this file is not what it claims to be")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid  # ("storage", dtype, "17", "cpu", numel)
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise FileError(f"{self.path}: unexpected persistent id {pid!r}; the archive is corrupt")
        if key not in self.storages:
            raw = self.archive.read(f"{self.prefix}/data/{key}")
            if len(raw) != numel * dtype.itemsize:
                raise FileError(f"{self.path}: storage {key} holds {len(raw)} bytes, expected "
                                f"{numel * dtype.itemsize}; the file is corrupt")
            self.storages[key] = torch.frombuffer(bytearray(raw), dtype=dtype) if numel else torch.empty(0, dtype=dtype)
        return self.storages[key]


def _module_tensors(module: _ScriptModule, prefix: str, out: dict):
    """A module's tensors under state_dict names: its own first, then each submodule's, in order."""
    for name, value in module.attributes.items():
        if isinstance(value, torch.Tensor):
            out[prefix + name] = value.clone()
    for name, value in module.attributes.items():
        if isinstance(value, _ScriptModule):
            _module_tensors(value, f"{prefix}{name}.", out)
    return out


def _read_torchscript_archive(archive: zipfile.ZipFile, prefix: str, path: Path) -> dict[str, torch.Tensor]:
    byteorder = f"{prefix}/byteorder"
    if byteorder in archive.namelist() and archive.read(byteorder).strip() != b"little":
        raise FileError(f"{path} was saved on a big-endian machine, which this reader does not handle")
    root = _ArchiveUnpickler(archive, prefix, path).load()
    if not isinstance(root, _ScriptModule):
        raise FileError(f"{path} is a TorchScript archive whose top object is not a module")
    # a traced module's attributes that are tensors are exactly its parameters and buffers
    return _module_tensors(root, "", {})


def load_state_dict(path: str | os.PathLike, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """The tensors of an OpenAI TorchScript archive or of a plain state dict, on the CPU.

    Floating-point tensors become dtype (None keeps the stored dtypes: fp16 and fp32 in OpenAI's files).
    The archive gives the same tensors as torch.jit.load(path).state_dict(), without running the archive.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            prefix = pickles[0].split("/")[0] if pickles else ""
            is_torchscript = any(n.startswith(f"{prefix}/code/") or n == f"{prefix}/constants.pkl"
                                 for n in archive.namelist())
            state_dict = _read_torchscript_archive(archive, prefix, path) if pickles and is_torchscript else None
    except (zipfile.BadZipFile, EOFError, pickle.UnpicklingError, ValueError, KeyError) as error:
        # a truncated zip fails here with BadZipFile; one that is not a zip at all goes on to torch.load
        if zipfile.is_zipfile(path):
            raise FileError(f"{path} is a corrupt weights archive ({error}): delete it and get it again") from error
        state_dict = None
    if state_dict is None:
        try:
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            raise FileError(f"{path} is truncated, corrupt or not a weights file: delete it and download or "
                            f"save it again (torch.load said: {reason})") from error
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise FileError(f"{path} holds a {type(state_dict).__name__}, not a state dict of tensors")
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in state_dict.items()}


# ---------------------------------------------------------------------------------------------------
# 3. load(): weights file + model + preprocess, as openai/CLIP's clip.load; the tokenizer of a vocabulary
# ---------------------------------------------------------------------------------------------------

def load(name_or_path: str | os.PathLike = "ViT-B/32", device: str | torch.device = "cpu",
         download_root: str | os.PathLike | None = None) -> tuple[clip.CLIP, object]:
    """(model, preprocess) for a model name in MODELS or a path to a weights file.

    A name is looked up in the cache (download_root, else $CLIP_CACHE, else ~/.cache/clip) and downloaded
    there with its checksum if missing. A path is used as is.
    """
    if os.path.isfile(name_or_path):
        path = Path(name_or_path)
    elif name_or_path in MODELS:
        (url, sha256), root = MODELS[name_or_path], cache_dir(download_root)
        filename = Path(urllib.parse.urlparse(url).path).name
        try:
            path = download(url, root, sha256)
        except OSError as error:
            if unwritable_cache(root, error):
                raise unwritable_cache(root, error) from None
            raise FileNotFoundError(
                f"CLIP weights {name_or_path} ({root / filename}) are missing and could not be downloaded from "
                f"{url} ({error}). Get them on a machine with internet access:\n  curl -L -o {filename} {url}\n"
                f"  sha256sum {filename}   # must print {sha256}\nthen put the file in {root} (or set CLIP_CACHE "
                f"to its folder), or pass the file's path instead of the name (adapt.py --clip_model PATH)") from error
    else:
        raise FileNotFoundError(f"{name_or_path} is neither a file nor a known model name {list(MODELS)}")
    # differs from reference: no jit=True mode; the archive is only read for its tensors (section 2)
    model = clip.build_model(load_state_dict(path)).to(device)
    return model, clip.transform(model.visual.input_resolution)


def get_tokenizer(bpe_path: str | os.PathLike | None = None) -> clip.SimpleTokenizer:
    """The tokenizer of a vocabulary file: bpe_path, else $CLIP_BPE_PATH, else OpenAI's from the cache
    (find_bpe_vocabulary), built once per file (clip.get_tokenizer)."""
    return clip.get_tokenizer(find_bpe_vocabulary(bpe_path))
