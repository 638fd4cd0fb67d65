"""Parsing and validating OpenAI requests, without a server (the mock's tokenizer and template)."""

from __future__ import annotations

import pytest

from backend.messages import BackendReady, InvalidParams
from inference_api.apis.openai.request import parse_chat_request, parse_completion_request
from inference_api.chat_template import ChatTemplate, load_chat_template
from inference_api.prompts import CHAT_DEFAULT_MAX_TOKENS
from inference_api.router import Serving
from inference_api.tokenizer import ByteTokenizer, ModelTokenizer


def serving(max_seq_len: int) -> Serving:
    ready = BackendReady(
        "mock", rows=2, max_seq_len=max_seq_len, tokenizer_path=None, device="cpu", dtype="-"
    )
    return Serving(ready, ByteTokenizer(), load_chat_template(None))


def chat(max_seq_len: int = 8192, **fields):
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_chat_request({"model": "mock", **fields}, serving(max_seq_len))


def test_chat_without_max_tokens_gets_a_bounded_answer_not_the_rest_of_the_context():
    assert chat().params.max_tokens == CHAT_DEFAULT_MAX_TOKENS < 8192
    short_context = chat(max_seq_len=100)  # the rendered prompt takes some of its 100 byte tokens
    assert short_context.params.max_tokens == 100 - len(short_context.prompts[0])
    assert chat(max_tokens=5).params.max_tokens == 5


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_only_an_assistant_message_may_come_without_content(role):
    with pytest.raises(InvalidParams) as failure:
        chat(messages=[{"role": "user", "content": "hi"}, {"role": role}])
    assert failure.value.param == "messages[1].content"
    chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])


def completion(**fields):
    return parse_completion_request({"model": "mock", "prompt": "hi", **fields}, serving(8192))


def test_best_of_is_taken_when_it_equals_n_however_n_is_written():
    assert completion(best_of=1, n=None).n == 1
    assert completion(best_of=2, n="2").n == 2
    with pytest.raises(InvalidParams) as failure:
        completion(best_of=3, n=2)
    assert failure.value.param == "best_of"


@pytest.mark.parametrize("key", ["²", "٣", "-1", "1.5", " 7", "256"])
def test_logit_bias_keys_are_ascii_token_ids_below_the_vocabulary(key):
    with pytest.raises(InvalidParams) as failure:
        completion(logit_bias={key: 1})
    assert failure.value.param == "logit_bias"
    assert completion(logit_bias={"255": -100}).params.logit_bias == ((255, -100.0),)


def test_echo_with_max_tokens_0_returns_the_prompt_and_scores_it_only_with_logprobs():
    assert completion(echo=True, max_tokens=0).params.prompt_logprobs is None
    assert completion(echo=True, max_tokens=0, logprobs=2).params.prompt_logprobs == 2
    with pytest.raises(InvalidParams) as failure:
        completion(max_tokens=0)
    assert failure.value.param == "max_tokens"


def test_an_alias_that_is_the_embedding_or_rerank_models_name_is_refused():
    from backend.messages import EmbeddingModelReady

    embedder = EmbeddingModelReady("tiny-bert", tokenizer_path="/nowhere", max_tokens=64, vocab_size=100)
    ready = BackendReady("mock", 2, 64, None, "cpu", "-", embedding_model=embedder)
    clash = Serving(ready, ByteTokenizer(), load_chat_template(None), ("smol", "tiny-bert"))
    assert "'tiny-bert' is both a --served-model-name and the --embedding-model's" in clash.name_clash()
    assert Serving(ready, ByteTokenizer(), load_chat_template(None), ("smol",)).name_clash() is None
    # The rerank model's name, too, must be its own: neither an alias nor the embedding model's.
    reranker = EmbeddingModelReady("tiny-bert", tokenizer_path="/nowhere", max_tokens=64, vocab_size=100)
    both = BackendReady("mock", 2, 64, None, "cpu", "-", embedding_model=embedder, rerank_model=reranker)
    clash = Serving(both, ByteTokenizer(), load_chat_template(None), ("smol",))
    assert "'tiny-bert' is both the --embedding-model's and the --rerank-model's" in clash.name_clash()


def test_a_tool_call_parser_named_reads_calls_in_its_format_whatever_the_template_teaches():
    ready = BackendReady("mock", 2, 64, None, "cpu", "-")
    xml = ChatTemplate("{{- '<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>' }}")
    assert Serving(ready, ByteTokenizer(), xml).tool_parser == "qwen3_coder"  # auto: the template's
    for forced in ("hermes", "llama3_json", "glm45"):
        assert Serving(ready, ByteTokenizer(), xml, tool_call_parser=forced).tool_parser == forced
    # A model that writes harmony has its calls read as harmony messages, whatever is named.
    harmony = Serving(ready, ByteTokenizer(), xml, reasoning_format="harmony", tool_call_parser="hermes")
    assert harmony.tool_parser == "harmony"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_effort": 3}, "reasoning_effort"),
        ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ],
)
def test_the_templates_variables_that_cannot_be_taken_are_a_400_naming_them(fields, param):
    with pytest.raises(InvalidParams) as refused:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **fields}, serving(64))
    assert refused.value.param == param


def bos_serving(directory) -> Serving:
    """A word-level tokenizer that puts a BOS (<s>, id 1) before every text, as Llama's and Gemma's do, and a
    template that writes its own BOS first."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    words = ["<unk>", "<s>", "hi", "there", "user:", "assistant:"]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken("<s>", special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "template.jinja").write_text(
        "<s>{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}assistant:"
    )
    ready = BackendReady(
        "bos", rows=2, max_seq_len=64, tokenizer_path=str(directory), device="cpu", dtype="-"
    )
    return Serving(
        ready,
        ModelTokenizer(str(directory)),
        load_chat_template(str(directory), chosen=str(directory / "template.jinja")),
    )


def test_add_special_tokens_puts_the_tokenizers_bos_before_a_prompt_as_vllm_does(tmp_path):
    """Completions: a text prompt gets the BOS the tokenizer adds unless add_special_tokens is false (a
    prompt that writes its own); ids are taken as they are. Chat: the template's BOS alone unless it is
    true."""
    serving = bos_serving(tmp_path)

    def completion_ids(**fields) -> list[list[int]]:
        return parse_completion_request({"model": "bos", **fields}, serving).prompts

    assert completion_ids(prompt="hi there") == [[1, 2, 3]]
    assert completion_ids(prompt="hi there", add_special_tokens=False) == [[2, 3]]
    assert completion_ids(prompt="<s> hi", add_special_tokens=False) == [[1, 2]]  # not <s> <s> hi
    assert completion_ids(prompt=[2, 3], add_special_tokens=True) == [[2, 3]]
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = parse_chat_request({"model": "bos", "messages": messages}, serving).prompts
    assert chat_ids == [[1, 4, 2, 5]]
    with_bos = parse_chat_request({"model": "bos", "messages": messages, "add_special_tokens": True}, serving)
    assert with_bos.prompts == [[1, 1, 4, 2, 5]]
    with pytest.raises(InvalidParams) as failure:
        completion_ids(prompt="hi", add_special_tokens="no")
    assert failure.value.param == "add_special_tokens"
