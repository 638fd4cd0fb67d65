"""The Hugging Face hub: its token, and LoRA adapters named by their repository (`org/name`, as vLLM
takes them), downloaded as a model is (huggingface_hub's cache, `HF_TOKEN`, `HF_HUB_OFFLINE`). The
backend downloads those of --lora-modules at start; while serving, the frontend's request thread
downloads one that /v1/load_lora_adapter names before the backend is asked to load it, so that no
decode step waits on the network. No torch here: the frontend imports it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dotenv import dotenv_values

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name: a hub repository, where no directory is
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what PEFT saves


def hub_token() -> str | None:
    """HF_TOKEN from the environment, else from a .env file in the working directory."""
    return os.environ.get("HF_TOKEN") or dotenv_values(".env").get("HF_TOKEN") or None


class DownloadFailed(Exception):
    """The hub repository could not be had (not found, gated, no network); the message says why."""


def names_hub_repository(path: str) -> bool:
    """Whether `path` is a hub id rather than a directory (a directory of that name wins, as in vLLM)."""
    return not Path(path).is_dir() and HUB_ID.fullmatch(path) is not None


def download_adapter(repository: str, token: str | None) -> Path:
    """The directory of the adapter's files in the hub cache, downloaded where not there yet."""
    from huggingface_hub import snapshot_download  # inside: only where an adapter is named so

    try:
        return Path(snapshot_download(repository, token=token, allow_patterns=list(ADAPTER_FILES)))
    except Exception as error:  # not found, gated, offline: huggingface_hub's errors, each its own type
        raise DownloadFailed(f"no directory there, and no hub repository to download: {error}") from None
