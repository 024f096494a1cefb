"""One source for every training setting: a dataclass field carries its default and its help.

`python -m training` builds its flags from these fields with transformers' `HfArgumentParser`, so a
default or a help text is written once, beside the field it belongs to.
"""

from __future__ import annotations

import argparse
from dataclasses import field
from typing import Any


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with its command-line help (`help=None` hides it from the command line)."""
    metadata = {"help": argparse.SUPPRESS if help is None else help, **metadata}
    if isinstance(default, list):  # a fresh list per instance
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)
