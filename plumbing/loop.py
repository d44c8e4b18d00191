"""A training run: its set-up and end (`started`, `Run`), and what its loop does between two optimizer steps.

adapt.py and caption.py each write their loop out, nanoGPT's way (stage 0, pretrain.py, runs through adapt.py's);
what happens after each step is the same in both and lives here, once (StepBoundary): the check that the run has
not diverged (without a wait for the device in every step), Ctrl-C and SIGTERM at a step boundary, the progress line
and the JSON-lines log, and ckpt_last.pt between epochs. `Run` is what a script has set up before it reads data or
builds a model, passed on as one object; `started` sets it up (processes, precision, seed, the out_dir's lock) and
ends it (the process group left together).
"""
import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import data
from plumbing.checkpoints import BackgroundWriter, seed_everything
from plumbing.files import OutDirLock, check_out_dir, save_json
from plumbing.processes import Distributed, keep_freed_memory, loader_workers, setup
from plumbing.progress import LOG_NAME, JsonlLog, Progress
from plumbing.stopping import DivergenceWatch, StopSignals, data_error_stop, stop_everywhere, stopped


@dataclasses.dataclass
class Run:
    """What a training script has set up before it reads data or builds a model, passed on as one: its settings,
    this process, the precision and where it writes."""
    config: Any                   # the script's Config
    dist_: Distributed            # this process: one of torchrun's, or the only one
    dtype: str                    # what autocast computes in: float32 (no autocast), bfloat16 or float16
    ctx: Any                      # the forward pass's precision: torch.autocast, or nullcontext() in float32
    scaler: torch.amp.GradScaler  # float16's loss scale (disabled in float32 and bfloat16)
    out_dir: Path                 # checkpoints, the log and the scores


@contextlib.contextmanager
def started(config, out_dir: Path, lock: bool = True):
    """A training script's set-up, nanoGPT's order, and its end; yields the Run.

    The out_dir checked (a file there is refused before any work); glibc asked to keep freed memory (a CPU step then
    reuses its pages); this process set up (DDP from torchrun's environment, the device, autocast and GradScaler:
    processes.setup); --num_workers -1 resolved; the seed, plus the rank; then, with lock, one run at a time writes
    into out_dir (OutDirLock, the master's). At the end every process meets the others before the group is torn
    down (a gloo peer may abort otherwise)."""
    if lock:
        check_out_dir(out_dir)
    keep_freed_memory()
    dist_, dtype, ctx, scaler = setup(config)
    config = dataclasses.replace(config, num_workers=loader_workers(config.num_workers, dist_.device))
    seed_everything(config.seed + dist_.rank)
    with OutDirLock(out_dir, dist_.master) if lock else contextlib.nullcontext():
        yield Run(config, dist_, dtype, ctx, scaler, Path(out_dir))
    if dist_.ddp:
        dist.barrier()
        dist.destroy_process_group()


def say(run: Run, line: str) -> None:
    """Print a line on the master only."""
    if run.dist_.master:
        print(line, flush=True)


def announce(run: Run, line: str) -> None:
    """At a training run's start, on the master: the resolved config, printed and saved as out_dir/config.json,
    then a line that describes the run."""
    if run.dist_.master:
        save_json(dataclasses.asdict(run.config), run.out_dir / "config.json")
        print(json.dumps(dataclasses.asdict(run.config)))
        print(line)


class StepBoundary:
    """What the training loops of stages 0, 1 and 2 do between two optimizer steps and at an epoch's end: the check
    that the run has not diverged, Ctrl-C and SIGTERM, the progress line and the log, ckpt_last.pt between epochs.

    Within `with StepBoundary(run, steps_per_epoch, total_steps, first_step, state) as boundary:` Ctrl-C and SIGTERM
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
        ...                           # validation; boundary.save(ckpt_best.pt if better, ckpt_last.pt)
        boundary.stop_if_signalled()  # a signal in any process stops them all (under DDP the epoch's barrier)

    and a damaged image met while reading a batch as `raise boundary.damaged(error, step) from None`.
    state(path) is the loop's checkpoint, at the step it has reached, for that path; boundary.save writes it on a
    thread of its own (the with-block ends once every file is on disk). boundary.log is the run's
    out_dir/log.jsonl (written by the master alone): the log steps and every epoch's validation scores.
    """

    def __init__(self, run: Run, steps_per_epoch: int, total_steps: int, first_step: int, state):
        self.run, self.steps_per_epoch, self.total_steps = run, steps_per_epoch, total_steps
        self.first_step = first_step
        self.state, self.path = state, Path(run.out_dir) / "ckpt_last.pt"
        self.writer = BackgroundWriter()
        self.log = JsonlLog(Path(run.out_dir) / LOG_NAME, enabled=run.dist_.master)
        self.stop = StopSignals()
        self.watch = DivergenceWatch(run.scaler, run.dist_.ddp, self.stop, run.dist_.device)
        self.saving = self.stopping = False

    def __enter__(self):
        self.stop.__enter__()
        self.progress = Progress(self.total_steps, first_step=self.first_step)  # timed from the first step on
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.writer.wait()  # every checkpoint on disk before the run reads one back (its test) or ends
        except Exception:
            if exc[0] is None:  # a failed write (a full disk) is the run's error, unless another came first
                raise
        finally:
            self.stop.__exit__(*exc)

    def save(self, *paths: Path, wait: bool = False) -> None:
        """The checkpoint at the step the loop has reached, to each path: copied to the host at once, written on
        the writer's thread (BackgroundWriter) while training goes on; wait: until it is on disk."""
        self.writer.write([(self.state(path), path) for path in paths])
        if wait:
            self.writer.wait()

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
            self.save(self.path, wait=self.stopping)  # a stopping run says "saved" once it is on disk
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
        return data_error_stop(error, lambda: self.save(self.path, wait=True), step, self.watch, self.path,
                               self.run.dist_)
