"""The argument style shared by ``tpserve`` and ``tpserve plan``: number types that say what a
bad value must be, errors in one line, and defaults in the help."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Any, Callable, NoReturn, TypeVar

N = TypeVar("N", int, float)


def number(kind: Callable[[str], N], ok: Callable[[N], bool], requirement: str) -> Callable[[str], N]:
    """An argument type of ``kind`` values for which ``ok`` holds ("must be <requirement>" if not)."""

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'an integer' if kind in (int, human_int) else 'a number'}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return value

    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    return number(int, lambda v: v >= low, f">= {low}")


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(text: str) -> int:
    """An integer as vLLM's ``human_readable_int`` reads one: ``32768``, ``32k`` (lower case: x 1000, ``25.6k`` too)
    or ``32K`` (upper case: x 1024, whole numbers only)."""
    match = _HUMAN_INT.fullmatch(text.strip())
    if match is None:
        return int(text)  # a ValueError: number()'s "must be an integer"
    digits, suffix = match.groups()
    if suffix.isupper() and "." in digits:
        raise ValueError(f"{text!r}: a decimal takes a lower-case (x 1000) suffix, e.g. {digits}{suffix.lower()}")
    return int(float(digits) * _SUFFIXES[suffix]) if suffix.islower() else int(digits) * _SUFFIXES[suffix]


def human_int_at_least(low: int) -> Callable[[str], int]:
    return number(human_int, lambda v: v >= low, f">= {low}")


positive = number(float, lambda v: 0.0 < v < math.inf, "a positive number")
fraction = number(float, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
port = number(int, lambda v: 0 <= v <= 65535, "in [0, 65535]")


def _json_arg(text: str, fits: Callable[[Any], bool], what: str) -> Any:
    """JSON given on the command line, which ``fits`` must accept (else a usage error saying ``what`` it must be)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not fits(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def json_object_arg(text: str) -> dict[str, Any]:
    """A JSON object given on the command line."""
    return _json_arg(text, lambda v: isinstance(v, dict), "a JSON object")


def lora_module_arg(text: str) -> tuple[str, str]:
    """One of --lora-modules: ``NAME=PATH``, or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        spec = _json_arg(text, lambda v: isinstance(v, dict) and isinstance(v.get("name"), str)
                         and isinstance(v.get("path"), str), 'NAME=PATH or {"name": ..., "path": ...}')
        name, path = spec["name"], spec["path"]
    else:
        name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f'must be NAME=PATH or {{"name": ..., "path": ...}}, got {text!r}')
    return name, path


def json_strings_arg(text: str) -> tuple[str, ...]:
    """A JSON list of strings given on the command line (vLLM's form: '["http://a.example"]')."""
    fits = lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v)  # noqa: E731
    return tuple(_json_arg(text, fits, "a JSON list of strings"))


class OneLineParser(argparse.ArgumentParser):
    """Errors in one line (not the whole usage), naming the flag and the bad value. Flags may be spelled with
    underscores (``--max_model_len``), as vLLM's parser takes them."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(_dashed(args), namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


_FLAG_NAME = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")


def _dashed(args: list[str]) -> list[str]:
    """``--flag_name[=value]`` as ``--flag-name[=value]``, up to a ``--``; anything else (a value that starts with
    "--", such as a template's text) as it is."""
    out = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        name, eq, value = arg.partition("=")
        out.append(name.replace("_", "-") + eq + value if _FLAG_NAME.fullmatch(name) else arg)
    return out


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" unless the help already explains the default or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
