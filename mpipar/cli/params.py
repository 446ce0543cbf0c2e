"""Option types of the smaller subcommands (estimate, schedule, cdp, simulate, bench).

`QuantityType` reads sizes, bandwidths and times the way `mpipar/units.py` does (2GB,
25GB/s, 5us), so a wrong one is refused by click naming the option; `QuantityListType`
reads a comma-separated list of them (--sizes 4KB,64MB). `NameListType` is a
click.Choice for comma-separated names (--op all-reduce,all-gather). `RenamedOption`
lists only an option's current name in --help while still accepting the older names
after it, so scripts written before the subcommands shared train's vocabulary run on.

Exercised by: mpipar simulate comm --help;  python -m pytest tests/test_cost.py tests/test_bench_comms.py
"""

from __future__ import annotations

from typing import Callable

import click

from mpipar.errors import ConfigError


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
