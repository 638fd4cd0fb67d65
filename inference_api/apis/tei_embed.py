"""Text Embeddings Inference's `POST /embed`, as LlamaIndex's `TextEmbeddingsInference` calls it: each
input's vector, from the model `/v1/embeddings` answers with (embedder.py), as a bare list of lists.

`inputs` is a string or a list of them (or token ids, as TEI takes), at most embedder.MAX_INPUTS; no
`model` field, as TEI serves one. `truncate` (default false) cuts an input too long for the model to
what it takes, from its end or, with `truncation_direction` "left" ("Left" as TEI spells it), its start;
without it one too long is a 400. `normalize` must stay true: the vectors are normalised, and the norm
is gone. Other fields are ignored (`model`, `prompt_name`). Errors are in TEI's shape (TGI's: `{"error",
"error_type"}`).
"""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from backend.messages import InvalidParams
from inference_api.embedder import Cut, embed, embedding_ids
from inference_api.fields import read_bool, read_truncation_direction
from inference_api.generation import ApiFields, read_request
from inference_api.prompts import prompt_list

bp = Blueprint("tei_embed_api", __name__)

FIELDS = ApiFields(prompt_ids="inputs", count="inputs")


@bp.post("/embed")
def tei_embed() -> Response:
    data, serving = read_request(model_field=None)
    if not read_bool(data, "normalize", True):
        raise InvalidParams("normalize", "normalize must be true: the vectors are normalised by the model")
    if data.get("dimensions") is not None:
        message = "dimensions is not supported: the vectors have the model's hidden size"
        raise InvalidParams("dimensions", message)
    truncate = -1 if read_bool(data, "truncate", False) else None
    cut = Cut(truncate, read_truncation_direction(data), "truncate", "truncate: true cuts it to fit")
    inputs = embedding_ids(prompt_list(data.get("inputs"), "inputs"), serving, "inputs", cut)
    return jsonify([list(vector) for vector in embed(inputs, FIELDS)])
