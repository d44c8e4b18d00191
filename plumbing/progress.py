"""Progress: how far a long job has come, and the log of a training run.

- `Progress`, the project's one progress meter, shown two ways: the training scripts print its `line()` on their
  log steps ('step 120/600 | loss 2.31 | 310 ms/step | eta 2m28s'); a long build that prints nothing else (the
  image cache, check.py's decoding) lets `show()` redraw one line on stderr.
- `JsonlLog`: one JSON object per logged step in the run's folder (LOG_NAME); `trim_log` cuts it at the step a
  resumed run starts from (checkpoints.start_or_resume), and the run appends to it.
"""
import json
import math
import sys
import time
from pathlib import Path

from plumbing.files import write_text_atomically

LOG_NAME = "log.jsonl"  # a run's JsonlLog, beside its checkpoints


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    """Steps done out of `total`, timed from this process's first step (`first_step`: where a resumed run began).

    line(step, **values): 'step 120/600 | loss 2.31 | 310 ms/step | eta 2m28s', for the caller to print.
    show(done): '  image cache data/x.npy: 1,024/12,000, 310/s, eta 35 s' on stderr, redrawn at most once a second;
    with `what` (the job's name) the first such line is drawn at once, so that a long build never looks stuck.
    """

    def __init__(self, total: int, first_step: int = 0, what: str = ""):
        self.total, self.first, self.what = total, first_step, what
        self.start = self.last = time.perf_counter()
        if what:
            self.show(0, force=True)

    def line(self, step: int, **values) -> str:
        done = step - self.first
        per_step = (time.perf_counter() - self.start) / done if done > 0 else float("nan")
        parts = [f"step {step}/{self.total}"]
        for key, value in values.items():
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        parts.append(f"{per_step * 1000:.0f} ms/step" if done > 0 else "-- ms/step")
        parts.append(f"eta {_duration((self.total - step) * per_step)}")
        return " | ".join(parts)

    def show(self, done: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.total or not (force or now - self.last > 1 or done == self.total):
            return
        rate = done / max(now - self.start, 1e-9)
        eta = f"{(self.total - done) / rate:.0f} s" if done else "--"
        print(f"\r  {self.what}: {done:,}/{self.total:,}, {rate:,.0f}/s, eta {eta} ",
              end="\n" if done == self.total else "", file=sys.stderr, flush=True)
        self.last = now


class JsonlLog:
    """Appends one JSON object per line (the master process only); appending keeps a resumed run's history, which
    checkpoints.start_or_resume first cuts at its checkpoint's step (trim_log), so that the log holds each step once."""

    def __init__(self, path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, **record) -> None:
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)  # an out_dir deleted meanwhile: StepBoundary says so
            with open(self.path, "a") as f:
                f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")


def trim_log(path, step: int) -> None:
    """Keep the records of a log up to `step`, the step of the checkpoint a run resumes from: the steps after it
    and the test scores are written again by the resumed run (atomically, as files.save_json)."""
    path = Path(path)
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines(keepends=True) if line.strip()]
    records = [json.loads(line) for line in lines]
    write_text_atomically("".join(line for line, record in zip(lines, records)
                                  if record.get("step", 0) <= step and record.get("split") != "test"), path)
