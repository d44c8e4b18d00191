"""Processes: a training process's set-up, the nanoGPT way: DDP from the environment, device, precision, memory.

DDP is torch's DistributedDataParallel: one process per GPU, each with a copy of the model, gradients averaged.

- `setup`: one of torchrun's processes (RANK is set: DDP, `init_process_group`) or the only one; its device, TF32,
  the autocast context and the GradScaler. adapt.py, pretrain.py and caption.py all call it.
- `process_environment`, `process_store`, `rendezvous`: torchrun's environment read, a stray RANK refused in one
  line; the store the processes meet in, fresh for each of torchrun's restarts; started by hand (RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT), a wait for the others bounded by CLIP4IDC_PEER_WAIT that Ctrl-C and SIGTERM end, and a
  missing process or a taken port named in one line.
- `Distributed`, `gpu_index`, `resolve_dtype`, `set_tf32`, `GROUP_TIMEOUT`, `loader_workers`: what
  the set-up fills in, the GPU a process takes, the precision 'auto' means (by the GPU's compute capability), TF32
  and where it is turned off, how long a process waits for the master, how many loader processes 'auto' means.
- `one_download_per_machine`: a download into the cache made once per machine, the other processes waiting.
- `keep_freed_memory`: glibc keeps freed blocks for reuse, so a CPU training step does not page-fault.
"""
import ctypes
import dataclasses
import datetime
import os
import signal
import socket
import sys
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed import init_process_group

import data
from plumbing import clip_files
from plumbing.flags import ConfigError, check_device
from plumbing.stopping import Interrupted

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
        raise ConfigError(f"--dtype {dtype!r} is not one this project trains in: use auto, float32, bfloat16 or "
                          f"float16")
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


def by_master(dist_: Distributed, work, *args) -> None:
    """work(*args) by the master alone (drawing the synthetic set, building a cache), while the others wait."""
    if dist_.master:
        work(*args)
    if dist_.ddp:
        torch.distributed.barrier()


def from_master(value: int, dist_: Distributed) -> int:
    """The master's value, on every process of a torchrun (a broadcast); a process alone keeps its own."""
    if not dist_.ddp:
        return value
    flag = torch.tensor([value], device=dist_.device)
    torch.distributed.broadcast(flag, 0)
    return int(flag)


def dataset_tokenizer(bpe_path, dist_: Distributed):
    """The tokenizer of a dataset's vocabulary file (data.bpe_path), or of OpenAI's when it has none (None):
    downloaded into CLIP's cache on first use, once per machine."""
    with one_download_per_machine(dist_):
        return clip_files.get_tokenizer(bpe_path)


@contextmanager
def one_download_per_machine(dist_: Distributed):
    """Under torchrun, the block (a download into this machine's cache: CLIP's weights, its vocabulary) runs in each
    machine's first process (LOCAL_RANK 0) while the others wait; then in the others, which find the checked file in
    the cache. Eight processes never fetch one file at once. Every process meets the one barrier once."""
    if dist_.ddp and dist_.local_rank != 0:
        torch.distributed.barrier()
    yield
    if dist_.ddp and dist_.local_rank == 0:
        torch.distributed.barrier()


# How long a process waits in a collective (a barrier) for the others. The master alone draws the synthetic set,
# builds the caches, validates after every epoch and scores the test split while the others wait at a barrier;
# torch's default (10 minutes for NCCL) would end a run whose image cache (CLEVR-Change: 80,000 images decoded)
# or stage 2's feature cache takes longer. A process that truly hangs is still stopped, after this long.
GROUP_TIMEOUT = datetime.timedelta(hours=2)


# How long a process started without torchrun's agent waits for the others (PEER_WAIT_ENV, seconds): a peer on
# another machine may start minutes later (a container pulled), one that never comes is named when it is over.
PEER_WAIT = 600
PEER_WAIT_ENV = "CLIP4IDC_PEER_WAIT"
ARRIVED = "clip4idc/arrived/"  # each process's key in the store, once it has come


def process_environment() -> tuple[int, int, int]:
    """(RANK, LOCAL_RANK, WORLD_SIZE) as torchrun sets them; a RANK without the rest (a stray RANK=0 in a shell or
    a job script) or a value that is not a number is refused in one line."""
    missing = [k for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ConfigError(f"RANK={os.environ['RANK']} is set in the environment, but not {', '.join(missing)}, which "
                          f"torchrun sets with it: to train as one process, unset RANK (env -u RANK python ...); as "
                          f"several, launch with torchrun (torchrun --standalone --nproc_per_node=2 ...)")
    try:
        values = tuple(int(os.environ.get(k, 0)) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"))
    except ValueError:
        shown = ", ".join(f"{k}={os.environ.get(k)!r}" for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"))
        raise ConfigError(f"torchrun's environment holds a value that is not a whole number ({shown}); set them "
                          f"by launching with torchrun, or unset RANK to train as one process") from None
    rank, local_rank, world_size, _ = values
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} with WORLD_SIZE={world_size}: a process's RANK is one of 0 to "
                          f"{world_size - 1}; launch with torchrun, which sets both")
    return rank, local_rank, world_size


def process_store(rank: int, world_size: int) -> dist.Store:
    """The key-value store the processes of a run meet in, at MASTER_ADDR:MASTER_PORT.

    Under torchrun its agent serves it (TORCHELASTIC_USE_AGENT_STORE) and has already gathered every process; the
    keys of this start go under its restart count: torch's agent keeps one store across --max-restarts, and a
    restarted process would read the first start's addresses (gloo: "Connection refused"; torch issue 135712).
    Started by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set in each process's environment, a job script's
    srun), RANK 0 serves it and every process waits for the others at most CLIP4IDC_PEER_WAIT seconds
    (rendezvous), instead of torch's silent two hours."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=GROUP_TIMEOUT)
        return dist.PrefixStore(f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/default_pg", store)
    return dist.PrefixStore("default_pg", rendezvous(host, port, rank, world_size, peer_wait()))


def peer_wait() -> float:
    value = os.environ.get(PEER_WAIT_ENV, str(PEER_WAIT))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"{PEER_WAIT_ENV}={value!r}: it must be a number of seconds > 0, how long a process waits "
                          f"for the others of its run")
    return seconds


def rendezvous(host: str, port: int, rank: int, world_size: int, wait: float) -> dist.TCPStore:
    """Every process of a run started by hand meets the others here: RANK 0 serves the store at host:port, each
    process writes its key (ARRIVED) and waits until all WORLD_SIZE have, polling once a second so that a signal
    (Ctrl-C, SIGTERM) ends the wait at once. After `wait` seconds the processes that never came are named in one
    line (ConfigError); a port another process holds, too."""
    where = f"MASTER_ADDR:MASTER_PORT {host}:{port}"
    deadline = time.monotonic() + wait
    try:
        if rank == 0:
            try:
                store = dist.TCPStore(host, port, world_size, is_master=True, timeout=GROUP_TIMEOUT,
                                      wait_for_workers=False)
            except dist.DistNetworkError as error:
                taken = "EADDRINUSE" in str(error)
                raise ConfigError(f"RANK 0 cannot serve the run's store at {where}: "
                                  + ("another process holds that port (another run?); choose a free MASTER_PORT, or "
                                     "launch with torchrun --standalone, which finds one" if taken else
                                     f"{str(error).strip().splitlines()[0]}; MASTER_ADDR must be an address of RANK "
                                     f"0's machine")) from None
        else:
            reached = reach(host, port, deadline)
            if reached is not None:
                raise ConfigError(f"RANK {rank} found no RANK 0 at {where} in {wait:g} s ({reached}): start RANK 0 "
                                  f"there, or correct MASTER_ADDR and MASTER_PORT; {PEER_WAIT_ENV}=SECONDS sets the "
                                  f"wait") from None
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=GROUP_TIMEOUT)
        store.set(f"{ARRIVED}{rank}", str(os.getpid()))
        said = False
        while True:
            missing = [r for r in range(world_size) if not store.check([f"{ARRIVED}{r}"])]
            if not missing:
                return store
            if time.monotonic() > deadline:
                raise ConfigError(f"WORLD_SIZE={world_size}, but RANK {', '.join(map(str, missing))} never came to "
                                  f"{where} in {wait:g} s: start {'it' if len(missing) == 1 else 'them'} (the same "
                                  f"command with RANK={missing[0]} in its environment), or launch with torchrun; "
                                  f"{PEER_WAIT_ENV}=SECONDS sets the wait")
            if not said and time.monotonic() > deadline - wait + 2:
                print(f"RANK {rank} waits up to {wait:g} s for RANK {', '.join(map(str, missing))} of WORLD_SIZE "
                      f"{world_size} at {where} ({PEER_WAIT_ENV} sets it)", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.5)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM (stopping.run_main): the wait is over, nothing began
        raise Interrupted(f"{str(interrupt) or 'interrupted'} while RANK {rank} waited for the other processes of "
                          f"the run at {where}: nothing was started",
                          getattr(interrupt, "status", 128 + signal.SIGINT)) from None


def reach(host: str, port: int, deadline: float) -> str | None:
    """Try to connect to host:port once a second until `deadline`: None once it answers, else why it did not (a
    plain socket: torch's store client would log a traceback at every try)."""
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return None
        except OSError as error:
            if time.monotonic() > deadline:
                return error.strerror or str(error)
        time.sleep(1)


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


def gpu_index(device: str, ddp: bool, local_rank: int) -> int:
    """The GPU this process takes: under torchrun its LOCAL_RANK's (process 5 of 8 on a second machine of 4 GPUs
    takes that machine's GPU 1), else the index --device names (cuda:1), else 0 (plain cuda, or auto: the first
    GPU CUDA_VISIBLE_DEVICES leaves). One that is not there is refused in one line."""
    index = local_rank if ddp else (torch.device(device).index or 0)
    count = torch.cuda.device_count()
    if index >= count:
        why = (f"torchrun started process LOCAL_RANK {local_rank} on this machine" if ddp else f"--device {device}")
        raise ConfigError(f"{why}, but torch sees {count} GPU(s) here (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most {count} processes a "
                          f"machine (--nproc_per_node), or name a GPU from cuda:0 to cuda:{count - 1}")
    return index


def setup(config) -> tuple[Distributed, str, object, torch.amp.GradScaler]:
    """This process: one of torchrun's (RANK is set: DDP) or the only one; its device; the precision context.

    config: a training script's Config; its device, dtype and tf32 are read. Returns the process (Distributed),
    the precision it trains in, the autocast context and the GradScaler."""
    device = check_device(config.device)  # auto: cuda when torch sees a GPU; a missing GPU is refused
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, local_rank, world_size = process_environment() if ddp else (0, 0, 1)
    if device.startswith("cuda"):
        device = f"cuda:{gpu_index(device, ddp, local_rank)}"  # torch.cuda.set_device wants an index: cuda:N
        torch.cuda.set_device(torch.device(device))  # also for one process on cuda:1: its kernels and caches go there
        set_tf32(config.tf32)
    if ddp:  # device_id binds NCCL to this process's GPU at once; the timeout covers the master's work alone
        # the store every process meets in first: a bounded wait for the others (rendezvous)
        init_process_group("nccl" if device.startswith("cuda") else "gloo", store=process_store(rank, world_size),
                           rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT,
                           device_id=torch.device(device) if device.startswith("cuda") else None)
    if ddp and not device.startswith("cuda"):
        # torchrun sets OMP_NUM_THREADS=1: share this machine's cores between its local processes instead
        torch.set_num_threads(max(1, data.usable_cpus() // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    dist_ = Distributed(ddp, rank, local_rank, world_size if ddp else 1, torch.device(device), rank == 0)
    dtype = resolve_dtype(config.dtype, dist_.device)  # "auto": bf16 (or fp16) on a GPU, float32 on CPU
    # weights stay float32; autocast runs the matrix products in bf16 or fp16
    ctx = nullcontext() if dtype == "float32" else torch.autocast(dist_.device.type, dtype=getattr(torch, dtype))
    # fp16 only: the loss is scaled up before backward so that small gradients do not underflow
    scaler = torch.amp.GradScaler(dist_.device.type, enabled=(dtype == "float16"))
    return dist_, dtype, ctx, scaler


# -----------------------------------------------------------------------------
# Memory: keep freed blocks in the process

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameters (malloc.h)


def keep_freed_memory(largest_block: int = 32 << 20) -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the kernel.

    By default glibc serves a large block (over a threshold that grows to at most 32 MiB) with a fresh mmap and
    unmaps it when freed. A training step's activations are such blocks, so each step gets new pages, and the
    kernel zeroes and maps every page on first touch (what that costs a step: BENCHMARKS.md section 3). After
    this call blocks up to largest_block come from the heap and the heap is never trimmed, so a step reuses the
    pages of the step before (0 faults). The price: the process keeps its peak memory until it ends. This is what
    jemalloc or tcmalloc would give, without a dependency. Returns False, doing nothing, off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, largest_block) and libc.mallopt(M_TRIM_THRESHOLD, -1))
    except (OSError, AttributeError):  # not Linux, or a C library without mallopt (musl)
        return False
