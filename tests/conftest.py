"""Shared by every test: converted weights are cached inside the checkout, so
that the default model is converted from GGUF once per machine, not per test."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("INFERENCE_CACHE_DIR", str(ROOT / ".cache"))
