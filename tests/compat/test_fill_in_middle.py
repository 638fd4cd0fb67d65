"""Fill in the middle, as code editors ask for it: llama.cpp server's /infill (llama.vim's and
llama.vscode's requests) and the completions API's `suffix`, through the real server on a tiny random
Qwen2 whose byte-level tokenizer has Qwen2.5-Coder's special tokens (tests/backend/models.py), in the
exact mode. Random weights write no code, so each answer is held to /completion's greedy answer on the
prompt the test builds itself from llama-server's layout: the test proves the frame, the cuts and the
ends, and that /infill adds nothing else. A vocabulary without the tokens (the mock's) is a 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from tokenizers import Tokenizer

from tests.backend.models import write_tiny_code_model
from tests.frontend.test_openapi_e2e import documented
from tests.proxy.conftest import bearer, running_proxy
from tests.server_fixture import RunningServer, running_server

MODEL = "tiny-coder"
CONTEXT = 256
GREEDY = {"temperature": 0, "n_predict": 8, "return_tokens": True}
PREFIX, SUFFIX = "def area(r):\n    ", "\n    return result\n"
FILES = [{"filename": "shapes/circle.py", "text": "PI = 3.14159\n"}, {"text": "import math\n"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_code_model(tmp_path_factory.mktemp("models") / MODEL)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[RunningServer]:
    options = f"--model {model_dir} --rows 4 --max-seq-len {CONTEXT} --dtype float32 --quantize none"
    with running_server(*options.split(), ready_timeout=300) as running:
        yield running


class Vocabulary:
    """The model's tokenizer read as the tests' own reference: plain text (special tokens' texts spelled
    out, llama.cpp's parse_special false) and the special tokens by their texts."""

    def __init__(self, model_dir: Path):
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.plain = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.plain.encode_special_tokens = True

    def text(self, text: str) -> list[int]:
        return self.plain.encode(text, add_special_tokens=False).ids

    def __getitem__(self, name: str) -> int:
        return self.tokenizer.token_to_id(f"<|{name}|>")

    def files(self, files: list[dict[str, str]]) -> list[int]:
        """Qwen2.5-Coder's repository layout, as llama-server writes it."""
        ids = [self["repo_name"], *self.text("myproject\n")]
        for file in files:
            name = file.get("filename", "tmp") + "\n"
            ids += [self["file_sep"], *self.text(name), *self.text(file["text"])]
        return ids + [self["file_sep"], *self.text("filename\n")]

    def frame(self, prefix: list[int], suffix: list[int]) -> list[int]:
        return [self["fim_prefix"], *prefix, self["fim_suffix"], *suffix, self["fim_middle"]]


@pytest.fixture(scope="module")
def vocabulary(model_dir: Path) -> Vocabulary:
    return Vocabulary(model_dir)


def post(server: RunningServer, path: str, **fields) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=fields, timeout=120)


def completion_of(server: RunningServer, ids: list[int], **fields) -> dict:
    """/completion's answer on these prompt ids: what /infill must give on the prompt it builds."""
    answer = post(server, "/completion", prompt=ids, **{**GREEDY, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_infill_answers_as_completion_does_on_llama_servers_prompt(server, vocabulary):
    """Other files first, each after a file separator and its name; then the prefix with the prompt
    after it, the suffix, and the middle token to go on from."""
    fields = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": FILES, "prompt": "res"}
    answer = documented(post(server, "/infill", **fields, **GREEDY), "post", "/infill")
    expected = vocabulary.files(FILES) + vocabulary.frame(
        vocabulary.text(PREFIX) + vocabulary.text("res"), vocabulary.text(SUFFIX)
    )
    reference = completion_of(server, expected)
    assert answer["tokens_evaluated"] == len(expected) == reference["tokens_evaluated"]
    assert answer["prompt"] == vocabulary.tokenizer.decode(expected, skip_special_tokens=False)
    assert answer["tokens"] == reference["tokens"] and len(answer["tokens"]) == 8
    assert answer["content"] == reference["content"] and answer["stop_type"] == "limit"


def test_the_stream_is_the_whole_answer(server):
    fields = {"input_prefix": PREFIX, "input_suffix": SUFFIX, **GREEDY}
    whole = post(server, "/infill", **fields).json()
    streamed = {**fields, "stream": True}
    response = requests.post(f"{server.url}/infill", json=streamed, stream=True, timeout=120)
    documented(response, "post", "/infill")
    events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith(b"data: ")]
    assert "".join(event["content"] for event in events) == whole["content"]
    assert [token for event in events for token in event["tokens"]] == whole["tokens"]
    assert [event["stop"] for event in events] == [False] * (len(events) - 1) + [True]


def test_code_that_spells_a_special_token_stays_text(server, vocabulary):
    """A tokenizer's source, say, holds "<|file_sep|>": read as the token, it would end the file. (The
    repository's lines come with no input_extra too, as llama-server writes them.)"""
    code = 'SEPARATOR = "<|file_sep|>"\n'
    answer = post(server, "/infill", input_prefix=code, input_suffix="", **GREEDY).json()
    expected = vocabulary.files([]) + vocabulary.frame(vocabulary.text(code), [])
    assert len(vocabulary.text(code)) > len(vocabulary.tokenizer.encode(code).ids)  # one token, else
    assert answer["tokens_evaluated"] == len(expected)
    assert answer["content"] == completion_of(server, expected)["content"]


def test_a_long_file_is_cut_as_llama_server_cuts_it(server, vocabulary):
    """The prefix keeps its last 3/8 of the context, the suffix its first 1/8 less the prompt and two,
    and the other files fill the rest but the answer's n_predict, their last tokens kept."""
    prefix, suffix = "x = 1\n" * 200, "y = 2\n" * 200
    files = [{"filename": "big.py", "text": "z = 3\n" * 300}]
    answer = post(
        server, "/infill", input_prefix=prefix, input_suffix=suffix, input_extra=files, prompt="q", **GREEDY
    ).json()
    share = CONTEXT // 2
    kept_prefix = vocabulary.text(prefix)[-3 * (share // 4) :] + vocabulary.text("q")
    kept_suffix = vocabulary.text(suffix)[: share // 4 - 2 - 1]
    frame = vocabulary.frame(kept_prefix, kept_suffix)
    context = vocabulary.files(files)[-(CONTEXT - len(frame) - GREEDY["n_predict"]) :]
    expected = context + frame
    assert len(expected) == CONTEXT - GREEDY["n_predict"] == answer["tokens_evaluated"]
    assert answer["content"] == completion_of(server, expected)["content"]


@pytest.mark.parametrize("end", ["fim_pad", "file_sep", "repo_name"])
def test_a_token_that_ends_a_files_middle_ends_the_answer(server, vocabulary, end):
    """The model writing the next file's separator (or padding) has filled the gap: llama-server counts
    these end-of-generation tokens. Pushed to the top, each ends the answer at once."""
    bias = {"logit_bias": [[vocabulary[end], 100]]}
    answer = post(server, "/infill", input_prefix=PREFIX, input_suffix=SUFFIX, **GREEDY, **bias).json()
    assert answer["stop_type"] == "eos" and answer["content"] == ""
    assert answer["tokens"] == [vocabulary[end]] and answer["tokens_predicted"] == 1
    # /completion has no such end: on the same prompt the answer goes on
    expected = vocabulary.frame(vocabulary.text(PREFIX), vocabulary.text(SUFFIX))
    assert completion_of(server, expected, **bias)["tokens_predicted"] == GREEDY["n_predict"]


def test_completions_suffix_fills_the_gap_through_the_openai_client(server, vocabulary):
    client = server.openai_client()
    result = client.completions.create(
        model=MODEL, prompt=[PREFIX, "x = "], suffix=SUFFIX, max_tokens=8, temperature=0, n=1
    )
    for prefix, choice in zip([PREFIX, "x = "], result.choices, strict=True):
        expected = vocabulary.frame(vocabulary.text(prefix), vocabulary.text(SUFFIX))
        reference = client.completions.create(model=MODEL, prompt=expected, max_tokens=8, temperature=0)
        assert choice.text == reference.choices[0].text
    assert result.usage.prompt_tokens == sum(
        len(vocabulary.frame(vocabulary.text(prefix), vocabulary.text(SUFFIX))) for prefix in [PREFIX, "x = "]
    )
    # the end of a file's middle ends the choice as its end token does: no stop_reason
    ended = client.completions.create(
        model=MODEL,
        prompt="",
        suffix=SUFFIX,
        max_tokens=8,
        temperature=0,
        logit_bias={str(vocabulary["file_sep"]): 100},
    )
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].text == ""
    assert ended.choices[0].model_extra["stop_reason"] is None


# llama.vim's request as it sends it (its plugin/llama.vim, llama.vscode's is the same), and the
# request that fills the server's cache with the ring of other files' chunks while one types.
LLAMA_VIM = {
    "id_slot": 0,
    "input_prefix": PREFIX,
    "input_suffix": SUFFIX,
    "input_extra": FILES,
    "prompt": "re",
    "n_predict": 16,
    "stop": [],
    "n_indent": 4,
    "top_k": 40,
    "top_p": 0.90,
    "samplers": ["top_k", "top_p", "infill"],
    "stream": False,
    "cache_prompt": True,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 1000,
    "response_fields": [
        "content",
        "timings/prompt_n",
        "timings/prompt_ms",
        "timings/prompt_per_token_ms",
        "timings/prompt_per_second",
        "timings/predicted_n",
        "timings/predicted_ms",
        "timings/predicted_per_token_ms",
        "timings/predicted_per_second",
        "truncated",
        "tokens_cached",
    ],
}
LLAMA_VIM_RING = {
    "id_slot": 0,
    "input_prefix": "",
    "input_suffix": "",
    "input_extra": FILES,
    "prompt": "",
    "n_predict": 0,
    "temperature": 0.0,
    "samplers": [],
    "stream": False,
    "cache_prompt": True,
    "t_max_prompt_ms": 1,
    "t_max_predict_ms": 1,
    "response_fields": [""],
}


def test_llama_vims_requests_are_answered_through_the_proxy(server, vocabulary):
    """The editor's key is the team's token; it reads the fields it named, keyed by their paths."""
    with running_proxy(server.url) as proxy:
        ring = requests.post(f"{proxy.url}/infill", json=LLAMA_VIM_RING, headers=bearer(), timeout=60)
        assert ring.status_code == 200 and ring.json() == {}  # "" names no field
        answer = requests.post(f"{proxy.url}/infill", json=LLAMA_VIM, headers=bearer(), timeout=60)
        refused = requests.post(f"{proxy.url}/infill", json=LLAMA_VIM, timeout=60)
    assert answer.status_code == 200 and refused.status_code == 401
    picked = answer.json()
    assert set(picked) == set(LLAMA_VIM["response_fields"])
    assert picked["truncated"] is False and isinstance(picked["content"], str)
    timings = {path.removeprefix("timings/"): value for path, value in picked.items() if "/" in path}
    assert timings["predicted_n"] <= 16 and timings["prompt_n"] + picked["tokens_cached"] > 0
    per_token = timings["predicted_ms"] / timings["predicted_n"]
    assert timings["predicted_per_token_ms"] == pytest.approx(per_token)
    assert timings["prompt_per_token_ms"] * timings["prompt_per_second"] == pytest.approx(1000)


@pytest.mark.parametrize(
    "path, fields, named",
    [
        ("/infill", {"input_suffix": ""}, "input_prefix"),
        ("/infill", {"input_prefix": "", "input_suffix": 3}, "input_suffix"),
        ("/infill", {"input_prefix": [600], "input_suffix": ""}, "input_prefix"),
        ("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": [{"text": 1}]}, "input_extra"),
        ("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": {"text": "a"}}, "input_extra"),
        ("/infill", {"input_prefix": "", "input_suffix": "", "prompt": ["a"]}, "prompt"),
        ("/infill", {"input_prefix": "", "input_suffix": "", "n_indent": -1}, "n_indent"),
        ("/infill", {"input_prefix": "", "input_suffix": "", "response_fields": "a"}, "response_fields"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "suffix": "b", "echo": True}, "echo"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "suffix": "b", "truncate_prompt_tokens": 2},
            "truncate_prompt_tokens",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "suffix": 1}, "suffix"),
    ],
)
def test_bad_requests_are_a_400_naming_the_field(server, path, fields, named):
    answer = documented(post(server, path, **fields), "post", path)
    assert answer["error"]["param"] == named


def test_a_model_that_cannot_fill_in_the_middle_says_so(mock_server):
    """The mock's vocabulary is bytes, with no fill-in-the-middle tokens."""
    infill = post(mock_server, "/infill", input_prefix="a", input_suffix="b")
    assert infill.status_code == 400 and infill.json()["error"]["param"] == "input_prefix"
    assert "fill-in-the-middle tokens" in infill.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as failure:
        mock_server.openai_client().completions.create(model="mock", prompt="a", suffix="b")
    assert failure.value.body["param"] == "suffix"
