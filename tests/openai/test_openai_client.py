"""The official openai client against a real server on the default model (SPEC §4.2)."""

from __future__ import annotations

import openai
import pytest

from tests.openai.conftest import MODEL

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


def streamed_chat(client, **kwargs) -> tuple[str, str | None, list]:
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, (finish[-1] if finish else None), chunks


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list()] == [MODEL]


def test_chat_streamed_equals_not_streamed_for_the_same_greedy_request(client, tokenizer):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40)
    text, finish, chunks = streamed_chat(client, messages=MESSAGES, temperature=0, max_tokens=40)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text and len(text) > 10
    assert whole.choices[0].finish_reason == finish
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks) > 5  # it really streamed in pieces
    # The chat template was applied as transformers applies it.
    template_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    template_ids = template_ids["input_ids"] if hasattr(template_ids, "keys") else template_ids
    assert whole.usage.prompt_tokens == len(template_ids)


def test_completions_streamed_equals_not_streamed(client):
    prompt = "The three laws of robotics are"
    whole = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=30)
    stream = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=30, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_usage_counts_prompt_tokens_as_the_tokenizer_does_and_completion_tokens_as_generated(
    client, tokenizer
):
    prompt = "Write a list of fruits:"
    result = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=17, temperature=0.7, seed=3, extra_body={"ignore_eos": True}
    )
    assert result.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert result.usage.completion_tokens == 17
    assert result.usage.total_tokens == result.usage.prompt_tokens + 17
    assert result.choices[0].finish_reason == "length"


def test_finish_reason_is_stop_at_eos_and_length_at_max_tokens(client):
    short = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=200
    )
    assert short.choices[0].finish_reason == "stop"
    assert short.usage.completion_tokens < 200
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_and_never_appears_in_it(client, stream):
    prompt = "Once upon a time, in a small village by the sea,"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    assert stop.strip(), full
    if stream:
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=[stop], stream=True
            )
        )
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=stop
        ).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert text == full[: full.index(stop)]
    assert stop not in text and finish == "stop"


def test_n_choices_each_in_its_own_row_reproducible_with_a_seed(client):
    def ask():
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=3, seed=11, temperature=1.0, max_tokens=20
        )

    first, again = ask(), ask()
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # different seeds per choice
    assert 3 <= first.usage.completion_tokens <= 3 * 20


def test_streamed_choices_and_usage_chunk(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hello",
            n=2,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert all(texts.values())


def test_continuous_usage_stats_put_the_counts_so_far_in_every_chunk(client):
    """vLLM's extension: with include_usage, every chunk carries the tokens so far, not null."""
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 6
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    # The role's chunk goes once the first token is in: it counts that one.
    assert counts == sorted(counts) and counts[0] == 1 and counts[-2] == 6
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {final.usage.prompt_tokens}
    assert all(
        chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        for chunk in chunks
    )
    # Without include_usage it asks for nothing, as in vLLM.
    plain = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=2,
        stream=True,
        stream_options={"continuous_usage_stats": True},
    )
    assert all(chunk.usage is None for chunk in plain)


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_keeps_their_text_in_the_answer(client, tokenizer, stream):
    """vLLM's extension: the answer leaves special tokens out unless asked to keep them (a client that
    reads a template's markers). <|im_start|> is a special token of the default model, not its EOS."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    asked = dict(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(start): 100})

    def text(**extra) -> str:
        if not stream:
            return client.completions.create(**asked, **extra).choices[0].text
        chunks = client.completions.create(**asked, **extra, stream=True)
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    assert text(extra_body={"skip_special_tokens": False}) == "<|im_start|>" * 3
    assert text() == ""


def test_top_k_extension_and_user_field_are_accepted(client):
    result = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=4, user="alice", extra_body={"top_k": 1}, temperature=1.5
    )
    greedy = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    assert result.choices[0].text == greedy.choices[0].text  # top_k 1 is greedy whatever the temperature


def test_typical_p_extension_cuts_as_tgis_does(client):
    """At 0.001 it keeps one token a step (the one nearest the entropy): every seed draws the same, where
    without it two seeds differ. Chat and completions alike."""
    sampled = dict(model=MODEL, max_tokens=12, temperature=1.0)
    for typical_p, texts in ((0.001, 1), (None, 2)):
        extra = {"typical_p": typical_p} if typical_p else {}
        chats = {
            client.chat.completions.create(
                **sampled,
                messages=[{"role": "user", "content": "Tell me a story."}],
                seed=seed,
                extra_body=extra,
            )
            .choices[0]
            .message.content
            for seed in (1, 2)
        }
        completions = {
            client.completions.create(**sampled, prompt="Once upon a time", seed=seed, extra_body=extra)
            .choices[0]
            .text
            for seed in (1, 2)
        }
        assert len(chats) == len(completions) == texts


def test_continue_final_message_goes_on_from_the_last_assistant_text(client, tokenizer):
    """vLLM's continue_final_message: the prompt is the conversation before the last message, its
    generation prompt, then that message's text, and the answer is what the model writes after it."""
    prefill = "The first colour is"
    messages = [*MESSAGES, {"role": "assistant", "content": prefill}]
    asked = {"continue_final_message": True, "add_generation_prompt": False}
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, extra_body=asked
    )
    opened = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = opened + prefill
    assert answer.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)
    written = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    assert answer.choices[0].message.content == written.choices[0].text != ""
    refusals = [
        ({"continue_final_message": True}, "add_generation_prompt"),  # vLLM's 400 too: both would be true
        ({"add_generation_prompt": False}, "add_generation_prompt"),  # the answer would not be its own turn
    ]
    for fields, param in refusals:
        with pytest.raises(openai.BadRequestError) as failure:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=fields)
        assert failure.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as failure:  # nothing of the assistant's to go on from
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=asked)
    assert failure.value.body["param"] == "messages[0]"


DEEP_CALL = {
    "role": "assistant",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}],
}
DEEP_CALL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "x"}
BAD_REQUESTS = {
    "messages[0].role": dict(messages=[{"role": "wizard", "content": "hi"}]),
    "messages": dict(messages=[]),
    "temperature": dict(messages=MESSAGES, temperature=2.5),
    "top_p": dict(messages=MESSAGES, top_p=0),
    "n": dict(messages=MESSAGES, n=0),
    "max_tokens": dict(messages=MESSAGES, max_tokens=0),
    "stop": dict(messages=MESSAGES, stop=["a", "b", "c", "d", "e"]),
    "seed": dict(messages=MESSAGES, seed="abc"),
    "stream_options": dict(messages=MESSAGES, stream_options={"include_usage": True}),
    # JSON in a string nested past Python's recursion limit: once a 500
    "messages[1].tool_calls[0].function.arguments": dict(messages=[*MESSAGES, DEEP_CALL, DEEP_CALL_RESULT]),
    "guided_json": dict(messages=MESSAGES, extra_body={"guided_json": "[" * 100_000}),
}


@pytest.mark.parametrize("param", list(BAD_REQUESTS))
def test_bad_input_raises_bad_request_naming_the_parameter(client, param):
    with pytest.raises(openai.BadRequestError) as failure:
        client.chat.completions.create(model=MODEL, **BAD_REQUESTS[param])
    assert failure.value.body["param"] == param
    assert failure.value.body["type"] == "invalid_request_error"


def test_missing_messages_and_a_prompt_longer_than_the_context(client):
    with pytest.raises(openai.BadRequestError) as failure:
        client.chat.completions.create(model=MODEL, messages=None)  # type: ignore[arg-type]
    assert failure.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as failure:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1100}])
    assert failure.value.body["param"] == "messages"
    assert failure.value.body["code"] == "context_length_exceeded"
    assert "1024" in failure.value.body["message"]


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as failure:
        client.completions.create(model="gpt-4", prompt="hi")
    assert failure.value.body["code"] == "model_not_found"
