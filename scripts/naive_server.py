#!/usr/bin/env python
"""The baseline the benchmark compares against: a naive server running `model.generate` one request at a time.

    .venv/bin/python scripts/naive_server.py [--port 8010] [--model M] [--dtype D]

What a first attempt at an inference server looks like: Flask's threaded
server, one lock around the model, `model.generate` with a
TextIteratorStreamer for each request in turn. It speaks just enough of
`/v1/completions` (streaming SSE, `max_tokens`, `temperature`, `top_p`,
`top_k`, `min_p`, `ignore_eos`) for scripts/benchmark.py to drive it like the real one.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from flask import Flask, Response, jsonify, request
from transformers import TextIteratorStreamer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.messages import BackendConfig  # noqa: E402
from backend.model.loader import load_model  # noqa: E402


def create_app(model_spec: str | None, dtype: str) -> Flask:
    loaded = load_model(BackendConfig(model=model_spec, dtype=dtype, rows=1))
    model, tokenizer = loaded.model, loaded.tokenizer
    one_at_a_time = threading.Lock()
    app = Flask(__name__)

    @app.get("/ready")
    def ready():
        return jsonify(model=loaded.name)

    @app.post("/v1/completions")
    def completions():
        body = request.get_json()
        max_tokens = int(body.get("max_tokens", 16))
        inputs = tokenizer(body["prompt"], return_tensors="pt").to(model.device)
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        temperature = float(body.get("temperature", 1.0))
        settings = dict(
            **inputs,
            streamer=streamer,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens if body.get("ignore_eos") else 0,
            do_sample=temperature > 0,
            pad_token_id=tokenizer.eos_token_id,
        )
        if temperature > 0:
            settings.update(
                temperature=temperature,
                top_p=float(body.get("top_p", 1.0)),
                top_k=int(body.get("top_k", 0)),
                min_p=float(body.get("min_p", 0.0)) or None,
            )

        def generate():
            with one_at_a_time:
                model.generate(**settings)

        def events():
            thread = threading.Thread(target=generate)
            thread.start()
            for text in streamer:
                if text:
                    chunk = {
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": text, "finish_reason": None}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
            thread.join()
            yield "data: [DONE]\n\n"

        return Response(events(), content_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    create_app(args.model, args.dtype).run(host="127.0.0.1", port=args.port, threaded=True)


if __name__ == "__main__":
    main()
