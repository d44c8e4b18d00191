"""Flags: a training script's Config dataclass becomes its command line, and its values are checked at once.

adapt.py, pretrain.py and caption.py each start with one `Config` dataclass holding every knob, as nanoGPT's
train.py starts with its globals. `parse_config` builds argparse from it: each field is a flag `--name`, written
with `flag(default, help)` so that its --help text is the field's own metadata; a dataset preset (`--data`) is
applied before the command-line flags; a misspelt flag fails. `check_settings`, `check_length`, `check_device`
and `check_image_path` refuse a bad value before any data is read (ConfigError, printed as one line by
stopping.run_main).
"""
import argparse
import dataclasses
import math
import typing
from pathlib import Path

import torch
from PIL import Image


class ConfigError(ValueError):
    """A setting that cannot work: a bad flag value, or flags that contradict a checkpoint or each other."""


def flag(default, help: str, also: tuple = ()):
    """A Config field whose --help text is `help`: `lr: float = flag(1e-4, "learning rate")`. also: the words a
    yes-or-no flag takes besides (`--resume`, `--no-resume`, `--resume auto`)."""
    return dataclasses.field(default=default, metadata={"help": help, "also": also})


def _flag_type(kind):
    if kind is bool:
        return None  # handled by BooleanOptionalAction
    if kind in (int, float, str):
        return kind
    return str  # Optional[str] and friends: the script converts


def parse_config(config_cls, presets: dict, argv=None, description: str = ""):
    """Defaults of `config_cls`, then `presets[--data]`, then the flags given; returns a `config_cls`.

    Every dataclass field `name` is a flag `--name` (underscores may be written as dashes), its --help the field's
    metadata (flag()). A flag that is not a field fails with argparse's error, so a misspelt option never passes
    silently.
    """
    defaults = config_cls()
    hints = typing.get_type_hints(config_cls)  # string annotations resolved too
    preset_lines = "\n".join(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in values.items())
                             for name, values in presets.items())
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        epilog=f"presets (chosen by --data, applied before the flags you give):\n{preset_lines}")
    for f in dataclasses.fields(config_cls):
        kind, about = hints[f.name], f.metadata.get("help", "")
        flags = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        help_text = f"{about} (default: {getattr(defaults, f.name)!r})"
        if f.metadata.get("also"):  # --name (True), --no-name (False), or --name WORD
            parser.add_argument(*flags, dest=f.name, nargs="?", const=True, choices=f.metadata["also"],
                                default=argparse.SUPPRESS, help=help_text)
            parser.add_argument(f"--no-{f.name}", dest=f.name, action="store_false", default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
        elif kind is bool:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(kind) is tuple:  # e.g. tuple[str, str]: a flag that takes that many values
            parts = typing.get_args(kind)
            names = about.split(":")[0].split()  # "BEFORE AFTER: ..." names the values
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


# -----------------------------------------------------------------------------
# Checks of a value, before any work


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
