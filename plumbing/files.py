"""Files: how the project writes what it keeps, so that a crash, Ctrl-C, a full disk or a second run spoils nothing.

- `write_text_atomically`, `save_json`: a temporary file beside the target, then renamed over it: a reader sees the
  old file or the new one, never half of one. `signals_deferred` holds Ctrl-C, SIGTERM and SIGHUP off such a write
  (the checkpoints use it), and `remove_partial_files` deletes the temporary files of a killed process.
- `DiskFull`, `no_space`, `reserve_space`, `out_of_space`: a disk too full for a file (a checkpoint, a cache) is one
  line naming the file and the space it needs, said before the write where possible.
- `Unwritable`, `unwritable`: a folder this user may not write (another user's, a read-only one) is one line naming
  it and what to do.
- `check_out_dir`, `OutDirLock`: an --out_dir that is a file is refused before any work; one run at a time writes
  into an --out_dir (a lock the kernel drops when its process dies), a second is refused naming the first; the
  lock taken, the temporary files of killed runs there are removed.
"""
import contextlib
import errno
import fcntl
import json
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from plumbing.flags import ConfigError

# -----------------------------------------------------------------------------
# A full disk


class DiskFull(OSError):
    """Not enough free space for a file this project writes; the message says how much it needs, and where."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a full quota
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # another user's folder, a read-only one or file system


class Unwritable(OSError):
    """A folder this project must write into that this user cannot write: the message names it and what to do."""


def unwritable(folder, error: OSError, fix: str) -> Unwritable:
    """The one-line Unwritable of `folder`, which refused a write with `error` (PermissionError, EROFS)."""
    return Unwritable(f"cannot write in {folder} ({error.strerror or error}); {fix}")


def size_text(size: int) -> str:
    """Bytes for a person: '18.1 GB', '340.0 MB', '12 bytes'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def no_space(what: Path, folder: Path, needed: int, fix: str) -> DiskFull:
    """The DiskFull to raise when `what` (needed bytes) does not fit in `folder`."""
    try:
        free = f"{size_text(shutil.disk_usage(folder).free)} free"
    except OSError:
        free = "free space unknown"
    return DiskFull(f"not enough space for {what}: it needs {size_text(needed)}, {folder} has {free}; {fix}")


def reserve_space(file, size: int, what: Path, fix: str) -> None:
    """Check that `size` bytes fit beside the open file `file` (its folder's free space), then reserve them
    (os.posix_fallocate, where the system has it): a disk that fills later cannot take them. DiskFull otherwise."""
    folder = Path(what).parent
    if shutil.disk_usage(folder).free < size - os.fstat(file.fileno()).st_blocks * 512:
        raise no_space(what, folder, size, fix)
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(file.fileno(), 0, size)
        except OSError as error:
            if error.errno in NO_SPACE:
                raise no_space(what, folder, size, fix) from None
            # EOPNOTSUPP, EINVAL: a file system without it; the free space was checked above


def out_of_space(error: BaseException) -> bool:
    """Whether a full disk or quota caused `error`: torch.save reports a failed write as a RuntimeError, the OSError
    in its context."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


# -----------------------------------------------------------------------------
# Whole files or none


# Ctrl-C, what Slurm and torchrun send to end a job, what a closed terminal or ssh session sends, and the signal
# a scheduler sends ahead of a job's end to ask for a checkpoint (Slurm's --signal=USR1@90)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


@contextlib.contextmanager
def signals_deferred(numbers=STOP_SIGNALS):
    """Ctrl-C or SIGTERM inside the block is noted and handed, when the block ends, to the handler that was there
    before it (KeyboardInterrupt, stopping.StopSignals' note, the default action); main thread only: elsewhere Python
    gives no signals, and the block runs as it is."""
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


def fsync_dir(path: Path) -> None:
    """Make a rename inside the folder `path` durable (where the system lets a folder be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def save_json(obj, path) -> None:
    """Atomic JSON write (the resolved config, predictions, score tables)."""
    write_text_atomically(json.dumps(obj, indent=2) + "\n", path)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # another user's process, or a system that cannot tell: leave its file
        return True
    return True


def remove_partial_files(folder) -> None:
    """Delete the temporary files (.NAME.tmpPID) that a killed process left behind: never a finished file, nor the
    temporary file of a process still running (another run writing to the same folder)."""
    for partial in Path(folder).glob(".*.tmp*"):
        pid = partial.name.rpartition(".tmp")[2]
        if pid.isdigit() and int(pid) != os.getpid() and process_alive(int(pid)):
            continue
        partial.unlink(missing_ok=True)


# -----------------------------------------------------------------------------
# One run per --out_dir


def check_out_dir(out_dir) -> None:
    """--out_dir must be a folder or not exist yet: an existing file, or a path under one, is refused before any
    work (one line), not after a whole evaluation when its first file is written."""
    out_dir = Path(out_dir)
    for folder in (out_dir, *out_dir.parents):
        if folder.exists() and not folder.is_dir():
            where = "is a file" if folder == out_dir else f"lies under {folder}, which is a file"
            raise ConfigError(f"--out_dir {out_dir} {where}, not a folder: choose another --out_dir")


OUT_DIR_FIX = ("choose an --out_dir of your own (--eval and --pair read --checkpoint from anywhere), or make that "
               "folder writable for this user")


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
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            if error.errno not in NOT_WRITABLE:
                raise
            raise unwritable(error.filename or self.path.parent, error, OUT_DIR_FIX) from None
        while self.fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as error:
                if error.errno not in NOT_WRITABLE:
                    raise
                raise unwritable(self.path.parent, error, OUT_DIR_FIX) from None
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
        remove_partial_files(self.path.parent)  # a killed run's temporary files: nobody else writes here now
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while still locked: a waiting taker sees another file, and retries
            os.close(self.fd)
            self.fd = None
