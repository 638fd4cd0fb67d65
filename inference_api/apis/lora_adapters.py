"""vLLM's endpoints that load and unload LoRA adapters while the server runs (--allow-runtime-lora; vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING), which the inference gateway's LoRA syncer calls:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql", "load_inplace": false}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

200 with a line of text, as vLLM's. A loaded adapter is answered at once by
requests whose `model` names it, beside the other rows; an unloaded one's
waiting requests end with an error and its rows finish with its weights;
`load_inplace` replaces the adapter of that name, whose rows finish with it
while the waiting requests take the new one (docs/backend.md, "LoRA
adapters"). `lora_path` is a directory on the server's disk or, where no
such directory is, a hub id (`org/name`), downloaded here, in the request's
own thread, before the backend is asked to load it: no decode step waits
on the network (huggingface_hub's cache, `HF_TOKEN` and `HF_HUB_OFFLINE` as
for the model). 400 for a name already served (the model's, another
adapter's) and for an adapter that cannot be served or had (the reason
named); 404 for
unloading one that is not loaded, and for both endpoints on a server started
without the option. They are the operator's: the proxy does not forward them,
where any team could unload another's adapter or read a directory of the
server's disk.
"""

from __future__ import annotations

import uuid

from flask import Blueprint, Response, current_app

from backend.messages import AdaptersChanged, LoadAdapter, UnloadAdapter
from backend.utils.hub import DownloadFailed, download_adapter, hub_token, names_hub_repository
from inference_api.errors import RETRY_AFTER_NOT_READY, ApiError, unavailable
from inference_api.fields import read_bool, read_string
from inference_api.generation import read_request
from inference_api.router import NotReady, Router, Serving

bp = Blueprint("lora_adapters", __name__)

NOT_ALLOWED = (
    "adapters are loaded and unloaded while running only on a server started with --allow-runtime-lora "
    "(INFERENCE_ALLOW_RUNTIME_LORA=1)"
)


@bp.post("/v1/load_lora_adapter")
def load_lora_adapter() -> Response:
    data, serving = _read_change()
    name = read_string(data, "lora_name", required=True, non_empty=True)
    path = read_string(data, "lora_path", required=True, non_empty=True)
    in_place = read_bool(data, "load_inplace", False)
    loaded = name in serving.backend.adapters
    if loaded and not in_place:
        message = f"a LoRA adapter named {name!r} is already loaded (load_inplace: true replaces it)"
        raise ApiError(400, message, param="lora_name")
    if not loaded and name in serving.generating_names + serving.embedding_names + serving.rerank_names:
        raise ApiError(400, f"the name {name!r} is the served model's: requests could not tell them apart")
    if names_hub_repository(path):
        try:
            path = str(download_adapter(path, hub_token()))
        except DownloadFailed as error:
            raise ApiError(400, f"LoRA adapter {name!r} ({path}): {error}", param="lora_path") from None
    _change(LoadAdapter(uuid.uuid4().hex, name, path, replace=in_place), "lora_path")
    return Response(f"Success: LoRA adapter '{name}' added successfully.", mimetype="text/plain")


@bp.post("/v1/unload_lora_adapter")
def unload_lora_adapter() -> Response:
    data, serving = _read_change()
    name = read_string(data, "lora_name", required=True, non_empty=True)
    if name not in serving.backend.adapters:
        raise ApiError(404, f"no LoRA adapter {name!r} is loaded", param="lora_name")
    _change(UnloadAdapter(uuid.uuid4().hex, name), "lora_name")
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", mimetype="text/plain")


def _read_change() -> tuple[dict, Serving]:
    """The request's body and what is served; 404 on a server that loads adapters at start only."""
    if not current_app.config["SERVER"].backend.runtime_lora:
        raise ApiError(404, NOT_ALLOWED)
    return read_request(model_field=None)


def _change(change: LoadAdapter | UnloadAdapter, param: str) -> AdaptersChanged:
    """The backend's answer to the change: a 400 (a 404 for an adapter not loaded) naming what was wrong."""
    router: Router = current_app.extensions["router"]
    try:
        changed = router.change_adapters(change)
    except NotReady:
        raise unavailable("the backend is not ready; try again", RETRY_AFTER_NOT_READY) from None
    if changed.error is not None:
        raise ApiError(404 if changed.not_found else 400, changed.error, param=param)
    return changed
