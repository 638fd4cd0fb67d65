"""The sampling a model's creator recommends (its generation_config.json), as the OpenAI-style APIs' defaults.

Qwen3's file says temperature 0.6, top_p 0.95 and top_k 20, Llama 3.1 Instruct's 0.6 and 0.9; a request
that leaves them out was sampled at 1.0 with no cut, which such a model's card warns against. vLLM takes
them as the defaults of the fields a request leaves out (`--generation-config auto`, its default), and
so does this server, with vLLM's options: `--generation-config vllm` leaves them out (the APIs' own
defaults), a directory reads its generation_config.json instead, and `--override-generation-config`'s
JSON goes over either. The fields are vLLM's: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as the default max_tokens. Those of the frontend's OpenAI, Responses and Anthropic APIs
take them (inference_api/router.py, `Serving.sampling_default`); the other APIs keep their own defaults.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from backend.messages import MAX_REPETITION_PENALTY

log = logging.getLogger("backend")

# Each field and the values it may take: (lowest, highest, whether the lowest is excluded)
FIELDS: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "top_k": (-1, math.inf, False),  # -1 or 0: no cut
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, MAX_REPETITION_PENALTY, True),
    "max_new_tokens": (1, math.inf, False),
}
INTEGERS = ("top_k", "max_new_tokens")


def sampling_defaults(generation_config: Any, setting: str, override: Mapping[str, Any]) -> dict[str, float]:
    """The defaults of the fields a request leaves out: from `generation_config` (the loaded model's, a
    transformers GenerationConfig or None) with `setting` "auto", none with "vllm", else from the
    directory `setting` names; `override` over them. max_new_tokens becomes max_tokens. A value of the
    model's out of its field's range is left out, said in the log; one of the operator's is a ValueError."""
    if setting == "vllm":
        recommended: dict[str, Any] = {}
    elif setting == "auto":
        recommended = _sampling_fields(generation_config)
    else:
        recommended = _sampling_fields(_read_directory(setting))
    defaults = {}
    for name, value in recommended.items():
        try:
            defaults[name] = checked(name, value)
        except ValueError as error:
            log.warning("the model's generation config: %s; the API's own default is kept", error)
    defaults.update({name: checked(name, value) for name, value in override.items()})
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults:
        log.info(
            "sampling defaults for the fields a request leaves out (the OpenAI, Responses and Anthropic "
            "APIs; --generation-config vllm for the APIs' own): %s",
            ", ".join(f"{name} {value:g}" for name, value in defaults.items()),
        )
    return defaults


def checked(name: str, value: Any) -> float:
    """`value` as field `name` takes it, or a ValueError naming both."""
    if name not in FIELDS:
        raise ValueError(f"{name} is not a sampling field this server takes from it ({', '.join(FIELDS)})")
    lowest, highest, open_low = FIELDS[name]
    integer = name in INTEGERS
    number = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not number or (integer and value != int(value)):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not (lowest < value if open_low else lowest <= value) or value > highest:
        bounds = f"{'over' if open_low else 'at least'} {lowest:g}"
        bounds += f" and at most {highest:g}" if math.isfinite(highest) else ""
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
    return int(value) if integer else float(value)


def _sampling_fields(generation_config: Any) -> dict[str, Any]:
    """The sampling fields a GenerationConfig sets (transformers' defaults are None: set means written)."""
    if generation_config is None:
        return {}
    written = generation_config.to_diff_dict()
    return {name: written[name] for name in FIELDS if written.get(name) is not None}


def _read_directory(directory: str) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError as error:
        message = f"--generation-config {directory}: no generation_config.json read there ({error})"
        raise ValueError(message) from None
