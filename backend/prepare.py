"""`python -m backend.prepare [--model M]`: convert and cache a model now, not at the first start.

The Docker image runs it at build time, so that a container starts with no
network and no GGUF conversion. It loads the model exactly as the server
would (resource check included), which leaves the converted weights and the
tokenizer in the cache directory, and exits. A GGUF file's copy made so for a
CPU leaves out the floats of the layers its blocks serve; `--full-copy` writes
them too, for what reads the whole copy: a GPU, the exact mode, `--quantize
int8`, or transformers itself (the CUDA image is built so).
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
    parser.add_argument(
        "--full-copy",
        action="store_true",
        help="a GGUF file's whole float32 copy, the weights its blocks serve on a CPU included",
    )
    args = parser.parse_args(argv)
    # A start in the exact mode reads every float weight: the copy is written whole, or completed.
    exact = dict(quantize="none", dtype="float32") if args.full_copy else dict(dtype=args.dtype)
    # One row is enough to load: the KV cache of the real server is checked when it starts.
    loaded = load_model(BackendConfig(model=args.model, device="cpu", rows=1, **exact))
    print(f"prepared {loaded.name}; tokenizer in {loaded.tokenizer_path}")


if __name__ == "__main__":
    main()
