"""Log-probabilities, echo and prompt scoring, penalties and biases through the official client (issue 16)."""

from __future__ import annotations

import openai
import pytest
import requests
import torch

from tests.frontend.test_openapi_e2e import documented
from tests.openai.conftest import MODEL

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def log_softmax_along(model, ids: list[int]) -> torch.Tensor:
    """transformers' forward over the sequence: [len, vocab] log-probabilities of the next token."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def greedy_ids(model, prompt_ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=count,
        )
    return output[0, len(prompt_ids) :].tolist()


def chat_prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_logprobs_are_the_models_log_softmax_streamed_and_not(client, tokenizer, reference_model):
    request = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**request).choices[0].logprobs.content
    chunks = client.chat.completions.create(stream=True, **request)
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    prompt_ids = chat_prompt_ids(tokenizer)
    generated = greedy_ids(reference_model, prompt_ids, 8)
    reference = log_softmax_along(reference_model, prompt_ids + generated)
    assert len(whole) == len(streamed) == len(generated)  # EOS, when it came, included
    for i, (entry, streamed_entry, token_id) in enumerate(zip(whole, streamed, generated, strict=True)):
        expected = reference[len(prompt_ids) - 1 + i]
        assert entry.token == tokenizer.decode([token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == pytest.approx(float(expected[token_id]), abs=1e-4)
        assert [top.token for top in entry.top_logprobs][0] == entry.token  # greedy took the best
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx(
            expected.topk(3).values.tolist(), abs=1e-4
        )
        # The second request reuses the first's cached prompt: its keys and values were computed in
        # another batch shape, so the last bits may differ.
        assert streamed_entry.token == entry.token
        assert streamed_entry.logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_a_token_that_is_part_of_a_character_has_the_bytes_of_that_part(client, tokenizer):
    """OpenAI's `bytes` are what a token stands for, so that an emoji's tokens' bytes join into it: the
    first of its tokens (made the only one allowed) gives the first bytes of the emoji, where its text
    alone is a replacement character."""
    emoji = "\U0001f389".encode()
    first = tokenizer(emoji.decode(), add_special_tokens=False).input_ids[0]
    assert tokenizer.decode([first]) == "\ufffd"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        extra_body={"allowed_token_ids": [first]},
    )
    [entry] = chat.choices[0].logprobs.content
    assert 0 < len(entry.bytes) < len(emoji) and emoji.startswith(bytes(entry.bytes))
    top = entry.top_logprobs[0]  # the model's choice without the mask: a whole word
    assert bytes(top.bytes).decode() == top.token


def test_completion_logprobs_in_the_legacy_shape_streamed_and_not(client, tokenizer, reference_model):
    request = dict(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=2, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**request).choices[0]
    chunks = list(client.completions.create(stream=True, **request))
    prompt_ids = tokenizer(PROMPT).input_ids
    generated = greedy_ids(reference_model, prompt_ids, 6)
    reference = log_softmax_along(reference_model, prompt_ids + generated)
    logprobs = whole.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in generated]
    assert logprobs.token_logprobs == pytest.approx(
        [float(reference[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(generated)], abs=1e-4
    )
    assert all(
        len(top) == 2 and max(top.values()) == lp
        for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True)
    )
    # Offsets point into the returned text.
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert "".join(logprobs.tokens) == whole.text
    streamed_tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    streamed_offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed_tokens == logprobs.tokens and streamed_offsets == logprobs.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt_without_generating(client, tokenizer, reference_model):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = result.choices[0]
    prompt_ids = tokenizer(PROMPT).input_ids
    reference = log_softmax_along(reference_model, prompt_ids)
    assert choice.text == PROMPT and result.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in prompt_ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    expected = [float(reference[i, t]) for i, t in enumerate(prompt_ids[1:])]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_echo_puts_the_prompt_before_the_completion_and_scores_both(client, tokenizer):
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0
    )
    choice = result.choices[0]
    prompt_tokens = len(tokenizer(PROMPT).input_ids)
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(choice.logprobs.tokens) == prompt_tokens + 3
    assert all(isinstance(lp, float) and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])


def test_logit_bias_bans_and_forces_tokens(client, tokenizer):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    first = tokenizer(greedy.choices[0].text, add_special_tokens=False).input_ids[0]
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != greedy.choices[0].text
    forced_id = tokenizer(" banana", add_special_tokens=False).input_ids[0]
    forced = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=1.0, seed=1, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].text == tokenizer.decode([forced_id] * 3)


def test_frequency_penalty_breaks_a_repetition(client):
    def distinct_tokens(**penalty) -> int:
        result = client.completions.create(
            model=MODEL,
            prompt="one one one one one one one one",
            max_tokens=12,
            temperature=0,
            logprobs=0,
            **penalty,
        )
        return len(set(result.choices[0].logprobs.tokens))

    assert distinct_tokens(frequency_penalty=2.0) > distinct_tokens()
    assert distinct_tokens(extra_body={"repetition_penalty": 2.0}) > distinct_tokens()


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"12": 101}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"chat_template": "{{ messages[0].content }}"}, "chat_template"),
        ({"documents": [{"text": "a"}]}, "documents"),
        ({"echo": True}, "echo"),
        ({"priority": 1}, "priority"),
        ({"logits_processors": ["my.module.Processor"]}, "logits_processors"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ],
)
def test_unsupported_or_bad_chat_fields_are_a_400_naming_them(client, fields, param):
    with pytest.raises(openai.BadRequestError) as failure:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=fields)
    assert failure.value.body["param"] == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"priority": -5}, "priority"),
    ],
)
def test_unsupported_completion_fields_are_a_400_naming_them(client, fields, param):
    with pytest.raises(openai.BadRequestError) as failure:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body=fields)
    assert failure.value.body["param"] == param


def test_fields_that_ask_for_nothing_are_accepted(client):
    nothing = {"use_beam_search": False, "priority": 0, "documents": [], "echo": False}
    nothing["logits_processors"] = []
    result = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        response_format={"type": "text"},
        tools=[],
        metadata={"a": "b"},
        store=False,
        extra_body=nothing,
    )
    assert result.choices[0].finish_reason in ("stop", "length")


def test_tokenize_and_detokenize_as_vllm_shapes_them(server, tokenizer):
    tokens = requests.post(
        f"{server.url}/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=30
    ).json()
    assert tokens["tokens"] == tokenizer(PROMPT).input_ids and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 1024 and tokens["token_strs"] is None
    chat = requests.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert chat["tokens"] == chat_prompt_ids(tokenizer)
    text = requests.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()
    assert text == {"prompt": PROMPT, "content": PROMPT}  # vLLM's name and llama-server's
    bad = requests.post(f"{server.url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong_model = requests.post(f"{server.url}/tokenize", json={"model": "gpt-4", "prompt": "hi"}, timeout=30)
    assert wrong_model.status_code == 404


def test_tokenize_gives_the_prompt_chat_answers_from(server, client, tokenizer):
    """/tokenize takes chat's own fields (tools, a final message to continue, no generation prompt), so
    that its count is the prompt_tokens chat reports for the same request, as vLLM's does."""

    def tokenized(**fields) -> list[int]:
        response = requests.post(f"{server.url}/tokenize", json=fields, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    def template_ids(add_generation_prompt: bool, after: str = "") -> list[int]:
        text = tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return tokenizer(text + after, add_special_tokens=False).input_ids

    prefill = "The capital is"
    continued = {
        "messages": [*MESSAGES, {"role": "assistant", "content": prefill}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    assert tokenized(**continued) == template_ids(True, prefill)
    assert tokenized(messages=MESSAGES, add_generation_prompt=False) == template_ids(False)
    tool = {"type": "function", "function": {"name": "capital_of", "parameters": {"type": "object"}}}
    with_tools = {"messages": MESSAGES, "tools": [tool]}
    assert len(tokenized(**with_tools)) > len(template_ids(True))  # the tools are in the prompt
    for fields in (continued, with_tools):
        others = {name: value for name, value in fields.items() if name != "messages"}
        answer = client.chat.completions.create(
            model=MODEL, messages=fields["messages"], max_tokens=1, extra_body=others
        )
        assert answer.usage.prompt_tokens == len(tokenized(**fields))
    both = requests.post(
        f"{server.url}/tokenize", json={**continued, "add_generation_prompt": True}, timeout=30
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "add_generation_prompt"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, tokenizer):
    """vLLM's truncate_prompt_tokens: k keeps a prompt's last k tokens (its text, as sent, comes back cut
    under echo), and -1 the last that leave the answer room in the 1,024-token context, where the whole
    prompt is a 400."""
    ids = tokenizer(PROMPT).input_ids
    ask = dict(model=MODEL, max_tokens=4, temperature=0)
    cut = client.completions.create(**ask, prompt=PROMPT, echo=True, extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    assert cut.choices[0].text == client.completions.create(**ask, prompt=ids[-3:], echo=True).choices[0].text
    assert cut.choices[0].text.startswith(tokenizer.decode(ids[-3:]))
    chat = client.chat.completions.create(**ask, messages=MESSAGES, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    long_prompt = "one two three " * 400
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**ask, prompt=long_prompt)
    fitted = client.completions.create(**ask, prompt=long_prompt, extra_body={"truncate_prompt_tokens": -1})
    assert fitted.usage.prompt_tokens == 1024 - 4
    with pytest.raises(openai.BadRequestError) as zero:
        client.completions.create(**ask, prompt=PROMPT, extra_body={"truncate_prompt_tokens": 0})
    assert zero.value.body["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_ends_the_text_with_the_stop(client, stream):
    """vLLM's include_stop_str_in_output: the text ends with the stop string it stopped at (by default
    it ends before it), streamed and not; what the model wrote after the stop is cut either way."""
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    free = client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].text
    stop = free.split()[1]  # a word the answer goes on past
    at = free.index(stop)

    def text(**extra) -> str:
        if not stream:
            return client.completions.create(**ask, stop=[stop], extra_body=extra).choices[0].text
        chunks = client.completions.create(**ask, stop=[stop], stream=True, extra_body=extra)
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    assert text() == free[:at]
    assert text(include_stop_str_in_output=True) == free[: at + len(stop)]


def test_stop_reason_names_the_stop_string_or_stop_token_that_ended_a_choice(client, tokenizer):
    """vLLM's stop_reason, beside finish_reason: the stop string (whole and in the last chunk), the stop
    token's id, or null for max_tokens and an end token."""
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0)
    free = client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0]
    assert free.finish_reason == "length" and free.stop_reason is None
    stop = free.text.split()[1]
    by_string = client.completions.create(**ask, stop=[stop]).choices[0]
    assert by_string.finish_reason == "stop" and by_string.stop_reason == stop
    chunks = list(client.completions.create(**ask, stop=[stop], stream=True))
    assert [c.choices[0].stop_reason for c in chunks if c.choices][-1] == stop
    second = tokenizer(free.logprobs.tokens[1], add_special_tokens=False).input_ids[0]
    by_token = client.completions.create(**ask, extra_body={"stop_token_ids": [second]}).choices[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == second
    ended = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].stop_reason is None  # <|im_end|>


def test_return_tokens_as_token_ids_names_each_token_by_its_id(client, tokenizer, reference_model):
    """vLLM's return_tokens_as_token_ids: the logprobs name tokens `token_id:{id}` (alternatives too),
    while offsets and bytes stay those of the text."""
    asked = {"return_tokens_as_token_ids": True}
    prompt_ids = tokenizer(PROMPT).input_ids
    generated = greedy_ids(reference_model, prompt_ids, 4)
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, extra_body=asked
    ).choices[0]
    logprobs = completion.logprobs
    assert logprobs.tokens == [f"token_id:{token_id}" for token_id in generated]
    assert all(name.startswith("token_id:") for top in logprobs.top_logprobs for name in top)
    texts = [tokenizer.decode([token_id]) for token_id in generated]
    assert logprobs.text_offset == [sum(len(text) for text in texts[:i]) for i in range(4)]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        extra_body=asked,
    ).choices[0]
    chat_generated = greedy_ids(reference_model, chat_prompt_ids(tokenizer), 4)
    entries = chat.logprobs.content
    assert [entry.token for entry in entries] == [f"token_id:{t}" for t in chat_generated[: len(entries)]]
    assert [bytes(entry.bytes).decode() for entry in entries] == [
        tokenizer.decode([t]) for t in chat_generated[: len(entries)]
    ]


def assert_vllm_prompt_logprobs(scores, prompt_ids: list[int], top: int, reference, tokenizer) -> None:
    """vLLM's prompt_logprobs against transformers' forward: null for the first token, then each
    token's own score and vocabulary rank, and the `top` most likely ranked 1 to top."""
    assert len(scores) == len(prompt_ids) and scores[0] is None
    for i, token_id in enumerate(prompt_ids[1:]):
        expected = reference[i]
        top_values, top_ids = expected.topk(top)
        assert set(scores[i + 1]) == {str(t) for t in (token_id, *top_ids.tolist())}
        own = scores[i + 1][str(token_id)]
        assert own["logprob"] == pytest.approx(float(expected[token_id]), abs=1e-4)
        assert own["rank"] == int((expected >= expected[token_id]).sum())  # as likely or more, itself too
        assert own["decoded_token"] == tokenizer.decode([token_id])
        for rank, (t, value) in enumerate(zip(top_ids.tolist(), top_values.tolist(), strict=True), 1):
            if t != token_id:
                assert scores[i + 1][str(t)]["logprob"] == pytest.approx(value, abs=1e-4)
                assert scores[i + 1][str(t)]["rank"] == rank


def test_prompt_logprobs_score_each_prompt_token_as_vllm_shapes_them(client, tokenizer, reference_model):
    """vLLM's prompt_logprobs: on each completion choice, and once beside a chat's choices; the text
    and the choice's own logprobs are what they are without it."""
    prompt_ids = tokenizer(PROMPT).input_ids
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    plain = client.completions.create(**ask).choices[0]
    scored = client.completions.create(**ask, n=2, extra_body={"prompt_logprobs": 2})
    reference = log_softmax_along(reference_model, prompt_ids)
    for choice in scored.choices:
        assert choice.text == plain.text and choice.logprobs is None
        assert_vllm_prompt_logprobs(choice.prompt_logprobs, prompt_ids, 2, reference, tokenizer)
    assert "prompt_logprobs" not in plain.model_extra  # not asked for: not there

    chat_ids = chat_prompt_ids(tokenizer)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    assert chat.usage.prompt_tokens == len(chat_ids)
    chat_reference = log_softmax_along(reference_model, chat_ids)
    assert_vllm_prompt_logprobs(chat.prompt_logprobs, chat_ids, 0, chat_reference, tokenizer)


def test_prompt_logprobs_beside_an_echos_logprobs_give_each_its_own_alternatives(client, tokenizer):
    """Echo with logprobs 1 scores the prompt in the choice's logprobs with one alternative a token,
    while prompt_logprobs 3 asks the same scores with three."""
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, extra_body={"prompt_logprobs": 3}
    )
    prompt_ids = tokenizer(PROMPT).input_ids
    echoed, scores = result.choices[0].logprobs, result.choices[0].prompt_logprobs
    assert echoed.top_logprobs[0] is None and all(len(top) == 1 for top in echoed.top_logprobs[1:])
    assert len(scores) == len(prompt_ids) and scores[0] is None
    for token_id, logprob, scored in zip(prompt_ids[1:], echoed.token_logprobs[1:], scores[1:], strict=True):
        assert 3 <= len(scored) <= 4  # the prompt's token, and the three most likely (it may be one)
        assert scored[str(token_id)]["logprob"] == pytest.approx(logprob, abs=1e-6)


@pytest.mark.parametrize(
    "fields", [{"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1, "stream": True}]
)
def test_prompt_logprobs_out_of_range_or_streamed_are_a_400(server, fields):
    for path, body in (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": MESSAGES})):
        response = requests.post(
            f"{server.url}/v1/{path}", json={"model": MODEL, "max_tokens": 2, **body, **fields}, timeout=60
        )
        assert response.status_code == 400, response.text
        assert documented(response, "post", f"/v1/{path}")["error"]["param"] == "prompt_logprobs"


def test_answers_with_prompt_logprobs_and_token_ids_are_as_the_openapi_document_says(server):
    for path, body in (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": MESSAGES})):
        ask = {"model": MODEL, "max_tokens": 2, "prompt_logprobs": 1, "return_token_ids": True, **body}
        response = requests.post(f"{server.url}/v1/{path}", json=ask, timeout=60)
        assert response.status_code == 200, response.text
        answer = documented(response, "post", f"/v1/{path}")
        prompt_fields = answer if path == "chat/completions" else answer["choices"][0]
        assert "prompt_logprobs" in prompt_fields and "prompt_token_ids" in prompt_fields
        assert "token_ids" in answer["choices"][0]
        del ask["prompt_logprobs"]
        streamed = requests.post(f"{server.url}/v1/{path}", json={**ask, "stream": True}, timeout=60)
        chunks = documented(streamed, "post", f"/v1/{path}")
        first = chunks[0] if path == "chat/completions" else chunks[0]["choices"][0]
        assert first["prompt_token_ids"]


def test_allowed_token_ids_are_the_only_tokens_an_answer_has(client, tokenizer):
    """vLLM's allowed_token_ids, on completions (sampled) and chat (greedy): every token is one of them."""
    allowed = [tokenizer(word, add_special_tokens=False).input_ids[0] for word in (" yes", " no", " maybe")]
    extra = {"allowed_token_ids": allowed, "return_tokens_as_token_ids": True}
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1, seed=3, logprobs=0, extra_body=extra
    ).choices[0]
    ids = [int(name.removeprefix("token_id:")) for name in completion.logprobs.tokens]
    assert len(ids) == 8 and set(ids) <= set(allowed)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, extra_body=extra
    ).choices[0]
    chat_ids = [int(entry.token.removeprefix("token_id:")) for entry in chat.logprobs.content]
    assert len(chat_ids) == 3 and set(chat_ids) <= set(allowed)


@pytest.mark.parametrize(
    "fields",
    [
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
        {"allowed_token_ids": [10**9]},
        {"allowed_token_ids": [5], "response_format": {"type": "json_object"}},
    ],
)
def test_allowed_token_ids_that_allow_nothing_or_fight_a_grammar_are_a_400(client, fields):
    with pytest.raises(openai.BadRequestError) as failure:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=fields)
    assert failure.value.body["param"] == "allowed_token_ids"


def test_bad_words_keep_a_word_out_of_the_answer(client):
    """vLLM's bad_words through completions and chat: the word the greedy answer has is never written,
    and the text goes on without it."""
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert "Paris" in client.completions.create(**ask).choices[0].text
    banned = client.completions.create(**ask, extra_body={"bad_words": ["Paris"]}).choices[0]
    assert "Paris" not in banned.text and banned.finish_reason == "length"
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    assert "Paris" in client.chat.completions.create(**chat).choices[0].message.content
    answer = client.chat.completions.create(**chat, extra_body={"bad_words": ["Paris"]}).choices[0]
    assert "Paris" not in answer.message.content and answer.message.content


@pytest.mark.parametrize(
    "fields",
    [
        {"bad_words": "Paris"},
        {"bad_words": [" "]},
        {"bad_words": ["Paris", 3]},
        {"bad_words": ["Paris"], "response_format": {"type": "json_object"}},
    ],
)
def test_bad_words_that_are_not_words_or_fight_a_grammar_are_a_400(client, fields):
    with pytest.raises(openai.BadRequestError) as failure:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=fields)
    assert failure.value.body["param"] == "bad_words"


def test_return_token_ids_gives_the_prompts_and_the_answers_ids_whole_and_streamed(
    client, tokenizer, reference_model
):
    """vLLM's return_token_ids: a completion choice's prompt_token_ids and token_ids (a stream's prompt
    ids on its first chunk, the ids of each chunk's tokens on it); chat's prompt ids beside the choices
    (a stream's on the chunk that opens the choice)."""
    prompt_ids = tokenizer(PROMPT).input_ids
    generated = greedy_ids(reference_model, prompt_ids, 6)
    extra = {"return_token_ids": True, "ignore_eos": True}
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=extra)
    whole = client.completions.create(**ask).choices[0]
    assert whole.prompt_token_ids == prompt_ids and whole.token_ids == generated
    chunks = [chunk for chunk in client.completions.create(stream=True, **ask) if chunk.choices]
    assert chunks[0].choices[0].prompt_token_ids == prompt_ids
    assert all(chunk.choices[0].prompt_token_ids is None for chunk in chunks[1:])
    assert [token for chunk in chunks for token in chunk.choices[0].token_ids] == generated
    assert "token_ids" not in client.completions.create(**{**ask, "extra_body": {}}).choices[0].model_extra

    chat_ids = chat_prompt_ids(tokenizer)
    chat_ask = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, extra_body=extra)
    chat = client.chat.completions.create(**chat_ask)
    answer_ids = chat.choices[0].token_ids
    assert chat.prompt_token_ids == chat_ids and len(answer_ids) == chat.usage.completion_tokens
    assert answer_ids == greedy_ids(reference_model, chat_ids, 8)[: len(answer_ids)]
    assert tokenizer.decode(answer_ids, skip_special_tokens=True) == chat.choices[0].message.content
    streamed = list(client.chat.completions.create(stream=True, **chat_ask))
    assert streamed[0].prompt_token_ids == chat_ids
    assert [
        t for chunk in streamed if chunk.choices for t in chunk.choices[0].model_extra.get("token_ids") or []
    ] == (answer_ids)


def test_min_p_and_penalties_leave_greedy_text_alone_when_neutral(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    neutral = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"min_p": 0.0, "repetition_penalty": 1.0},
        presence_penalty=0.0,
        frequency_penalty=0.0,
    )
    assert plain.choices[0].text == neutral.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_that_is_a_special_token_stops_there(client, tokenizer, stream):
    # The end-of-turn token is left out of generated text, so no text can match the stop string:
    # the row stops on the token itself. EOS is ignored, so only the stop string can end it.
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    request = dict(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, logprobs=0)
    free = client.completions.create(**request, extra_body={"ignore_eos": True}).choices[0]
    assert "<|im_end|>" in free.logprobs.tokens  # the model does end its turn within 60 tokens
    end = free.logprobs.tokens.index("<|im_end|>")
    stopped = client.completions.create(
        **request, stop=["<|im_end|>"], extra_body={"ignore_eos": True}, stream=stream
    )
    if stream:
        chunks = list(stopped)
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = stopped.choices[0]
        text, tokens, finish = choice.text, choice.logprobs.tokens, choice.finish_reason
    assert finish == "stop" and tokens == free.logprobs.tokens[: end + 1]
    assert text == "".join(free.logprobs.tokens[:end]) and "<|im_end|>" not in text


def test_a_chat_turn_reuses_the_cached_history_and_says_so_in_usage(client, server):
    system = {
        "role": "system",
        "content": "You are a helpful assistant who answers in one short sentence. " * 4,
    }
    first = [system, {"role": "user", "content": "What is the capital of Italy?"}]
    answer = client.chat.completions.create(model=MODEL, messages=first, temperature=0, max_tokens=12)
    before = server.metric("inference_prompt_tokens_cached_total")
    second = [*first, {"role": "assistant", "content": answer.choices[0].message.content}]
    second.append({"role": "user", "content": "And of Spain?"})
    result = client.chat.completions.create(model=MODEL, messages=second, temperature=0, max_tokens=12)
    cached = result.usage.prompt_tokens_details.cached_tokens
    assert answer.usage.prompt_tokens <= cached < result.usage.prompt_tokens  # the first turn at least
    assert server.metric("inference_prompt_tokens_cached_total") - before == cached
