"""Stopping: how a training run ends early, and what it says then, in one line.

- `run_main`: a script's main(), with the errors a user can fix (`USER_ERRORS`: a missing or bad file, a bad setting,
  bad data, a full disk), a diverged run and Ctrl-C printed as one line; any other exception, a bug or an
  out-of-memory, keeps its traceback.
- `DivergenceWatch`, `check_finite_model`: a diverged run (Diverged) stops at the next log step, naming the step
  where it diverged, without a wait for the GPU in every step; a model whose weights are not finite is never saved.
- `StopSignals`, `stopped`, `stop_everywhere`: Ctrl-C, SIGTERM, SIGHUP (a closed terminal or ssh session) and
  SIGUSR1 (a scheduler's "checkpoint now") end the step in progress, the master saves ckpt_last.pt and the run stops
  in one line (exit status 130, 143, 129, 138) with the command that resumes it (`resume_hint`, keeping torchrun:
  `launch_command`), every process at the same check under torchrun.
- `write_with_replacement`, `permission_line`: a terminal that cannot show a character, and a folder this user
  cannot write, never end a run with a traceback.
- `data_error_stop`: a damaged image met in training saves the last step, then stops in one line naming it;
  `LoaderError`, `loader_failure`: DataLoader workers that die or cannot start, the same way, naming the cause and
  the fix (--num_workers 0, ulimit -n, --shm-size); `hand_over_failure`: a batch a worker cannot hand over is an
  error, not a wait for ever.
- `KeptStream`: stdout or stderr going away (`| head`, `> /dev/full`) never ends a run.
"""
import errno
import math
import multiprocessing.queues
import os
import resource
import shlex
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path

import torch
from torch._utils import ExceptionWrapper  # what a DataLoader worker sends in place of a batch it failed to make

from plumbing import clip_files
import data
from plumbing.checkpoints import CheckpointError
from plumbing.files import STOP_SIGNALS, DiskFull, Unwritable, size_text
from plumbing.flags import ConfigError

# -----------------------------------------------------------------------------
# A diverged run


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


# -----------------------------------------------------------------------------
# Ctrl-C, SIGTERM and bad data: stop at a step boundary, say how to go on


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM: the one line to print (what was saved, and the command that resumes; empty on the
    processes that print nothing), and the exit status, the shell's for that signal (128 + its number)."""

    def __init__(self, message: str = "", status: int = 128 + signal.SIGINT):
        super().__init__(message)
        self.status = status


SIGNAL_WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)",
                signal.SIGHUP: "hung up (SIGHUP: its terminal or ssh session closed)",
                signal.SIGUSR1: "stopped by SIGUSR1 (a scheduler's notice before the job's end, Slurm's --signal)"}


def leave_closed_terminal(number) -> None:
    """After SIGHUP the terminal is gone and a write to it fails (EIO): what the run still prints, and its last
    line, go nowhere instead of ending it before its save. Output redirected to a file keeps going there."""
    if number != signal.SIGHUP:
        return
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            closed = stream is not None and stream.isatty()
        except (ValueError, OSError):
            closed = True
        if closed:
            setattr(sys, name, open(os.devnull, "w"))


def launch_command() -> list[str]:
    """The command that started this run, as a user types it: `python <script> <flags>`, or under torchrun its
    agent's command line (this process's parent: `torchrun --standalone --nproc_per_node=2 adapt.py ...`), so that
    a hint to continue keeps the launcher. Where the agent's command line cannot be read (no /proc), torchrun with
    this machine's process count and the script's flags."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ["python", *sys.argv]
    try:
        agent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        agent = []
    if agent[1:3] == ["-m", "torch.distributed.run"]:
        return ["python", *agent[1:]]
    if len(agent) > 1 and Path(agent[1]).name == "torchrun":
        return ["torchrun", *agent[2:]]
    if agent and Path(agent[0]).name == "torchrun":
        return ["torchrun", *agent[1:]]
    return ["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', 1)}", *sys.argv]


def command_with(*flags: str) -> str:
    """The launch command with its --resume (or --resume auto, --no-resume) replaced by `flags`."""
    command, kept, skip = launch_command(), [], False
    for word in command:
        if skip and word == "auto":  # --resume auto
            continue
        skip = word == "--resume"
        if word not in ("--resume", "--no-resume") and not word.startswith("--resume="):
            kept.append(word)
    return shlex.join([*kept, *flags])


def resume_hint(path) -> str:
    """What a stopped run's last checkpoint `path` holds and the command that continues it. The step is read from
    the file itself: the stop may have come between a save and any note of it. mmap reads the one number, not the
    weights. A checkpoint saved at an epoch's end before its validation (StepBoundary.end_epoch) says so."""
    path = Path(path)
    if not path.is_file():
        return "before the first checkpoint: nothing was saved; run the same command again to start over"
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    pending = (", the end of an epoch not yet validated (the resumed run validates it first)"
               if state.get("validated") is False else "")
    return f"{path} holds step {state['step']}{pending}; continue with: {command_with('--resume')}"


def interrupted(path, number: int = signal.SIGINT) -> Interrupted:
    """The Interrupted for a run stopped by signal `number` whose last checkpoint is `path`."""
    hint = resume_hint(path)
    return Interrupted(f"{SIGNAL_WORDS.get(number, 'interrupted')}{' ' if hint.startswith('before') else ': '}{hint}",
                       128 + number)


def final_test_stopped(interrupt: KeyboardInterrupt, out_dir) -> Interrupted:
    """A signal during the final test, after the training: what is saved, and the --eval command that scores it."""
    status = getattr(interrupt, "status", 128 + signal.SIGINT)
    return Interrupted(f"{SIGNAL_WORDS.get(status - 128, 'interrupted')} during the final test: the training "
                       f"finished and {Path(out_dir) / 'ckpt_best.pt'} holds its best epoch; score it with: "
                       f"{command_with('--eval')}", status)


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
    saves ckpt_last.pt at that step boundary and stops (Interrupted, exit status 130 or 143). SIGHUP (a closed
    terminal or ssh session) is SIGTERM's twin (exit status 129); under nohup it stays ignored. SIGUSR1 (Slurm's
    --signal=USR1@90, "checkpoint now") too (exit status 138), in one process: torchrun's agent does not forward it
    (it dies of it), so under torchrun send SIGTERM, which it forwards. Ctrl-\\ (SIGQUIT) still ends a process at
    once. A signal that this process ignores (a background job's SIGINT) stays ignored; outside the main thread
    Python gives no signals, and the block runs as it is.

    While .waiting (the loop waits for a batch: StepBoundary.epoch_batches) a signal ends the wait at once
    (WaitInterrupted): no step is in progress, and a batch may never come (a worker that hangs)."""

    NUMBERS = STOP_SIGNALS

    def __init__(self):
        self.signal, self.previous, self.waiting = None, {}, False

    def note(self, number, frame) -> None:
        self.signal = self.signal or number
        leave_closed_terminal(number)
        if self.waiting:
            self.waiting = False
            raise WaitInterrupted("", 128 + number)

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


class WaitInterrupted(Interrupted):
    """A stop signal that came while the training loop waited for a batch (StopSignals.waiting)."""


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader worker's worker_init_fn. A terminal's Ctrl-C reaches every process of the job: a worker ignores
    it (the training process ends its workers itself, once it has saved), and SIGHUP and SIGUSR1 alike. SIGTERM
    (Slurm's, which also reaches every process; and the one DataLoader ends its workers with) ends a worker with exit
    status 0: killed by the signal, it would make torch raise "DataLoader worker is killed by signal" in the training
    process at once, inside the step that SIGTERM lets finish. A worker whose training process died exits on its own
    (DataLoader's watchdog). A batch the worker cannot hand over (no file descriptor left, ulimit -n) is sent as
    its error instead (hand_over_failure), which the training process raises, instead of waiting for ever."""
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):  # the training process decides
        signal.signal(number, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda number, frame: os._exit(0))
    multiprocessing.queues.Queue._on_queue_feeder_error = hand_over_failure  # this worker's queues only


def hand_over_failure(queue, error: Exception, item) -> None:
    """A DataLoader worker's queue could not send `item` (a batch (index, data)) to the training process: its
    feeder thread met `error` while pickling it (EMFILE: torch hands each tensor over as a file descriptor). Python's
    own hook prints the traceback and drops the batch, and the training process would wait for it for ever; this
    sends the error in its place, as the worker sends a dataset's errors, so the training process raises it."""
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)):
        traceback.print_exception(error)  # what the default hook does
        return
    worker = torch.utils.data.get_worker_info()
    where = f"in DataLoader worker process {worker.id if worker else '?'}, handing over a batch"
    queue.put((item[0], ExceptionWrapper((type(error), error, error.__traceback__), where)))


def one_line(error: Exception) -> str:
    """An error's message as one line: a DataError raised in a DataLoader worker arrives wrapped ("Caught DataError
    in DataLoader worker process 0. Original Traceback ..."): its last line holds the original message."""
    text = str(error).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return " ".join(text.split("\n"))


def data_error_stop(error: Exception, save, step: int, watch, path, dist_) -> data.DataError:
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


# -----------------------------------------------------------------------------
# DataLoader workers that die or cannot start


class LoaderError(data.DataError):
    """The DataLoader's worker processes died, or could not start or hand over a batch: the message names the cause
    and the fix. A DataError, so that the training loops save the last step first (StepBoundary.damaged)."""


def loader_failure(error: BaseException, starting: bool = False) -> str | None:
    """The one line for an error of a DataLoader's worker processes (what torch raises in the training process),
    naming the cause and the fix, or None for another error. starting: raised while the workers were started."""
    text = str(error)
    fewer = "--num_workers 0 (the training process reads the data itself)"
    if "Too many open files" in text or getattr(error, "errno", None) in (errno.EMFILE, errno.ENFILE):
        return (f"the DataLoader's worker processes ran out of file descriptors (Too many open files; ulimit -n is "
                f"{open_files_limit()}): torch hands each batch's tensors over as file descriptors. Raise the limit "
                f"(ulimit -n 65536 before the command), or train with {fewer}")
    if ("No space left on device" in text and "/torch_" in text) or "out of shared memory" in text \
            or "shared memory" in text and "Bus error" in text:
        return (f"the DataLoader's worker processes ran out of shared memory (/dev/shm {shared_memory()}), where "
                f"they hand over each batch (Docker gives a container 64 MB): give it more (docker run "
                f"--shm-size=8g ...), or train with {fewer}")
    if "DataLoader worker" in text and ("exited unexpectedly" in text or "killed by signal" in text):
        cause = text.split("DataLoader worker", 1)[1].split(".")[0].strip()
        return (f"a DataLoader worker process died (worker {cause}; the out-of-memory killer ends a process when "
                f"the machine's memory runs out): train with fewer --num_workers, or {fewer}")
    if starting and isinstance(error, OSError):
        return (f"the DataLoader's worker processes could not start ({error.strerror or error}): train with fewer "
                f"--num_workers, or {fewer}, or raise the limit of processes (ulimit -u)")
    return None


def open_files_limit() -> str:
    try:
        return str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (OSError, ValueError):
        return "unknown"


def shared_memory() -> str:
    """'12.0 MB free of 67.1 MB', or why it cannot be told."""
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return "not found"
    return f"{size_text(usage.free)} free of {size_text(usage.total)}"


# -----------------------------------------------------------------------------
# Data a run cannot use


def refuse_empty_splits(splits: dict, names, config) -> None:
    """Before the first step: every split in `names` holds a pair, and the training split a caption to train on
    (data.training_captions); else one line naming the split (an empty split would train a whole epoch, then fail
    where it is scored). config: a script's, its --data and --data_root."""
    data_name, root = config.data, data.dataset_root(config.data, config.data_root or None)
    for name in names:
        pairs = splits[name]
        if not pairs:  # stage 1 reads LEVIR-CC's changed pairs alone (data.adaptation_pairs): say so
            unchanged = sum(p.change_type == data.UNCHANGED for p in data.load_split(data_name, name, root))
            problem = (f"has no changed pairs ({unchanged:,} unchanged, which stage 1 leaves out: their captions "
                       f"tell no pair apart)" if unchanged else "has no pairs")
        elif name == "train" and not any(data.training_captions(p.captions) for p in pairs):
            problem = f"has {len(pairs)} pairs but no caption that is not empty, nothing to train on"
        else:
            continue
        raise data.DataError(f"the {name} split of {data_name} in {root} {problem}: training and evaluation need at "
                             f"least one pair with a caption in every split; add pairs to it (python check.py "
                             f"--data {data_name} --data_root {root} lists what each split holds)")


# -----------------------------------------------------------------------------
# A script's main()


# The errors a user can fix, by the file, flag or data they name: the scripts print these as one line.
USER_ERRORS = (FileNotFoundError, FileExistsError, ConfigError, CheckpointError, data.DataError, clip_files.FileError,
               DiskFull, Unwritable)
GONE = (errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EIO)  # a stream whose reader left: `| head`, `> /dev/full`


def _terminated(number, frame):
    leave_closed_terminal(number)
    raise Interrupted(SIGNAL_WORDS[number], 128 + number)


def permission_line(error: PermissionError) -> str:
    """A permission error no part of the project answered itself, as one line naming the file and its folder."""
    path = Path(error.filename or ".")
    return (f"permission denied: {path} ({error.strerror}); make {path.parent if error.filename else 'it'} readable "
            f"and writable for this user, or point the run elsewhere: --out_dir for its files, --data_root for a "
            f"dataset and its caches, CLIP_CACHE for CLIP's weights")


def write_with_replacement() -> None:
    """stdout and stderr write what their encoding cannot hold (a caption in a Latin-1 or ASCII terminal,
    PYTHONIOENCODING=ascii) as '?' instead of raising UnicodeEncodeError in the middle of a run."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")


class KeptStream:
    """stdout or stderr, whose reader may leave while the run goes on (`python adapt.py ... | head -30`, a full disk
    under `> log.txt`, `> /dev/full`): a write or flush that fails so (GONE) sends the stream to /dev/null, its file
    descriptor too (what is still buffered, and Python's flush at exit, go there), says so once on the other stream,
    and the run goes on: its steps and scores are in its files (log.jsonl). Any other error is raised."""

    def __init__(self, stream, name: str, program: str):
        self.stream, self.name, self.program, self.gone = stream, name, program, False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as error:
            self.leave(error)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as error:
            self.leave(error)

    def leave(self, error: OSError) -> None:
        if error.errno not in GONE:
            raise error
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
            self.stream.flush()  # what was buffered, to /dev/null
        except (OSError, ValueError, AttributeError):
            pass
        if not self.gone:
            self.gone = True
            other = sys.stderr if self.name == "stdout" else sys.stdout
            print(f"{self.program}: note: {self.name} is gone ({error.strerror}): the run goes on without it; its "
                  f"steps and scores are in its files (log.jsonl)", file=other, flush=True)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def run_main(main, program: str) -> None:
    """Call a script's main(). A USER_ERRORS error ends the process with one line on stderr and exit status 1;
    any other exception (a bug, a shape mismatch inside torch, CUDA out of memory) keeps its traceback, but for a
    DataLoader worker that died or could not start (loader_failure: one line naming the cause and the fix).
    Ctrl-C, SIGTERM, SIGHUP and SIGUSR1 end it with one line and the shell's status for the signal, 130, 143, 129,
    138 (in the training loop, after a save at the step boundary: StopSignals). A permission error is one line too.
    stdout or stderr going away never ends the run (KeptStream)."""
    write_with_replacement()
    kept = {name: KeptStream(getattr(sys, name), name, program) for name in ("stdout", "stderr")}
    for name, stream in kept.items():
        setattr(sys, name, stream)
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):  # outside the training loop: as Ctrl-C does
        if threading.current_thread() is threading.main_thread() and signal.getsignal(number) is signal.SIG_DFL:
            signal.signal(number, _terminated)
    try:
        main()
    except USER_ERRORS + (Diverged,) as error:
        print(f"{program}: error: {one_line(error)}", file=sys.stderr)
        sys.exit(1)
    except PermissionError as error:
        print(f"{program}: error: {permission_line(error)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as interrupt:  # Ctrl-C: one line, no traceback, and the shell's status for SIGINT
        message = str(interrupt) if isinstance(interrupt, Interrupted) else "interrupted"
        if message:
            print(f"{program}: {message}", file=sys.stderr)
        sys.exit(getattr(interrupt, "status", 128 + signal.SIGINT))
    except (RuntimeError, OSError) as error:
        line = loader_failure(error)
        if line is None:
            raise
        print(f"{program}: error: {line}", file=sys.stderr)
        sys.exit(1)
    finally:
        for name, stream in kept.items():  # a caller's own streams back (a test's), unless replaced meanwhile
            if getattr(sys, name) is stream:
                setattr(sys, name, stream.stream)
