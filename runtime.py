"""What a training run needs that both stage scripts share: config flags, processes, precision, checkpoints.

adapt.py (stage 1, IDC adaptation) and caption.py (stage 2, IDC finetuning) are plain nanoGPT-style loops.
The plumbing they share, and that is longer than a few lines, lives here so that each script stays a loop
you can read top to bottom:

- `parse_config`: argparse built from the script's `Config` dataclass. Each field is a flag; the comment
  after the field is its --help text; a dataset preset is applied before the command-line flags.
- `Distributed`, `resolve_dtype`, `set_tf32`, `GROUP_TIMEOUT`, `loader_workers`: what a script's own DDP set-up
  fills in, the precision 'auto' means (by the GPU's compute capability), TF32, how long a process waits for the
  master, how many loader processes 'auto' means (the set-up itself, `init_process_group`, autocast and the
  GradScaler, is written out in each script).
- `save_checkpoint` / `load_checkpoint`: one dict per checkpoint, written atomically (temporary file, fsync,
  rename), read back with `torch.load(weights_only=True)` so a checkpoint can never run code; `load_encoder`:
  a stage-1 pair encoder from adapt.py's checkpoint or from a CLIP4IDC release file (the reference's weights);
  `start_or_resume` begins a run or continues one from its last checkpoint.
- `run`: a script's main(), with the errors a user can fix (`USER_ERRORS`: a missing or bad file, a bad setting,
  bad data), a diverged run and Ctrl-C printed as one line; any other exception, a bug or an out-of-memory,
  keeps its traceback.
- `check_settings`, `check_device`, `check_length`: a Config's values checked before any work, so a bad flag
  fails at once; `check_config`: what --resume refuses to change; `DivergenceWatch`: a diverged run stops at the
  next log step, naming the step where it diverged, without a wait for the GPU in every step.
- `rng_state` / `set_rng_state`: Python, NumPy and torch generators as plain tensors and lists, so that a
  resumed run draws the same numbers it would have drawn.
- `batch_plan`, `training_loader`, `epoch_batches`, `SkipSampler`: the global batch split over processes and
  accumulation, the run's one DataLoader (persistent workers, pinned batches), and one epoch's micro-batches,
  resumed part-way through when a run was interrupted.
- `StopSignals`, `stopped`, `data_error_stop`: Ctrl-C and SIGTERM end the step in progress, the master saves
  ckpt_last.pt and the run stops in one line (130, 143), every process at the same check under torchrun; a damaged
  image met in training saves the last step, then stops in one line naming it.
- `check_out_dir`, `OutDirLock`: an --out_dir that is a file is refused before any work; one run at a time writes
  into an --out_dir (a lock the kernel drops when its process dies), a second is refused naming the first.
- `Progress` and `JsonlLog`: one progress line with an ETA, and a JSON-lines log of every logged step.
- `keep_freed_memory`: glibc keeps freed blocks for reuse, so a CPU training step does not page-fault.

Run `python runtime.py` for a demo of the config parser and the progress line.
"""

import argparse
import contextlib
import ctypes
import fcntl
import dataclasses
import datetime
import functools
import inspect
import itertools
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import typing
import zipfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import clip
import data
from encoder import EncoderConfig, PairEncoder
from release import RELEASE, release_encoder, release_stage

# -----------------------------------------------------------------------------
# Configuration: a dataclass becomes the command line


class ConfigError(ValueError):
    """A setting that cannot work: a bad flag value, or flags that contradict a checkpoint or each other."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: corrupt, truncated, or not one of this project's."""


# The errors a user can fix, by the file, flag or data they name: the scripts print these as one line.
USER_ERRORS = (FileNotFoundError, FileExistsError, ConfigError, CheckpointError, data.DataError, clip.FileError,
               data.DiskFull)


def _field_comments(cls) -> dict:
    """The `# comment` written after each field of a dataclass, used as that flag's --help text; a line holding
    only a comment whose # stands in the same column continues it. A subclass's comments come after its bases'
    (pretrain.Config extends adapt's)."""
    comments = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        field, column = None, -1
        for line in inspect.getsource(klass).splitlines():
            match = re.match(r"\s*(\w+)\s*:[^#]*#\s*(.*)$", line)
            if match:
                field, column = match.group(1), line.index("#")
                comments[field] = match.group(2).strip()
            elif field is not None and line.lstrip().startswith("#") and line.index("#") == column:
                comments[field] += " " + line[column + 1:].strip()
            else:
                field = None
    return comments


def _flag_type(kind):
    if kind is bool:
        return None  # handled by BooleanOptionalAction
    if kind in (int, float, str):
        return kind
    return str  # Optional[str] and friends: the script converts


def parse_config(config_cls, presets: dict, argv=None, description: str = ""):
    """Defaults of `config_cls`, then `presets[--data]`, then the flags given; returns a `config_cls`.

    Every dataclass field `name` is a flag `--name` (underscores may be written as dashes). A flag that is
    not a field fails with argparse's error, so a misspelt option never passes silently.
    """
    comments = _field_comments(config_cls)
    defaults = config_cls()
    hints = {f.name: f.type for f in dataclasses.fields(config_cls)}
    preset_lines = "\n".join(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in values.items())
                             for name, values in presets.items())
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        epilog=f"presets (chosen by --data, applied before the flags you give):\n{preset_lines}")
    for f in dataclasses.fields(config_cls):
        kind = hints[f.name]
        kind = kind if not isinstance(kind, str) else eval(kind)  # tolerate string annotations
        flags = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        help_text = f"{comments.get(f.name, '')} (default: {getattr(defaults, f.name)!r})"
        if kind is bool:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(kind) is tuple:  # e.g. tuple[str, str]: a flag that takes that many values
            parts = typing.get_args(kind)
            names = comments.get(f.name, "").split(":")[0].split()  # "BEFORE AFTER: ..." names the values
            metavar = tuple(names) if len(names) == len(parts) and all(n.isupper() for n in names) \
                else tuple(f"{f.name.upper()}{i + 1}" for i in range(len(parts)))
            parser.add_argument(*flags, dest=f.name, type=parts[0], nargs=len(parts), default=argparse.SUPPRESS,
                                metavar=metavar, help=help_text)
        else:
            parser.add_argument(*flags, dest=f.name, type=_flag_type(kind), default=argparse.SUPPRESS,
                                metavar=f.name.upper(), help=help_text)
    given = vars(parser.parse_args(argv))
    data = given.get("data", getattr(defaults, "data", None))
    if presets and data not in presets:
        parser.error(f"--data {data!r} is not a known dataset; choose one of: {', '.join(presets)}")
    values = dataclasses.asdict(defaults)
    values.update(presets.get(data, {}))
    values.update({k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
    try:
        return config_cls(**values)  # its __post_init__ checks the values (check_settings)
    except ConfigError as error:
        parser.error(str(error))


def check_settings(config, positive=(), non_negative=(), fraction=()) -> None:
    """Refuse a bad flag value before any data is read (a batch of 0 pairs, a negative learning rate)."""
    for names, ok, what in ((positive, lambda v: v > 0, "> 0"), (non_negative, lambda v: v >= 0, ">= 0"),
                            (fraction, lambda v: 0 <= v < 1, "in [0, 1)")):
        for name in names:
            value = getattr(config, name)
            if isinstance(value, float) and not math.isfinite(value):  # inf passes "> 0", and nan fails no test
                raise ConfigError(f"--{name} {value!r}: it must be a finite number, {what}")
            if not ok(value):
                raise ConfigError(f"--{name} {value!r}: it must be {what}")


def check_config(saved: dict, current: dict, keys, path) -> None:
    """Refuse to resume from a checkpoint whose settings `keys` (those that shape the model or change what the
    training computes: batch, schedule, rates, lengths) differ from this run's."""
    different = [f"--{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
                 for k in keys if saved.get(k) != current.get(k)]
    if different:
        raise ConfigError(f"{path} was written by a run with another configuration ("
                          + "; ".join(different) + "). Use the same flags, or a new --out_dir.")


def check_device(device: str) -> str:
    """--device as torch will use it: auto is cuda when torch sees a GPU, else cpu; a GPU that is not there is
    refused in one line (a CPU build of torch, or no driver) instead of a traceback at the first tensor."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        build = "is a CPU build" if torch.version.cuda is None else "sees no GPU"
        raise ConfigError(f"--device {device}: this torch ({torch.__version__}) {build}; use --device cpu, or "
                          f"install a CUDA build of torch (pytorch.org) on a machine with an NVIDIA GPU")
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: this project trains on cpu or cuda")
    return device


def check_length(name: str, value: int, least: int, most: int, why: str) -> None:
    """A length flag (caption tokens) inside what the model can hold: refused before any work starts."""
    if not least <= value <= most:
        raise ConfigError(f"--{name} {value}: it must be in [{least}, {most}] ({why})")


def check_image_path(name: str, path: str) -> None:
    """An output image path whose extension PIL can write (.png, .jpg, ...), checked before the work that fills it."""
    Image.init()  # registers every format PIL has, so that the list below is complete
    kind = Image.registered_extensions().get(Path(path).suffix.lower())
    if kind not in Image.SAVE:
        named = f"*{Path(path).suffix}" if Path(path).suffix else "without an extension"
        raise ConfigError(f"--{name} {path}: PIL cannot write an image {named}; end the name with .png (or .jpg, "
                          f".webp)")


class Diverged(RuntimeError):
    """A training step whose loss or gradient norm is not finite: the run stops, saving nothing more."""


class DivergenceWatch:
    """Stop the run at the first optimizer step whose loss or gradient norm is inf or NaN (Diverged, one line),
    without waiting for the device at every step.

    add() keeps each step's loss and gradient norm as they are, tensors on the device; check() reads them, on the
    log steps and before every save: reading a number from a GPU waits for every kernel queued before it, so a
    check per step would stall the GPU once per step. A run that diverges thus stops at the next check, at most
    --log_every steps later, naming the first bad step; a checkpoint written after it is impossible.

    float16: GradScaler skips a step whose scaled gradients overflowed and halves its scale; that is expected, so
    the gradient norm is not checked then. The loss is the model's own output in every precision: no scale mends
    a non-finite one. Under DDP the first bad step is all-reduced, so that every process stops at the same check
    (the losses differ between processes).

    The same check says when to stop for a signal (`stop`, a StopSignals): check() returns True when a process was
    sent SIGINT or SIGTERM. Under DDP the flag travels in the same all-reduce as the first bad step (a rank that
    stopped alone would wait for ever in the next collective), so every process stops at the same check; alone=True
    skips the collective, for a process that stops while the others do not (a DataError on the master).
    """

    def __init__(self, scaler, ddp: bool, stop=None, device="cpu"):
        self.check_norm, self.ddp, self.stop, self.device = not scaler.is_enabled(), ddp, stop, torch.device(device)
        self.steps = []  # (step, lr, loss, gradient norm) since the last check

    def add(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.steps.append((step, lr, loss.detach(), grad_norm.detach()))

    def check(self, alone: bool = False) -> bool:
        steps, self.steps = self.steps, []
        signalled = self.stop is not None and self.stop.signal is not None
        bad, values = [], []
        if steps:
            values = torch.stack([torch.stack([loss.float(), norm.float()]) for _, _, loss, norm in steps])  # (S, 2)
            values = values.tolist()  # the one wait for the device
            bad = [step for (step, _, _, _), (loss, norm) in zip(steps, values)
                   if not math.isfinite(loss) or (self.check_norm and not math.isfinite(norm))]
        first = bad[0] if bad else NO_STEP
        if self.ddp and not alone:  # every process stops at the same check: the first bad step, or a signal, anywhere
            everywhere = torch.tensor([first, 0 if signalled else 1], device=self.device)
            torch.distributed.all_reduce(everywhere, op=torch.distributed.ReduceOp.MIN)
            first, signalled = int(everywhere[0]), int(everywhere[1]) == 0
        if first == NO_STEP:
            return signalled
        if first not in bad:
            raise Diverged(f"training diverged at step {first} in another process; nothing after it was saved. Try a "
                           f"lower --lr or a longer --warmup, with a new --out_dir")
        (step, lr, _, _), (loss, norm) = next((s, v) for s, v in zip(steps, values) if s[0] == first)
        raise Diverged(f"training diverged at step {step}: loss {loss:.4g}, gradient norm {norm:.4g}, learning rate "
                       f"{lr:.3g}; nothing after it was saved. Try a lower --lr (say {lr / 10:.1g}) or a longer "
                       f"--warmup, with a new --out_dir; in float16, --dtype bfloat16 or float32")


NO_STEP = 2 ** 62  # DivergenceWatch: "no bad step" in the all-reduced minimum


def check_finite_model(model: torch.nn.Module, step: int, lr: float) -> None:
    """Before a model is scored and saved: every weight finite (a last step can make them inf with a finite loss)."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise Diverged(f"training diverged at step {step}: {len(bad)} weights are not finite ({bad[0]}, ...), at "
                       f"learning rate {lr:.3g}; this model was not saved. Try a lower --lr (say {lr / 10:.1g}) or "
                       f"a longer --warmup, with a new --out_dir")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM: the one line to print (what was saved, and the command that resumes; empty on the
    processes that print nothing), and the exit status, the shell's for that signal (128 + its number)."""

    def __init__(self, message: str = "", status: int = 128 + signal.SIGINT):
        super().__init__(message)
        self.status = status


SIGNAL_WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}


def resume_hint(path) -> str:
    """What a stopped run's last checkpoint `path` holds and the command that continues it. The step is read from
    the file itself: the stop may have come between a save and any note of it. mmap reads the one number, not the
    weights."""
    path = Path(path)
    if not path.is_file():
        return "before the first checkpoint: nothing was saved; run the same command again to start over"
    step = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]
    argv = [a for a in sys.argv if a not in ("--resume", "--no-resume")]
    return f"{path} holds step {step}; continue with: {shlex.join(['python', *argv, '--resume'])}"


def interrupted(path, number: int = signal.SIGINT) -> Interrupted:
    """The Interrupted for a run stopped by signal `number` whose last checkpoint is `path`."""
    hint = resume_hint(path)
    return Interrupted(f"{SIGNAL_WORDS.get(number, 'interrupted')}{' ' if hint.startswith('before') else ': '}{hint}",
                       128 + number)


def stopped(stop, path, dist_) -> Interrupted:
    """The end of a run stopped at a step boundary (StopSignals) once the master has saved `path`: every process
    leaves together (under DDP a barrier first), and the master alone says so."""
    if dist_.ddp:
        torch.distributed.barrier()
    number = stop.signal or signal.SIGTERM  # another process's signal: torchrun sends the same to every process
    return interrupted(path, number) if dist_.master else Interrupted("", 128 + number)


def stop_everywhere(stop, dist_) -> bool:
    """Whether some process was sent SIGINT or SIGTERM (StopSignals): under DDP an all-reduce, which every process
    calls at the same point (it serves as the epoch's barrier too)."""
    signalled = stop.signal is not None
    if dist_.ddp:
        flag = torch.tensor([int(signalled)], device=dist_.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        signalled = bool(flag)
    return signalled


class StopSignals:
    """Within the block, SIGINT (Ctrl-C) and SIGTERM (what Slurm sends before preemption; torchrun forwards it to
    every process) are noted in .signal instead of ending the process: the training loop ends the step in progress,
    saves ckpt_last.pt at that step boundary and stops (Interrupted, exit status 130 or 143). Ctrl-\\ (SIGQUIT)
    still ends a process at once. A signal that this process ignores (a background job's SIGINT) stays ignored;
    outside the main thread Python gives no signals, and the block runs as it is."""

    NUMBERS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal, self.previous = None, {}

    def note(self, number, frame) -> None:
        self.signal = self.signal or number

    def now(self, ddp: bool) -> bool:
        """Whether to check at this step boundary for the signal alone: at once in a single process; under DDP it
        waits for the next check (a log step or a save), where all the processes agree without an extra wait."""
        return self.signal is not None and not ddp

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for number in self.NUMBERS:
                if signal.getsignal(number) is not signal.SIG_IGN:
                    self.previous[number] = signal.signal(number, self.note)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader worker's worker_init_fn. A terminal's Ctrl-C reaches every process of the job: a worker ignores
    it (the training process ends its workers itself, once it has saved). SIGTERM (Slurm's, which also reaches
    every process; and the one DataLoader ends its workers with) ends a worker with exit status 0: killed by the
    signal, it would make torch raise "DataLoader worker is killed by signal" in the training process at once,
    inside the step that SIGTERM lets finish. A worker whose training process died exits on its own (DataLoader's
    watchdog)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda number, frame: os._exit(0))


def one_line(error: Exception) -> str:
    """An error's message as one line: a DataError raised in a DataLoader worker arrives wrapped ("Caught DataError
    in DataLoader worker process 0. Original Traceback ..."): its last line holds the original message."""
    text = str(error).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return " ".join(text.split("\n"))


def data_error_stop(error: Exception, save, step: int, watch, path, dist_) -> "data.DataError":
    """A damaged file met by the training loop's DataLoader, before step `step` + 1: the master saves ckpt_last.pt
    (save(), at the last completed step, once the steps since the last check are known to be finite: checked by
    this process alone, the others being inside the step), and the error becomes one line that names the file and
    says what was saved. Under torchrun a process other than the master saves nothing: its line names the file,
    and torchrun ends the others."""
    if dist_.master and step > 0:
        watch.check(alone=True)
        save()
        saved = resume_hint(path)
        saved = f"stopped: {saved}" if not saved.startswith("before") else f"stopped {saved}"
    else:
        saved = "stopped: nothing was saved by this process" if step > 0 else "stopped before the first step"
    return data.DataError(f"{one_line(error)}; {saved}")


def _terminated(number, frame):
    raise Interrupted(SIGNAL_WORDS[signal.SIGTERM], 128 + number)


def run(main, program: str) -> None:
    """Call a script's main(). A USER_ERRORS error ends the process with one line on stderr and exit status 1;
    any other exception (a bug, a shape mismatch inside torch, CUDA out of memory) keeps its traceback. Ctrl-C and
    SIGTERM end it with one line and the shell's status for the signal, 130 or 143 (in the training loop, after a
    save at the step boundary: StopSignals)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)  # outside the training loop SIGTERM ends the run as Ctrl-C does
    try:
        main()
    except USER_ERRORS + (Diverged,) as error:
        print(f"{program}: error: {one_line(error)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as interrupt:  # Ctrl-C: one line, no traceback, and the shell's status for SIGINT
        message = str(interrupt) if isinstance(interrupt, Interrupted) else "interrupted"
        if message:
            print(f"{program}: {message}", file=sys.stderr)
        sys.exit(getattr(interrupt, "status", 128 + signal.SIGINT))


# -----------------------------------------------------------------------------
# Processes and precision


@dataclasses.dataclass
class Distributed:
    ddp: bool            # True under torchrun
    rank: int            # this process's index among all processes
    local_rank: int      # this process's index on this machine (selects its GPU)
    world_size: int      # number of processes
    device: torch.device
    master: bool         # rank 0: the only process that prints, logs and writes checkpoints


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """'auto' is bfloat16 on a GPU that computes it natively (compute capability 8.0 and up: A100, H100, L4, RTX
    30xx), float16 with a GradScaler on older GPUs (V100, T4, P100), float32 on the CPU.

    The capability is asked directly: torch.cuda.is_bf16_supported() also answers True where bfloat16 is only
    emulated (a V100 can hold bf16 tensors but has no bf16 arithmetic: several times slower than float16).
    Any dtype may be asked for on any device, and bfloat16 on an older GPU gets a one-line note: float16 on the
    CPU runs the GPU's fp16 path (autocast and a GradScaler) slowly, which is how the tests exercise it.
    """
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {dtype!r} is not one this project trains in: use auto, float32, bfloat16 or float16")
    if device.type != "cuda":
        return "float32" if dtype == "auto" else dtype
    major, minor = torch.cuda.get_device_capability(device)
    if dtype == "auto":
        return "bfloat16" if major >= 8 else "float16"
    if dtype == "bfloat16" and major < 8 and int(os.environ.get("RANK", 0)) == 0:
        print(f"note: --dtype bfloat16 on {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}), "
              f"which has no bfloat16 arithmetic: torch emulates it, several times slower than float16; --dtype auto "
              f"picks float16 here", file=sys.stderr)
    return dtype


def set_tf32(enabled: bool) -> None:
    """float32 matrix products and convolutions on an NVIDIA GPU (Ampere and later: A100, H100) in TensorFloat-32:
    float32's range with a 10-bit mantissa, about 8 times the IEEE float32 rate on the tensor cores. torch's defaults
    are mixed (TF32 convolutions, IEEE matrix products); this sets both, to TF32 (--tf32, the default) or to IEEE
    float32 (--no-tf32, to compare a run with the CPU's numbers). It changes nothing on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = enabled  # the settings torch 2.5 to 2.13 all read
    torch.backends.cudnn.allow_tf32 = enabled


# How long a process waits in a collective (a barrier) for the others. The master alone draws the synthetic set,
# builds the caches, validates after every epoch and scores the test split while the others wait at a barrier;
# torch's default (10 minutes for NCCL) would end a run whose image cache (CLEVR-Change: 80,000 images decoded)
# or stage 2's feature cache takes longer. A process that truly hangs is still stopped, after this long.
GROUP_TIMEOUT = datetime.timedelta(hours=2)


def loader_workers(num_workers: int, device: torch.device) -> int:
    """--num_workers as the DataLoaders use it: -1 (auto) is, on a GPU, every CPU this process may use less one
    (the training process's own), shared between the processes of this machine (LOCAL_WORLD_SIZE under torchrun):
    a fast GPU eats thousands of pairs a second (BENCHMARKS.md section 8); on the CPU, 4 (a step takes seconds)."""
    if num_workers >= 0:
        return num_workers
    if device.type != "cuda":
        return 4
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, data.usable_cpus() // local_processes - 1)


# -----------------------------------------------------------------------------
# Memory: keep freed blocks in the process

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameters (malloc.h)


def keep_freed_memory(largest_block: int = 32 << 20) -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the kernel.

    By default glibc serves a large block (over a threshold that grows to at most 32 MiB) with a fresh mmap and
    unmaps it when freed. A training step's activations are such blocks, so each step gets new pages, and the
    kernel zeroes and maps every page on first touch: 175,000 page faults and 0.6-0.8 s of system time in a
    6 s ViT-B/32 step on 2 CPU threads, 14% of a synth stage-1 step (BENCHMARKS.md section 3). After this call
    blocks up to largest_block come from the heap and the heap is never trimmed, so a step reuses the pages of
    the step before (0 faults). The price: the process keeps its peak memory until it ends. This is what
    jemalloc or tcmalloc would give, without a dependency. Returns False, doing nothing, off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, largest_block) and libc.mallopt(M_TRIM_THRESHOLD, -1))
    except (OSError, AttributeError):  # not Linux, or a C library without mallopt (musl)
        return False


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
# Checkpoints: one dict, written atomically, read without running code


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: dict, path) -> None:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`.

    A reader, or a run killed at any instant, sees either the old complete file or the new complete file. A Ctrl-C
    during the save takes effect when it is done (torch.save interrupted half-way raises another error instead).
    A full disk (checked before, or met while writing) is data.DiskFull, one line naming the file and the space it
    needs; the temporary file is removed and the previous checkpoint at `path` kept.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    needed = state_bytes(state)
    kept = f" ({path} keeps the previous checkpoint)" if path.exists() else ""
    fix = f"free some space there, then continue with --resume{kept}"
    if shutil.disk_usage(path.parent).free < needed:
        raise data.no_space(path, path.parent, needed, fix)
    with signals_deferred():
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except Exception as error:  # torch.save reports a failed write as a RuntimeError, the OSError its context
            if any(isinstance(e, OSError) and e.errno in data.NO_SPACE for e in _chain(error)):
                tmp.unlink(missing_ok=True)
                raise data.no_space(path, path.parent, needed, fix) from None
            raise
        finally:
            if tmp.exists():
                tmp.unlink()
        _fsync_dir(path.parent)


def _chain(error: BaseException):
    """An exception and those it was raised from or while handling, newest first."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


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


@contextlib.contextmanager
def signals_deferred(numbers=StopSignals.NUMBERS):
    """Ctrl-C or SIGTERM inside the block is noted and handed, when the block ends, to the handler that was there
    before it (KeyboardInterrupt, StopSignals' note, the default action); main thread only: elsewhere Python gives
    no signals, and the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []
    previous = {number: signal.signal(number, lambda number, frame: came.append(number)) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    for number in dict.fromkeys(came):
        handler = previous[number]
        if callable(handler):
            handler(number, None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(number)


def remove_partial_files(folder) -> None:
    """Delete the temporary files (.NAME.tmpPID) that a killed process left behind: never a finished file, nor the
    temporary file of a process still running (another run writing to the same folder)."""
    for partial in Path(folder).glob(".*.tmp*"):
        pid = partial.name.rpartition(".tmp")[2]
        if pid.isdigit() and int(pid) != os.getpid() and data.process_alive(int(pid)):
            continue
        partial.unlink(missing_ok=True)


def check_out_dir(out_dir) -> None:
    """--out_dir must be a folder or not exist yet: an existing file, or a path under one, is refused before any
    work (one line), not after a whole evaluation when its first file is written."""
    out_dir = Path(out_dir)
    for folder in (out_dir, *out_dir.parents):
        if folder.exists() and not folder.is_dir():
            where = "is a file" if folder == out_dir else f"lies under {folder}, which is a file"
            raise ConfigError(f"--out_dir {out_dir} {where}, not a folder: choose another --out_dir")


class OutDirLock:
    """One process at a time writes into an --out_dir: the master of a training run or of an --eval holds an
    exclusive lock on out_dir/.lock, which names it (PID and command); a second run there is refused at once with
    one line naming the first, which goes on untouched (FileExistsError).

    The lock is fcntl's (a POSIX record lock): the kernel drops it when its process ends however it ends, so a
    killed run's lock holds nobody back; and, unlike flock's, it is not inherited by forked processes (DataLoader
    workers, which may outlive a killed master for a few seconds). The file is removed when the run ends; a taker
    that locked a file removed meanwhile takes the new one instead. Under torchrun only the master takes it: the
    others write nothing there. A process not the master (master=False) takes nothing.
    """

    NAME = ".lock"

    def __init__(self, out_dir, master: bool = True):
        self.path, self.master, self.fd = Path(out_dir) / self.NAME, master, None

    def __enter__(self):
        if not self.master:
            return self
        check_out_dir(self.path.parent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise FileExistsError(f"--out_dir {self.path.parent} is in use by {holder}: wait for it to end, or "
                                      f"choose another --out_dir") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
            else:  # the file was removed by the process that held it, after this one opened it: try again
                os.close(fd)
        os.ftruncate(self.fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(self.fd, f"process {os.getpid()} ({shlex.join(['python', *sys.argv])}), since {started}\n"
                  .encode(), 0)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while still locked: a waiting taker sees another file, and retries
            os.close(self.fd)
            self.fd = None


def start_or_resume(path, config, model_keys, dist_, model, optimizer, scaler) -> dict | None:
    """The start of a run whose last checkpoint is `path`: None for a new run; with --resume, the checkpoint,
    after restoring the model, optimizer, scaler and random generators from it.

    The half-written files of a killed save are removed first. A new run never overwrites a finished one, and a
    checkpoint whose model-shaping settings (`model_keys`) differ from this run's is refused.
    """
    path = Path(path)
    if dist_.master:
        remove_partial_files(path.parent)
    if not config.resume:
        if dist_.master and path.exists():
            raise FileExistsError(f"{path} exists: pass --resume to continue that run, or choose another --out_dir")
        if dist_.master:  # a run stopped before its first checkpoint left a log of steps that this run repeats
            (path.parent / LOG_NAME).unlink(missing_ok=True)
        return None
    state = load_checkpoint(path)
    check_config(state["config"], dataclasses.asdict(config), model_keys, path)
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
    return state


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
    again costs about 0.3 s per GB from the page cache (BENCHMARKS.md section 9)."""
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


def load_encoder(path, intra_layers: int = 9) -> tuple[PairEncoder, dict]:
    """A stage-1 pair encoder in eval mode, and what else its file holds: adapt.py's checkpoint, or a CLIP4IDC
    release file of either stage (its clip.* is the adapted encoder; its vocabulary is OpenAI's, bpe_path None).

    intra_layers: a release's split point, which its file does not hold (the reference's --intra_num_hidden_layers,
    9 in all its scripts); adapt.py's checkpoints record their own.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no stage-1 checkpoint at {path}: run adapt.py for this dataset first "
                                f"(python adapt.py --data ...), or pass --encoder_ckpt")
    state = load_checkpoint(path, required=("model",), release=True)
    release = release_stage(state) is not None
    if not release and "encoder_sha256" in state:
        raise ConfigError(f"{path} is a captioner (caption.py's stage-2 checkpoint), not a stage-1 encoder: "
                          f"--encoder_ckpt takes adapt.py's checkpoint (runs/adapt_<data>/ckpt_best.pt) or a CLIP4IDC "
                          f"release; a captioner is given with --checkpoint")
    missing = [k for k in ("clip_config", "encoder_config") if not release and k not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}: expected a checkpoint of this project, or {RELEASE}")
    if release:
        blocks = len({k.split(".")[4] for k in state if k.startswith("clip.visual.transformer.resblocks.")})
        if not 0 < intra_layers <= blocks:
            raise ConfigError(f"--intra_layers {intra_layers}: {path} has {blocks} vision blocks, so it must be in "
                              f"[1, {blocks}] (the reference's split point is 9)")
        model = release_encoder(state, EncoderConfig(intra_layers))
        return model, {"clip_config": dataclasses.asdict(model.clip.config), "bpe_path": None, "release": True}
    return encoder_from_state(state), state


def encoder_from_state(state: dict) -> PairEncoder:
    """A pair encoder in eval mode, rebuilt from the sizes a checkpoint records (clip_config, encoder_config) and
    its weights ("model"; without them the weights are random, for a captioner that holds its encoder's)."""
    model = PairEncoder(clip.CLIP(clip.CLIPConfig(**state["clip_config"])), EncoderConfig(**state["encoder_config"]))
    if "model" in state:
        model.load_state_dict(state["model"])
    return model.eval()


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
    return clip.get_tokenizer(None)


def save_json(obj, path) -> None:
    """Atomic JSON write (the resolved config, predictions, score tables)."""
    write_text_atomically(json.dumps(obj, indent=2) + "\n", path)


def write_text_atomically(text: str, path) -> None:
    """text to a temporary file beside path, then renamed over it: a reader sees the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# -----------------------------------------------------------------------------
# Data order that survives a restart


class SkipSampler(torch.utils.data.Sampler):
    """The indices of `sampler` after the first `skip`: resumes an epoch part-way through.

    With a DistributedSampler (deterministic for a seed and `set_epoch`), the resumed epoch visits exactly
    the samples the interrupted one had not reached yet, without loading the skipped ones.
    """

    def __init__(self, sampler, skip: int = 0):
        self.sampler, self.skip = sampler, skip

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.skip)


def batch_plan(dataset, batch_size: int, grad_accum: int, dist_, seed: int, what: str = "training samples"):
    """Split a global batch over processes and accumulation steps: (micro-batch size, sampler, steps per epoch).

    The sampler is a DistributedSampler (shuffled, same order on every process for a seed and epoch)."""
    per_step = dist_.world_size * grad_accum  # micro-batches per optimizer step, over all processes
    if batch_size % per_step:
        raise ConfigError(f"--batch_size {batch_size} is not divisible by processes x grad_accum = {per_step}")
    micro = batch_size // per_step
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=dist_.world_size, rank=dist_.rank,
                                                  shuffle=True, seed=seed, drop_last=True)
    steps_per_epoch = len(sampler) // (micro * grad_accum)
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(dataset)} {what} are fewer than one global batch of {batch_size}")
    return micro, sampler, steps_per_epoch


def training_loader(dataset, sampler, micro: int, num_workers: int, device: torch.device, collate):
    """The run's DataLoader of micro-batches, made once: its worker processes persist from epoch to epoch (each
    epoch's epoch_batches sets the sampler's epoch and skip), and on CUDA its batches are pinned, so that
    data.to_device copies them without the host waiting. collate: the stage's data.collate_* function."""
    return torch.utils.data.DataLoader(dataset, batch_size=micro, drop_last=True, num_workers=num_workers,
                                       sampler=SkipSampler(sampler), collate_fn=collate,
                                       pin_memory=device.type == "cuda", persistent_workers=num_workers > 0,
                                       prefetch_factor=4 if num_workers > 0 else None,
                                       worker_init_fn=ignore_stop_signals if num_workers > 0 else None)


def epoch_batches(loader, epoch: int, done_steps: int, grad_accum: int):
    """An iterator over one epoch's micro-batches of a training_loader, skipping the first `done_steps` optimizer
    steps (resuming).

    A new iterator draws a number from its DataLoader's generator, the global one (the base seed of its workers):
    an uninterrupted run draws it at the start of every epoch with num_workers 0, and once, at its first epoch,
    with persistent workers. A resumed run draws it from the global generator exactly there too, and elsewhere
    (part-way through an epoch, whose draw came before the checkpoint) from a generator of its own, seeded by the
    sampler's seed, the epoch and the step: the global generator, restored from the checkpoint, then goes on as in
    the uninterrupted run. With num_workers 0 the samples' random choices (stage 1's distractor swap, stage 2's
    caption) and dropout draw from it, in the training process, and a resumed run is the uninterrupted run to the
    byte. With num_workers > 0 each worker draws from a generator seeded when it starts: a resumed run's workers
    start afresh, so its swaps and captions differ from the uninterrupted run's after the checkpoint (making them
    the same would need a generator per sample, which would change the numbers of every num_workers 0 run).
    """
    sampler = loader.sampler.sampler
    sampler.set_epoch(epoch)
    loader.sampler.skip = done_steps * loader.batch_size * grad_accum
    if done_steps == 0 and (loader.num_workers == 0 or epoch == 0):
        return iter(loader)  # the draw of an uninterrupted run
    own = torch.Generator().manual_seed(((sampler.seed * 1_000_003 + epoch) * 1_000_003 + done_steps) % 2 ** 63)
    loader.generator = own
    try:
        return iter(loader)
    finally:
        loader.generator = None


# -----------------------------------------------------------------------------
# Progress line and log


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    """'step 120/600 | loss 2.31 | 310 ms/step | eta 2m28s', timed from this process's first step."""

    def __init__(self, total_steps: int, first_step: int = 0):
        self.total, self.first = total_steps, first_step
        self.start = time.time()

    def line(self, step: int, **values) -> str:
        done = step - self.first
        per_step = (time.time() - self.start) / done if done > 0 else float("nan")
        parts = [f"step {step}/{self.total}"]
        for key, value in values.items():
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        parts.append(f"{per_step * 1000:.0f} ms/step" if done > 0 else "-- ms/step")
        parts.append(f"eta {_duration((self.total - step) * per_step)}")
        return " | ".join(parts)


LOG_NAME = "log.jsonl"  # a run's JsonlLog, beside its checkpoints


def trim_log(path, step: int) -> None:
    """Keep the records of a log up to `step`, the step of the checkpoint a run resumes from: the steps after it
    and the test scores are written again by the resumed run (atomically, as save_json)."""
    path = Path(path)
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines(keepends=True) if line.strip()]
    records = [json.loads(line) for line in lines]
    write_text_atomically("".join(line for line, record in zip(lines, records)
                                  if record.get("step", 0) <= step and record.get("split") != "test"), path)


class JsonlLog:
    """Appends one JSON object per line (the master process only); appending keeps a resumed run's history, which
    start_or_resume first cuts at its checkpoint's step (trim_log), so that the log holds each step once."""

    def __init__(self, path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, **record) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")


# -----------------------------------------------------------------------------
# A training run, and what its loop does between two optimizer steps


@dataclasses.dataclass
class Run:
    """What a training script has set up before it reads data or builds a model, passed on as one: its settings,
    this process, the precision and where it writes."""
    config: typing.Any            # the script's Config
    dist_: Distributed            # this process: one of torchrun's, or the only one
    dtype: str                    # what autocast computes in: float32 (no autocast), bfloat16 or float16
    ctx: typing.Any               # the forward pass's precision: torch.autocast, or nullcontext() in float32
    scaler: torch.amp.GradScaler  # float16's loss scale (disabled in float32 and bfloat16)
    out_dir: Path                 # checkpoints, the log and the scores


class StepBoundary:
    """What the training loops of stages 0, 1 and 2 do between two optimizer steps and at an epoch's end: the check
    that the run has not diverged, Ctrl-C and SIGTERM, the progress line and the log, ckpt_last.pt between epochs.

    Within `with StepBoundary(run, steps_per_epoch, total_steps, first_step, save) as boundary:` Ctrl-C and SIGTERM
    are noted (StopSignals) instead of ending the process. After each optimizer step the loop calls

        if boundary.after_step(step, lr, loss, grad_norm):  # True on the master's log steps
            ...                   # the loop's .item()s, its progress line (boundary.line) and boundary.log.write
        boundary.save_or_stop()

    after_step keeps the step's loss and gradient norm as tensors (DivergenceWatch); it reads them, the one wait
    for the device, only on a check step: a log step (every log_every, and the last), a save step (every
    save_every, but not an epoch's last, whose checkpoint the epoch's end writes), and, in a single process, the
    step a signal came (under DDP the next check step, where every process meets the same all-reduce). A diverged
    run stops there (Diverged). save_or_stop then saves ckpt_last.pt on the master, on a save step or for a signal,
    and for a signal stops every process (Interrupted: exit status 130 or 143). A signal on an epoch's last step
    waits for the epoch's end, which the loop writes as

        boundary.end_epoch()          # the epoch's last check, before the master validates and saves
        ...                           # validation, ckpt_best.pt and ckpt_last.pt
        boundary.stop_if_signalled()  # a signal in any process stops them all (under DDP the epoch's barrier)

    and a damaged image met while reading a batch as `raise boundary.damaged(error, step) from None`.
    save(path) writes the loop's checkpoint, at the step it has reached, to path. boundary.log is the run's
    out_dir/log.jsonl (written by the master alone): the log steps and every epoch's validation scores.
    """

    def __init__(self, run: Run, steps_per_epoch: int, total_steps: int, first_step: int, save):
        self.run, self.steps_per_epoch, self.total_steps = run, steps_per_epoch, total_steps
        self.first_step = first_step
        self.save, self.path = save, Path(run.out_dir) / "ckpt_last.pt"
        self.log = JsonlLog(Path(run.out_dir) / LOG_NAME, enabled=run.dist_.master)
        self.stop = StopSignals()
        self.watch = DivergenceWatch(run.scaler, run.dist_.ddp, self.stop, run.dist_.device)
        self.saving = self.stopping = False

    def __enter__(self):
        self.stop.__enter__()
        self.progress = Progress(self.total_steps, first_step=self.first_step)  # timed from the first step on
        return self

    def __exit__(self, *exc) -> None:
        self.stop.__exit__(*exc)

    def after_step(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Keep the step's loss and gradient norm; on a check step read them, and note whether to save or stop.
        Whether the master logs this step."""
        config, dist_ = self.run.config, self.run.dist_
        self.watch.add(step, lr, loss, grad_norm)
        logging = step % config.log_every == 0 or step == self.total_steps
        self.saving = step % config.save_every == 0 and step % self.steps_per_epoch != 0
        self.stopping = False
        if logging or self.saving or self.stop.now(dist_.ddp):
            # stops a diverged run (the one wait for the device, with the loop's .item()s); a signal stops the run
            # here, or at the epoch's end when this is its last step
            self.stopping = self.watch.check() and step % self.steps_per_epoch != 0
        return dist_.master and logging

    def line(self, step: int, **values) -> str:
        """The progress line of a log step: 'step 120/600 | loss 2.31 | 310 ms/step | eta 2m28s'."""
        return self.progress.line(step, **values)

    def save_or_stop(self) -> None:
        """ckpt_last.pt on a save step; for a signal, ckpt_last.pt and then every process stops."""
        if self.run.dist_.master and (self.saving or self.stopping):
            self.save(self.path)
        if self.stopping:
            raise stopped(self.stop, self.path, self.run.dist_)

    def end_epoch(self) -> None:
        """The check of the epoch's last steps, before the master scores and saves the model."""
        self.watch.check()

    def stop_if_signalled(self) -> None:
        """After the epoch's checkpoints: stop every process if any was sent Ctrl-C or SIGTERM."""
        if stop_everywhere(self.stop, self.run.dist_):
            raise stopped(self.stop, self.path, self.run.dist_)

    def damaged(self, error: Exception, step: int) -> data.DataError:
        """A damaged file met while reading the batches of step + 1: ckpt_last.pt at `step` (the master), then the
        error in one line (data_error_stop)."""
        return data_error_stop(error, lambda: self.save(self.path), step, self.watch, self.path, self.run.dist_)


if __name__ == "__main__":
    @dataclasses.dataclass
    class DemoConfig:
        data: str = "synth"   # which dataset preset
        lr: float = 1e-4      # peak learning rate
        epochs: int = 12      # passes over the training set
        amp: bool = False     # use mixed precision
    config = parse_config(DemoConfig, {"synth": {"epochs": 3}, "clevr": {}}, sys.argv[1:])
    print(config)
    progress = Progress(total_steps=100)
    time.sleep(0.05)
    print(progress.line(10, loss=2.3125, lr=1e-4))
