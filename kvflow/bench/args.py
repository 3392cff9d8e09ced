"""Checks of `kvflow bench` options that argparse's types cannot express, run before any model
loads: a typo must cost neither a benchmark's minutes nor end it in a traceback after them."""

from __future__ import annotations

import argparse
import os

# Options naming a file a bench writes, and files it reads (any bench that has them).
OUTPUT_OPTIONS = ("output", "save_vectors", "json")
INPUT_OPTIONS = ("dataset_path", "text", "result")


def flag(name: str) -> str:
    """An args attribute as its option: num_prompts -> --num-prompts."""
    return "--" + name.replace("_", "-")


def check_paths(args: argparse.Namespace) -> None:
    """Every output's folder exists and every input file is there."""
    for name in OUTPUT_OPTIONS:
        path = getattr(args, name, None)
        if isinstance(path, str) and path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise ValueError(f"{flag(name)}: no such directory: {folder}")
    for name in INPUT_OPTIONS:
        value = getattr(args, name, None)
        for path in value if isinstance(value, list) else [value] if isinstance(value, str) else []:
            if not os.path.isfile(path):
                raise ValueError(f"{flag(name)}: no such file: {path}")


def at_least(args: argparse.Namespace, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise ValueError(f"{flag(name)} must be at least {minimum}, got {value}")


def ordered(args: argparse.Namespace, low: str, high: str) -> None:
    """A range given as two options: low <= high (both bounds inclusive)."""
    if getattr(args, low) > getattr(args, high):
        raise ValueError(f"{flag(low)} ({getattr(args, low)}) must not exceed {flag(high)} ({getattr(args, high)})")
