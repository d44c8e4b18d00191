"""Batches: a global batch split over processes and accumulation, one DataLoader per run, epochs that resume.

- `batch_plan`: the global batch (--batch_size) as micro-batches per process and accumulation step, and the
  DistributedSampler that deals the samples out (shuffled, the same order on every process for a seed and epoch).
- `training_loader`: the run's one DataLoader (workers that persist from epoch to epoch, pinned batches on CUDA).
- `epoch_batches`, `SkipSampler`: one epoch's micro-batches, resumed part-way through when a run was interrupted,
  drawing the random numbers an uninterrupted run draws; `EpochBatches`: its worker processes' failures (dead, not
  started, no file descriptor or shared memory left) as one line naming the cause and the fix, and a signal while
  the loop waits for a batch ending the wait.
"""
import itertools

import torch

from plumbing.flags import ConfigError
from plumbing.stopping import LoaderError, ignore_stop_signals, loader_failure

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


def epoch_batches(loader, epoch: int, done_steps: int, grad_accum: int, stop=None) -> "EpochBatches":
    """An iterator over one epoch's micro-batches of a training_loader, skipping the first `done_steps` optimizer
    steps (resuming); stop: the loop's StopSignals (EpochBatches).

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

    def start():  # at the first batch asked for: nothing draws a random number between here and there
        if done_steps == 0 and (loader.num_workers == 0 or epoch == 0):
            return iter(loader)  # the draw of an uninterrupted run
        own = torch.Generator().manual_seed(((sampler.seed * 1_000_003 + epoch) * 1_000_003 + done_steps) % 2 ** 63)
        loader.generator = own
        try:
            return iter(loader)
        finally:
            loader.generator = None

    return EpochBatches(start, loader.num_workers > 0, stop)


class EpochBatches:
    """An epoch's micro-batches: the DataLoader's iterator, made at the first batch asked for (start()).

    With worker processes (workers), a failure of theirs is one line naming the cause and the fix (LoaderError,
    stopping.loader_failure: a worker that died, that could not start, or could not hand over a batch for want of
    file descriptors or shared memory), a DataError, so that the loop saves its last step first. And with stop (the
    loop's StopSignals), a signal while the loop waits for a batch ends the wait at once (StopSignals.waiting): a
    batch may never come. Not without workers: the training process then reads the batch itself, drawing the
    samples' random numbers, and a stop in the middle of it would save a random state no uninterrupted run had."""

    def __init__(self, start, workers: bool, stop=None):
        self.start, self.workers, self.stop, self.iterator = start, workers, stop, None

    def __iter__(self):
        return self

    def __next__(self):
        starting, waiting = False, self.stop is not None and self.workers
        try:
            if waiting:
                self.stop.waiting = True
            if self.iterator is None:  # the worker processes start here (the first epoch's)
                starting = True
                self.iterator = self.start()
                starting = False
            return next(self.iterator)
        except (RuntimeError, OSError) as error:
            line = loader_failure(error, starting) if self.workers else None
            if line is None:
                raise
            raise LoaderError(line) from None
        finally:
            if waiting:
                self.stop.waiting = False
