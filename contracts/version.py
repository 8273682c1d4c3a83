"""llmgw's release: the version pyproject.toml names, read once, for every process that reports one.

Read from the file rather than from an installed package's metadata: llmgw runs from its
checkout (the control plane and each node alike), never installed with pip.
"""

import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _read() -> str:
    try:
        with PYPROJECT.open("rb") as fh:
            return tomllib.load(fh)["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"  # a checkout without its pyproject.toml still starts; it says it cannot tell


VERSION = _read()
