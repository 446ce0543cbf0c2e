"""The types of option values, shared by the command line, TOML files and the Python API.

Every field of `TrainConfig` declares one of these click parameter types. The command
line converts with it (so `--help` shows the choices and ranges, and click rejects a
wrong value naming the option), a TOML file is converted with the same type, and
`check` applies it to a config built in Python. One declaration, three doors.

`GroupedCommand` prints a command's options in sections (model, data, parallelism, ...)
instead of one flat list of forty.

The smaller subcommands (estimate, schedule, cdp, simulate, bench) use these too, and:
`QuantityType` reads sizes, bandwidths and times the way `mpipar/units.py` does (2GB,
25GB/s, 5us), `QuantityListType` a comma-separated list of them (--sizes 4KB,64MB),
`NameListType` comma-separated names of a choice (--op all-reduce,all-gather);
`RenamedOption` lists only an option's current name in --help while still accepting the
older names after it, so scripts written before the subcommands shared train's
vocabulary run on.

Exercised by: mpipar train --help;  mpipar simulate comm --help
              python -m pytest tests/test_config.py tests/test_cost.py tests/test_bench_comms.py
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import click

from mpipar.errors import ConfigError
from mpipar.units import parse_bytes


class LiveChoice(click.Choice):
    """A choice among names read when checked, not when declared: strategies registered from
    Python after import (`mpipar.schedule.strategies.register`) are valid names too."""

    def __init__(self, names: Callable[[], Sequence[str]]) -> None:
        self.names = names
        super().__init__(tuple(names()))

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.names()))

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ assigns it; the names stay live
        pass


class SizeType(click.ParamType):
    """A number of bytes: 2000000, '2GB', '512MiB' (mpipar's units, mpipar/units.py)."""

    name = "size"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        try:
            nbytes = int(parse_bytes(str(value)))
        except ConfigError:
            nbytes = 0
        if nbytes <= 0:
            self.fail(f"takes a positive size such as 2GB, 512MiB or 2000000000 (bytes); got {value!r}", param, ctx)
        return nbytes


class RecomputeType(click.ParamType):
    """--recompute: none, stage (keep each Compute's input) or every-K (the input of every K layers)."""

    name = "none|stage|every-K"

    def convert(self, value, param, ctx) -> str:
        text = str(value)
        count = text.removeprefix("every-")
        if text in ("none", "stage") or (count != text and count.isdigit() and int(count) >= 1):
            return text
        self.fail(f"takes none, stage or every-K with K a number of layers >= 1 (every-2); got {value!r}", param, ctx)


def recompute_segment(value: str) -> int | None:
    """Layers per recomputed segment of a --recompute value: None (no recomputation), 0 (a
    whole Compute: a stage, or a shared stage's unit) or K (every K layers within it)."""
    return None if value == "none" else 0 if value == "stage" else int(value.removeprefix("every-"))


class ModelType(click.ParamType):
    """--model: a built-in model's name, or FILE.py:FUNCTION, a builder of one's own (mpipar/adapters)."""

    name = "model"

    def __init__(self, builtin: tuple[str, ...]) -> None:
        self.builtin = builtin

    def convert(self, value, param, ctx) -> str:
        text = str(value)
        path, _, function = text.rpartition(":")
        if text in self.builtin or (path.endswith(".py") and function.isidentifier()):
            return text
        self.fail(f"{text!r} is neither a built-in model ({', '.join(self.builtin)}) nor FILE.py:FUNCTION",
                  param, ctx)


class IntListType(click.ParamType):
    """Positive integers separated by commas ('512,512'), or a TOML list ([512, 512])."""

    name = "ints"

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        parts = value.split(",") if isinstance(value, str) else value
        try:
            widths = tuple(int(part) for part in parts if str(part).strip() and not isinstance(part, bool))
        except (TypeError, ValueError):
            widths = ()
        if not widths or len(widths) != len([p for p in parts if str(p).strip()]) or min(widths) < 1:
            self.fail(f"takes positive integers separated by commas, such as 512,512; got {value!r}", param, ctx)
        return widths


class StrictInt(click.types.IntParamType):
    """An integer; unlike click's, refuses 2.5 and True (TOML values arrive typed)."""

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            self.fail(f"must be an integer, got {value!r}", param, ctx)
        return super().convert(value, param, ctx)


class StrictFloat(click.types.FloatParamType):
    """A finite number; refuses True and False, nan and inf (no option of mpipar means
    anything by them, and a NaN passes every range check, since it compares False)."""

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, bool):
            self.fail(f"must be a number, got {value!r}", param, ctx)
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"must be a finite number, got {value!r}", param, ctx)
        return number


class IntRange(click.IntRange, StrictInt):
    pass


class FloatRange(click.FloatRange, StrictFloat):
    pass


def describe_range(kind: click.types._NumberRangeBase) -> str:
    """'at least 1', 'more than 0', 'in [0, 1)' — the words a range's error uses."""
    low, high = kind.min, kind.max
    if high is None:
        return f"{'more than' if kind.min_open else 'at least'} {low:g}"
    return f"in {'(' if kind.min_open else '['}{low:g}, {high:g}{')' if kind.max_open else ']'}"


def check(option: str, kind: click.ParamType, value):
    """`value` converted by `kind`, or a ConfigError in one sentence naming `--option`."""
    if isinstance(kind, click.Choice):
        if value not in kind.choices:
            raise ConfigError(f"unknown {option} {value!r}; choose one of: {', '.join(kind.choices)}")
        return value
    if isinstance(kind, click.types._NumberRangeBase):
        converted = check(option, StrictInt() if isinstance(kind, click.IntRange) else StrictFloat(), value)
        low, high = kind.min, kind.max
        below = low is not None and (converted <= low if kind.min_open else converted < low)
        above = high is not None and (converted >= high if kind.max_open else converted > high)
        if below or above:
            raise ConfigError(f"{option} must be {describe_range(kind)}, got {value}")
        return converted
    try:
        return kind.convert(value, None, None)
    except click.BadParameter as error:
        raise ConfigError(f"{option}: {error.message}") from None


class GroupedOption(click.Option):
    """An option that knows which section of the help it belongs to."""

    def __init__(self, *args, group: str = "other", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group


class GroupedCommand(click.Command):
    """A command whose --help lists options section by section, in the order first declared."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "group", "other"), []).append(record)
        for title, rows in sections.items():
            with formatter.section(f"{title.capitalize()} options"):
                formatter.write_dl(rows)

class QuantityType(click.ParamType):
    """A quantity with a unit, converted by one of mpipar/units.py's parsers."""

    def __init__(self, name: str, parse: Callable[[str], float]) -> None:
        self.name = name
        self.parse = parse

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return self.parse(str(value))
        except ConfigError as error:
            self.fail(str(error), param, ctx)


class NameListType(click.ParamType):
    """Names from a fixed set, comma-separated; converts to a list in the order given."""

    name = "names"

    def __init__(self, choices: tuple[str, ...], kind: str) -> None:
        self.choices, self.kind = choices, kind

    def get_metavar(self, param, *args) -> str:
        return "[" + "|".join(self.choices) + "],..."

    def convert(self, value, param, ctx) -> list[str]:
        names = value if isinstance(value, list) else [name.strip() for name in str(value).split(",")]
        for name in names:
            if name not in self.choices:
                self.fail(f"unknown {self.kind} {name!r}; valid {self.kind}s are: {', '.join(sorted(self.choices))}",
                          param, ctx)
        return names


class QuantityListType(click.ParamType):
    """Comma-separated quantities with units (4KB,64MB), each read by `parse`."""

    def __init__(self, name: str, parse: Callable[[str], float]) -> None:
        self.name, self.parse = name, parse

    def convert(self, value, param, ctx) -> list:
        if isinstance(value, list):
            return value
        try:
            quantities = [self.parse(text) for text in str(value).split(",") if text.strip()]
        except ConfigError as error:
            self.fail(str(error), param, ctx)
        if not quantities:
            self.fail(f"names no {self.name}", param, ctx)
        return quantities


class RenamedOption(click.Option):
    """An option whose --help shows its first name only; the names after it are its older
    spellings, still accepted."""

    def get_help_record(self, ctx):
        every_name = self.opts
        self.opts = self.opts[:1]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = every_name
