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
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import data
from plumbing.checkpoints import BackgroundWriter, seed_everything
from plumbing.files import OutDirLock, check_out_dir, save_json
from plumbing import batches
from plumbing.processes import Distributed, from_master, keep_freed_memory, loader_workers, setup
from plumbing.progress import LOG_NAME, JsonlLog, Progress
from plumbing.stopping import (DivergenceWatch, Interrupted, StopSignals, WaitInterrupted, check_finite_model,
                               command_with, data_error_stop, interrupted, one_line, resume_hint, stop_everywhere,
                               stopped)


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
        if getattr(config, "resume", False) == "auto":  # once the lock is taken: no other run writes there now
            config = dataclasses.replace(config, resume=resume_auto(Path(out_dir), dist_))
        yield Run(config, dist_, dtype, ctx, scaler, Path(out_dir))
    if dist_.ddp:
        dist.barrier()
        dist.destroy_process_group()


def resume_auto(out_dir: Path, dist_) -> bool:
    """--resume auto: continue out_dir/ckpt_last.pt when the master finds it there, else start afresh, so that one
    command serves a job's first start and its requeue (Slurm's, torchrun's --max-restarts)."""
    return bool(from_master(int((out_dir / "ckpt_last.pt").is_file()), dist_))


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
    (and SIGHUP, SIGUSR1) are noted (StopSignals) instead of ending the process. The loop reads where it is and its
    batches from it, and after each optimizer step calls

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

        boundary.end_epoch(model)     # the epoch's last check, its weights finite, ckpt_last.pt (not yet validated)
        ...                           # validation; boundary.save(ckpt_best.pt if better, ckpt_last.pt)
        boundary.stop_if_signalled()  # a signal in any process stops them all (under DDP the epoch's barrier)

    end_epoch saves the epoch's steps before the master validates: a validation that fails (an image gone from a
    stale mount: one line saying what is saved) or is killed loses no step, and a signal there stops before the
    validation; the resumed run validates that epoch first (position, pending_validation). A damaged image met
    while reading a batch is `raise boundary.damaged(error, step) from None`; a signal while the loop waits for a
    batch (epoch_batches) saves the last step and stops at once.
    state(path) is the loop's checkpoint, at the step it has reached, for that path; boundary.save writes it on a
    thread of its own (the with-block ends once every file is on disk; every stop says what is on disk once it is
    there). boundary.log is the run's out_dir/log.jsonl (written by the master alone): the log steps and every
    epoch's validation scores. An out_dir deleted during the run is found at the next log step or save: the model
    in memory is saved there again and the run stops in one line (out_dir_lost).
    """

    def __init__(self, run: Run, steps_per_epoch: int, total_steps: int, first_step: int, state):
        self.run, self.steps_per_epoch, self.total_steps = run, steps_per_epoch, total_steps
        self.first_step = first_step
        self.state, self.path = state, Path(run.out_dir) / "ckpt_last.pt"
        self.writer = BackgroundWriter()
        self.log = JsonlLog(Path(run.out_dir) / LOG_NAME, enabled=run.dist_.master)
        self.folder = os.stat(run.out_dir).st_ino if run.dist_.master else None  # the out_dir this run writes
        self.stop = StopSignals()
        self.watch = DivergenceWatch(run.scaler, run.dist_.ddp, self.stop, run.dist_.device)
        self.saving = self.stopping = self.validating = self.unsaved = False
        self.step, self.lr = first_step, None  # the last step, and its learning rate
        self.pending_validation = self.resumed_before_validation()

    def __enter__(self):
        self.stop.__enter__()
        self.progress = Progress(self.total_steps, first_step=self.first_step)  # timed from the first step on
        return self

    def __exit__(self, kind, error, trace) -> None:
        try:
            if isinstance(error, WaitInterrupted):  # a signal while the loop waited for a batch: save, then stop
                raise self.stopped_waiting(error.status - 128) from None
            if isinstance(error, data.DataError) and self.validating:  # met while the master validated
                raise self.validation_failed(error) from None
            try:
                self.writer.wait()  # every checkpoint on disk before the run reads one back (its test) or ends
            except Exception:
                if error is None:  # a failed write (a full disk) is the run's error, unless another came first
                    raise
        finally:
            self.stop.__exit__(kind, error, trace)

    # --- where the loop is, and its batches

    def resumed_before_validation(self) -> bool:
        """Whether this run resumes from end_epoch's checkpoint, an epoch's end not yet validated. Every process
        reads ckpt_last.pt to resume, so each reads its mark (mmap: not the weights)."""
        if not (getattr(self.run.config, "resume", False) and self.first_step > 0
                and self.first_step % self.steps_per_epoch == 0 and self.path.is_file()):
            return False
        return torch.load(self.path, map_location="cpu", weights_only=True, mmap=True).get("validated") is False

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, optimizer steps done in it) at `step`: steps done > 0 when a run resumes part-way through an
        epoch; all of them when it resumes before an epoch's validation (pending_validation), which the loop then
        does first."""
        if self.pending_validation:
            self.pending_validation = False
            return step // self.steps_per_epoch - 1, self.steps_per_epoch
        return step // self.steps_per_epoch, step % self.steps_per_epoch

    def epoch_batches(self, loader, epoch: int, done_steps: int, grad_accum: int):
        """The epoch's micro-batches (batches.epoch_batches), where a signal while the loop waits for one stops the
        run at once, its last step saved."""
        return batches.epoch_batches(loader, epoch, done_steps, grad_accum, stop=self.stop)

    # --- after each step

    def save(self, *paths: Path, wait: bool = False, validated: bool = True) -> None:
        """The checkpoint at the step the loop has reached, to each path: copied to the host at once, written on
        the writer's thread (BackgroundWriter) while training goes on; wait: until it is on disk. validated=False:
        end_epoch's, marked so (a run resumed from it validates that epoch first). An out_dir deleted meanwhile is
        out_dir_lost."""
        if self.run.dist_.master and self.folder_lost():
            raise self.out_dir_lost()
        mark = {} if validated else {"validated": False}
        self.writer.write([({**self.state(path), **mark}, path) for path in paths])
        self.unsaved, self.validating = False, not validated
        if wait:
            self.writer.wait()

    def after_step(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Keep the step's loss and gradient norm; on a check step read them, and note whether to save or stop.
        Whether the master logs this step."""
        config, dist_ = self.run.config, self.run.dist_
        self.watch.add(step, lr, loss, grad_norm)
        self.step, self.lr, self.unsaved, self.validating = step, lr, True, False
        logging = step % config.log_every == 0 or step == self.total_steps
        self.saving = step % config.save_every == 0 and step % self.steps_per_epoch != 0
        self.stopping = False
        if logging or self.saving or self.stop.now(dist_.ddp):
            # stops a diverged run (the one wait for the device, with the loop's .item()s); a signal stops the run
            # here, or at the epoch's end when this is its last step
            self.stopping = self.watch.check() and step % self.steps_per_epoch != 0
            if dist_.master and self.folder_lost():  # before the loop's log line, which would make it again
                raise self.out_dir_lost()
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

    # --- an epoch's end

    def end_epoch(self, model: torch.nn.Module) -> None:
        """The epoch's end, before the master validates `model`: the check of its last steps, every weight finite
        (a non-finite model is never scored nor saved), then ckpt_last.pt, marked not yet validated, so that a
        validation that fails or is killed loses no step. A signal in any process stops every one here, once it is
        on disk."""
        signalled, dist_ = self.watch.check(), self.run.dist_
        if dist_.master and self.unsaved:
            check_finite_model(model, self.step, self.lr)
            self.save(self.path, wait=signalled, validated=False)
        self.validating = True
        if signalled:
            if dist_.master:
                self.writer.wait()
            raise stopped(self.stop, self.path, dist_)

    def stop_if_signalled(self) -> None:
        """After the epoch's checkpoints: stop every process if any was sent Ctrl-C or SIGTERM, saying what is on
        disk once the writer is done with it."""
        if stop_everywhere(self.stop, self.run.dist_):
            if self.run.dist_.master:
                self.writer.wait()
            raise stopped(self.stop, self.path, self.run.dist_)

    # --- the stops that are not a signal at a step boundary

    def damaged(self, error: Exception, step: int) -> data.DataError:
        """A damaged file met while reading the batches of step + 1 (or DataLoader workers that failed: a
        stopping.LoaderError): ckpt_last.pt at `step` (the master), then the error in one line (data_error_stop)."""
        return data_error_stop(error, lambda: self.save(self.path, wait=True), step, self.watch, self.path,
                               self.run.dist_)

    def stopped_waiting(self, number: int) -> Interrupted:
        """A signal while the loop waited for a batch: no step is in progress; the master saves the last one (once
        the steps since the last check are known to be finite), and the run stops as at a step boundary."""
        if not self.run.dist_.master:
            return Interrupted("", 128 + number)
        if self.unsaved:
            self.watch.check(alone=True)
            self.save(self.path, wait=True)
        self.writer.wait()
        return interrupted(self.path, number)

    def validation_failed(self, error: data.DataError) -> data.DataError:
        """A DataError met while the master validated (an image gone unreadable): the epoch's steps were saved
        before (end_epoch); one line naming the file and what is on disk."""
        self.writer.wait()
        return data.DataError(f"{one_line(error)}; stopped while validating: {resume_hint(self.path)}")

    def folder_lost(self) -> bool:
        """Whether this run's out_dir was deleted (or replaced) since the run began."""
        try:
            return os.stat(self.run.out_dir).st_ino != self.folder
        except FileNotFoundError:
            return True

    def out_dir_lost(self) -> FileNotFoundError:
        """The out_dir was deleted during the run, its checkpoints and log with it: the model in memory is saved
        there again as ckpt_last.pt, at the last step, with no best epoch (ckpt_best.pt went with the folder: the
        resumed run chooses the best among the epochs still to come), then the run stops in one line."""
        out, state = self.run.out_dir, self.state(self.path)
        state.update(best_metric=-1.0, best_epoch=-1, **({"bad_epochs": 0} if "bad_epochs" in state else {}))
        self.writer.wait()
        self.writer.write([(state, self.path)])
        self.writer.wait()
        self.folder, self.unsaved = os.stat(out).st_ino, False
        return FileNotFoundError(f"{out} was deleted during the run, with its checkpoints and log: the model in "
                                 f"memory is saved there again, {self.path} at step {state['step']}, but the best "
                                 f"epoch so far went with the folder (the resumed run chooses one among the epochs "
                                 f"still to come); continue with: {command_with('--resume')}")
