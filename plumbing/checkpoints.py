"""Checkpoints: what a run saves, how it resumes, and how a saved encoder or captioner is read back.

- `save_checkpoint` / `load_checkpoint`: one dict, written atomically (temporary file, fsync, rename), read back
  with `torch.load(weights_only=True)`, which never runs code, then the CRC-32 of every member checked.
- `rng_state` / `set_rng_state`: the random generators as plain tensors and lists, so that a resumed run draws the
  numbers it would have drawn; `start_or_resume` begins a run or continues one, refusing other settings and another
  training split (`split_fingerprint`); `check_resume` checks the files a resumed run needs before any work.
- `read_encoder`: a stage-1 checkpoint, adapt.py's or a CLIP4IDC release file (release.py), with every check that
  names what is wrong with a file (encoder.from_checkpoint rebuilds its pair encoder); `checkpoint_tokenizer`: the
  vocabulary a model was trained with; `load_trained`: a trained captioner and the settings it decides (caption.py
  --eval, --pair). caption.py passes its flags' values: nothing here imports it.
"""
import dataclasses
import functools
import hashlib
import os
import random
import shutil
import tempfile
import threading
import zipfile
from pathlib import Path

import numpy as np
import torch

import clip
from plumbing import clip_files
from plumbing.files import fsync_dir, no_space, out_of_space, remove_partial_files, signals_deferred
from plumbing.flags import ConfigError
from plumbing.progress import LOG_NAME, trim_log
from plumbing.release import RELEASE, release_checkpoint, release_stage


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: corrupt, truncated, or not one of this project's."""


# -----------------------------------------------------------------------------
# Random state: saved as tensors and lists so that weights_only loading accepts it


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # this process's GPU only, so that a machine with fewer GPUs can resume it
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# -----------------------------------------------------------------------------
# One dict, written atomically, read without running code


def save_checkpoint(state: dict, path) -> None:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`.

    A reader, or a run killed at any instant, sees either the old complete file or the new complete file. A Ctrl-C
    during the save takes effect when it is done (torch.save interrupted half-way raises another error instead).
    A full disk (checked before, or met while writing) is files.DiskFull, one line naming the file and the space it
    needs; the temporary file is removed and the previous checkpoint at `path` kept.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    needed = state_bytes(state)
    kept = f" ({path} keeps the previous checkpoint)" if path.exists() else ""
    fix = f"free some space there, then continue with --resume{kept}"
    if shutil.disk_usage(path.parent).free < needed:
        raise no_space(path, path.parent, needed, fix)
    with signals_deferred():
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except Exception as error:  # torch.save reports a failed write as a RuntimeError, the OSError its context
            if out_of_space(error):
                tmp.unlink(missing_ok=True)
                raise no_space(path, path.parent, needed, fix) from None
            raise
        finally:
            if tmp.exists():
                tmp.unlink()
        fsync_dir(path.parent)


class BackgroundWriter:
    """Checkpoints written on a thread of their own, so that a training step does not wait for the disk.

    Writing stage 1's whole training state (the model and AdamW's two moments) takes many steps' time on a GPU
    machine (BENCHMARKS.md section 11): written in the loop, every save would stop the GPU that long. write()
    copies the state's tensors to the host first (the step waits for that copy alone: the weights change in place
    at the next step), then a thread writes the copy with save_checkpoint (atomic, fsync,
    the same bytes). One write at a time: a second write(), and wait(), first wait for the one in flight, and raise
    its error (a full disk: DiskFull) there."""

    def __init__(self):
        self.thread, self.error = None, None

    def write(self, files: list[tuple[dict, Path]]) -> None:
        """Each (state, path) of one save point (ckpt_best.pt and ckpt_last.pt at an epoch's end), in order."""
        self.wait()
        copies = [(_to_host(state), path) for state, path in files]

        def work():
            try:
                for copy, path in copies:
                    save_checkpoint(copy, path)
            except BaseException as error:  # handed to the training thread at its next write() or wait()
                self.error = error

        self.thread = threading.Thread(target=work, name="checkpoint writer")
        self.thread.start()

    def wait(self) -> None:
        """Until the write in flight is on disk; its error, if it had one, is raised here."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def _to_host(state):
    """The state with every tensor copied to the host (a new copy also of a host tensor): what the writer keeps."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: _to_host(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_host(value) for value in state)
    return state


def state_bytes(state) -> int:
    """The bytes of the tensors in a checkpoint's dict (each storage once: tied weights share one): about the size
    of its file, which adds a few KB of pickled structure."""
    storages = {}
    def visit(value):
        if torch.is_tensor(value):
            storage = value.untyped_storage()
            storages[(value.device, storage.data_ptr())] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
    visit(state)
    return sum(storages.values())


def load_checkpoint(path, required=("model", "config"), release: bool = False) -> dict:
    """Read a checkpoint with `weights_only=True`: tensors and plain containers only, never code.

    release=True also accepts a CLIP4IDC release file, the reference's bare state dict (release.py).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: train first, or pass the right path")
    expected = "a checkpoint of this project" + (f", or {RELEASE}" if release else "")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {reason}); expected "
                              f"{expected}. It may be truncated or corrupt: delete it, or point to another "
                              f"checkpoint.") from None
    check_checksums(path)
    if release and release_stage(state) is not None:
        return state
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}: expected {expected}")
    return state


def check_checksums(path) -> None:
    """Refuse a checkpoint whose bytes do not match the CRC-32 of its members (torch.save writes a zip archive, and
    torch.load does not compare them: 8 KB overwritten inside a tensor loads, as other numbers). Reading the file
    again costs little beside the load (BENCHMARKS.md section 9)."""
    if not zipfile.is_zipfile(path):  # torch.save's legacy format (before torch 1.6) has no checksums
        return
    member = None
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                with archive.open(member) as file:
                    while file.read(1 << 24):  # the CRC-32 is compared at the member's end
                        pass
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise CheckpointError(f"{path} is damaged: {member.filename if member else 'its index'} does not match its "
                              f"checksum ({error}); delete it, or point to another checkpoint") from None


# -----------------------------------------------------------------------------
# Starting a run, or resuming one


def check_config(saved: dict, current: dict, keys, path) -> None:
    """Refuse to resume from a checkpoint whose settings `keys` (those that shape the model or change what the
    training computes: batch, schedule, rates, lengths) differ from this run's."""
    different = [f"--{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
                 for k in keys if saved.get(k) != current.get(k)]
    if different:
        raise ConfigError(f"{path} was written by a run with another configuration ("
                          + "; ".join(different) + "). Use the same flags, or a new --out_dir.")


def split_fingerprint(pairs) -> dict:
    """What a run trains on, as its checkpoints record it: the training split's number of pairs and a digest of
    their ids, image file names and captions (the names, not the folders: a dataset moved elsewhere is the same)."""
    digest = hashlib.sha256()
    for p in pairs:
        names = [Path(image).name if image else None for image in (p.before, p.after, p.distractor)]
        digest.update(repr((p.id, names, p.captions, p.no_change_captions)).encode())
    return {"pairs": len(pairs), "sha256": digest.hexdigest()}


def check_split(state: dict, fingerprint: dict | None, path) -> None:
    """Refuse to resume on another training split than the checkpoint's (split_fingerprint); a checkpoint written
    before it recorded one resumes as before."""
    saved = state.get("train_split")
    if saved is None or fingerprint is None or saved == fingerprint:
        return
    change = (f"{saved['pairs']:,} pairs then, {fingerprint['pairs']:,} now" if saved["pairs"] != fingerprint["pairs"]
              else f"{saved['pairs']:,} pairs then and now, but other pairs or captions")
    raise ConfigError(f"{path} was trained on another training split ({change}): resumed on it, the steps per epoch, "
                      f"the epoch, the learning-rate schedule and the data order would all shift. Resume with the "
                      f"split it was trained on, or start a new --out_dir")


def check_resume(out_dir, stage1=None) -> None:
    """--resume, before any work: out_dir/ckpt_last.pt reads; ckpt_best.pt is there once an epoch was validated
    (the run's final test scores it); for stage 2 (stage1: caption.Stage1), the stage-1 encoder is the one it was
    trained on."""
    out_dir = Path(out_dir)
    path, best = out_dir / "ckpt_last.pt", out_dir / "ckpt_best.pt"
    if not path.is_file():
        raise FileNotFoundError(f"--resume: there is no {path} to continue; start without --resume, or pass --resume "
                                f"auto, which starts when there is none and continues when there is (one command for "
                                f"a job's first start and its requeue)")
    state = load_checkpoint(path)
    if state.get("best_epoch", -1) >= 0 and not best.is_file():
        raise FileNotFoundError(f"{best} is missing, but {path} has validated {state['best_epoch'] + 1} or more "
                                f"epochs: the run's final test scores the best one from it; put it back, or start "
                                f"a new --out_dir")
    if stage1 is not None and state.get("encoder_sha256", stage1.sha256) != stage1.sha256:
        raise ConfigError(f"{path} was trained on another stage-1 checkpoint than {stage1.path} (its sha256 "
                          f"differs); pass the one it was trained on with --encoder_ckpt, or start a new --out_dir")


def start_or_resume(run, model_keys, model, optimizer, train_split: dict | None = None) -> dict | None:
    """The start of a run (run: loop.Run) whose last checkpoint is out_dir/ckpt_last.pt: None for a new run; with
    --resume, the checkpoint, after restoring the model, optimizer, scaler and random generators from it.

    The half-written files of a killed save are removed first. A new run never overwrites a finished one, and a
    checkpoint whose model-shaping settings (`model_keys`) differ from this run's is refused, and one trained on
    another training split (train_split: split_fingerprint's, which the run saves in its checkpoints).
    """
    path, config, dist_, scaler = Path(run.out_dir) / "ckpt_last.pt", run.config, run.dist_, run.scaler
    if dist_.master:
        remove_partial_files(path.parent)
    if not config.resume:
        if dist_.master and path.exists():
            raise FileExistsError(f"{path} exists: pass --resume to continue that run (--resume auto: continue it "
                                  f"when it is there, else start), or choose another --out_dir")
        if dist_.master:  # a run stopped before its first checkpoint left a log of steps that this run repeats
            (path.parent / LOG_NAME).unlink(missing_ok=True)
        return None
    state = load_checkpoint(path)
    check_config(state["config"], dataclasses.asdict(config), model_keys, path)
    check_split(state, train_split, path)
    if dist_.master:
        trim_log(path.parent / LOG_NAME, state["step"])
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    # float16: the loss scale and its growth count go on where they were. A float32 or bfloat16 run's checkpoint
    # has no scaler state (an empty dict); resumed in float16, the scaler starts at its initial scale.
    if state["scaler"] or not scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    if dist_.master:              # the master draws what it would have drawn; the others only need new numbers
        set_rng_state(state["rng"])
    else:
        seed_everything(config.seed + dist_.rank + state["step"])
    if dist_.master:
        print(f"resumed {path} at step {state['step']}")
    return state


# -----------------------------------------------------------------------------
# A stage-1 encoder and its vocabulary


def read_encoder(path, intra_layers: int = 9, flag: str = "--encoder_ckpt") -> dict:
    """A stage-1 checkpoint, for encoder.from_checkpoint to rebuild its pair encoder: adapt.py's, or a CLIP4IDC
    release file of either stage (its clip.* is the adapted encoder; release.release_checkpoint; its vocabulary is
    OpenAI's, bpe_path None, and "release" True).

    intra_layers: a release's split point, which its file does not hold (the reference's --intra_num_hidden_layers,
    9 in all its scripts); adapt.py's checkpoints record their own. flag: the option that named the file, for
    the errors (caption.py's --encoder_ckpt, adapt.py --eval's --checkpoint).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no stage-1 checkpoint at {path}: run adapt.py for this dataset first "
                                f"(python adapt.py --data ...), or pass --encoder_ckpt")
    state = load_checkpoint(path, required=("model",), release=True)
    release = release_stage(state) is not None
    if not release and "encoder_sha256" in state:
        raise ConfigError(f"{path} is a captioner (caption.py's stage-2 checkpoint), not a stage-1 encoder: "
                          f"{flag} takes adapt.py's checkpoint (runs/adapt_<data>/ckpt_best.pt) or a CLIP4IDC "
                          f"release; a captioner is scored with caption.py --eval --checkpoint {path}")
    missing = [k for k in ("clip_config", "encoder_config") if not release and k not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}: expected a checkpoint of this project, or {RELEASE}")
    if not release:
        return state
    blocks = len({k.split(".")[4] for k in state if k.startswith("clip.visual.transformer.resblocks.")})
    if not 0 < intra_layers <= blocks:
        raise ConfigError(f"--intra_layers {intra_layers}: {path} has {blocks} vision blocks, so it must be in "
                          f"[1, {blocks}] (the reference's split point is 9)")
    return {**release_checkpoint(state, intra_layers), "bpe_path": None, "release": True}


@functools.cache
def vocabulary_tensor(bpe_path) -> torch.Tensor:
    """A vocabulary file's bytes as a uint8 tensor: kept inside a checkpoint, so the checkpoint travels alone. Read
    once per process: a run saves it with every checkpoint, and the file does not change meanwhile."""
    return torch.frombuffer(bytearray(Path(bpe_path).read_bytes()), dtype=torch.uint8)


def vocabulary_hint(tokenizer=None) -> str:
    """What a vocabulary-mismatch error adds: which file the tokenizer read, and how to choose another."""
    read = f"the tokenizer read {tokenizer.bpe_path}; " if tokenizer is not None else ""
    env = os.environ.get("CLIP_BPE_PATH")
    return (f" ({read}a dataset without its own vocabulary file reads CLIP_BPE_PATH's"
            f"{f', now {env}' if env else ', not set'}, else OpenAI's: point CLIP_BPE_PATH at the model's)")


def checkpoint_tokenizer(state: dict, data_vocabulary=None) -> clip.SimpleTokenizer:
    """The tokenizer a checkpoint's model was trained with: the vocabulary kept inside it; for a checkpoint
    without one (older ones), the file at its stored path if it is still there (a hint, never a requirement),
    else data_vocabulary (the dataset's own, data.bpe_path), else OpenAI's (a release's, found by clip.py)."""
    if "vocabulary" in state:
        with tempfile.TemporaryDirectory() as folder:  # read once: the tokenizer keeps its merges, not the file
            path = Path(folder) / "bpe_vocab.txt.gz"
            path.write_bytes(state["vocabulary"].numpy().tobytes())
            return clip.SimpleTokenizer(path)
    for hint in (state.get("bpe_path"), data_vocabulary):
        if hint is not None and Path(hint).is_file():
            return clip.get_tokenizer(hint)
    return clip_files.get_tokenizer(None)


# -----------------------------------------------------------------------------
# A trained captioner, for --eval and --pair


@dataclasses.dataclass
class Trained:
    """A trained captioner's checkpoint, as caption.py --eval and --pair read it."""
    path: Path
    state: dict       # ours (caption.py's ckpt_best.pt) or a release's state dict
    settings: dict    # {flag: value} it decides for the caller's config
    release: bool     # the captioning stage of a CLIP4IDC release


def load_trained(path: Path, model_keys) -> Trained:
    """--eval, --pair: the trained captioner at `path`, ours (out_dir/ckpt_best.pt) or the captioning stage of a
    CLIP4IDC release (--checkpoint trained/pytorch_model.bin.clevr), and the settings it decides, {flag: value}
    for the caller's config: ours recorded its model settings (model_keys, caption.MODEL_KEYS, all but "data")."""
    best = load_checkpoint(path, required=("model", "config"), release=True)
    stage = release_stage(best)
    if stage == 1:
        raise ConfigError(f"{path} is the reference's adaptation stage (no decoder): caption with its "
                          f"captioning stage (trained/pytorch_model.bin.*), or train a captioner on it with "
                          f"--encoder_ckpt {path}")
    if stage == 2:  # the release holds its encoder too; its decoder reads the pair tokens, computed once
        return Trained(path, best, {"encoder_ckpt": str(path), "finetune_encoder": False}, release=True)
    if "encoder_sha256" not in best:
        if "encoder_config" in best:
            raise ConfigError(f"{path} is a stage-1 checkpoint (adapt.py's, no decoder): --checkpoint takes "
                              f"a captioner (caption.py's ckpt_best.pt); to train one on this encoder, pass "
                              f"--encoder_ckpt {path}")
        raise CheckpointError(f"{path} lacks ['encoder_sha256']: expected a captioner of caption.py")
    # ours: the model settings it was trained with
    return Trained(path, best, {k: best["config"][k] for k in model_keys if k != "data"}, release=False)
