"""`python -m backend.prepare [--model M]`: convert and cache a model now, not at the first start.

The Docker image runs it at build time, so that a container starts with no
network and no GGUF conversion. It loads the model exactly as the server
would (resource check included), which leaves the converted weights and the
tokenizer in the cache directory, and exits.
"""

from __future__ import annotations

import argparse
import logging

from backend.messages import BackendConfig
from backend.model.loader import load_model


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="python -m backend.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="directory, hub id or GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    # One row is enough to load: the KV cache of the real server is checked when it starts.
    loaded = load_model(BackendConfig(model=args.model, dtype=args.dtype, device="cpu", rows=1))
    print(f"prepared {loaded.name}; tokenizer in {loaded.tokenizer_path}")


if __name__ == "__main__":
    main()
