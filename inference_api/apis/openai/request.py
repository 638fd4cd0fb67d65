"""OpenAI request bodies (SPEC §4.2): `/v1/completions` and `/v1/chat/completions`, parsed and checked.

Normalise first (a prompt or a list of them becomes token ids; messages go
through the chat template), then validate, raising InvalidParams that names
the parameter as OpenAI spells it; the HTTP layer turns it into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from backend.messages import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    InvalidParams,
    SamplingParams,
)
from inference_api.fields import read_bool, read_integer, read_number, read_stop, read_string, within
from inference_api.fill_in_middle import fill_prompt, required_fill_tokens
from inference_api.prompts import (
    CHAT_DEFAULT_MAX_TOKENS,
    MAX_TOP_K,
    completion_budget,
    final_message,
    prompt_ids,
    prompt_list,
    read_messages,
    template_kwargs,
    text_content,
    token_id_list,
    tool_chat_ids,
)
from inference_api.reasoning import HARMONY_PREFILLED, Thinking, thoughts_first
from inference_api.router import Serving
from inference_api.structured_output import GUIDED_FIELDS, LLAMACPP_FIELDS, grammar_field, read_grammar
from inference_api.tokenizer import PromptTokenizer, stop_token_ids_of
from inference_api.tool_calls import ToolRequest, read_tool_request, with_tool_grammar
from inference_api.unsupported_fields import reject_unsupported

MAX_CHOICES = 16
GRAMMAR_FIELDS = ("response_format", *GUIDED_FIELDS, *LLAMACPP_FIELDS)
SEED_MAX = 2**64 - 1
MAX_BAD_WORDS = 300  # as many as logit_bias's entries: each is checked at every step of its row
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions API
# Grammars of JSON the answer is (a format, a forced call): a reasoning model thinks first (reasoning.py).
# The others (vLLM's guided_regex, guided_choice, guided_grammar) constrain the text as written.
ANSWER_GRAMMARS = (
    "response_format",
    "guided_json",
    "structured_outputs.json",
    "structured_outputs.json_object",
    "json_schema",
    "tool_choice",
)


@dataclass(frozen=True)
class OpenAIRequest:
    prompts: list[list[int]]  # token ids of each prompt
    n: int  # choices per prompt
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt comes back before the completion...
    prompt_texts: tuple[str, ...] = ()  # ...as this text (the prompt as sent, or its ids decoded)
    tools: ToolRequest | None = None  # chat: the tools offered, and how the answer becomes calls
    cache_salt: str | None = None  # vLLM's: only requests with the same salt (and team) share a prefix
    prompt_param: str = "prompt"  # where the prompt came from: prompt, or messages
    grammar_param: str | None = None  # where params.grammar came from (None: no grammar)
    # vLLM's stream_options.continuous_usage_stats: the usage so far in every chunk (with include_usage)
    continuous_usage: bool = False
    # chat with a reasoning model: where its prompt leaves the thoughts (reasoning.prompt_end; None: not read)
    thinking: Thinking | None = None
    # vLLM's return_tokens_as_token_ids: the logprobs name each token `token_id:{id}`, not by its text
    tokens_as_ids: bool = False
    # vLLM's return_token_ids: the prompt's token ids and each choice's generated ones beside the text
    return_token_ids: bool = False
    # vLLM's prompt_logprobs: this many alternatives beside each prompt token's own score (None: not asked)
    prompt_logprobs: int | None = None
    # completions' suffix: the fill-in-the-middle tokens that end a middle as an end token (no stop_reason)
    fill_ends: tuple[int, ...] = ()

    @property
    def logprobs(self) -> bool:
        return self.params.logprobs is not None

    @property
    def echo_logprobs(self) -> bool:
        """Completions' echo with logprobs: the prompt's tokens come first in the choice's logprobs."""
        return self.echo and self.logprobs

    def choice_requests(self) -> list[tuple[list[int], SamplingParams]]:
        """One backend request per choice, in OpenAI's order (prompt by prompt, n each).

        With a seed, choice i samples with seed + i: reproducible, yet the n choices differ.
        """
        requests = []
        for ids in self.prompts:
            for i in range(self.n):
                params = self.params
                if params.seed is not None:
                    params = replace(params, seed=(params.seed + i) % (SEED_MAX + 1))
                requests.append((ids, params))
        return requests


def parse_completion_request(data: dict[str, Any], serving: Serving) -> OpenAIRequest:
    reject_unsupported(data, "completions")
    sent = prompt_list(data.get("prompt"))
    suffix = read_string(data, "suffix")
    if suffix:
        return _fill_request(data, serving, sent, suffix)
    # vLLM's add_special_tokens: false leaves out the BOS a text prompt that writes its own would have twice
    special = read_bool(data, "add_special_tokens", True)
    prompts = [
        prompt_ids(prompt, serving, f"prompt[{i}]", add_special_tokens=special)
        for i, prompt in enumerate(sent)
    ]
    echo = read_bool(data, "echo", False)
    openai_request = _completion_request(data, serving, prompts, echo)
    if not echo:
        return openai_request
    texts = tuple(  # the prompt as sent, unless it was cut (truncate_prompt_tokens) or came as ids
        text
        if isinstance(text, str) and ids == sent_ids
        else serving.tokenizer.decode(ids, skip_special_tokens=False)
        for text, sent_ids, ids in zip(sent, prompts, openai_request.prompts, strict=True)
    )
    return replace(openai_request, echo=True, prompt_texts=texts)


def _completion_request(
    data: dict[str, Any], serving: Serving, prompts: list[list[int]], echo: bool
) -> OpenAIRequest:
    logprobs = read_integer(data, "logprobs", None, 0, MAX_LOGPROBS)
    openai_request = _common(data, serving, prompts, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs, echo)
    best_of = read_integer(data, "best_of", None, 1, MAX_CHOICES)
    if best_of is not None and best_of != openai_request.n:  # the best of more samples: not built
        raise InvalidParams("best_of", "best_of other than n is not supported by this server")
    return openai_request


def _fill_request(
    data: dict[str, Any], serving: Serving, sent: list[str | list[int]], suffix: str
) -> OpenAIRequest:
    """Completions with a `suffix`: each prompt is the code before a gap and the suffix the code after it,
    and the completion fills the gap (a code model's fill-in-the-middle, fill_in_middle.py). Both are
    plain text; a prompt may be token ids (the prefix's) and may be "" (a gap at the file's start)."""
    tokenizer = serving.tokenizer
    tokens = required_fill_tokens(tokenizer, "suffix")
    for name in ("echo", "truncate_prompt_tokens"):
        if data.get(name) not in (None, False):  # an echo would hide the gap's frame; a cut, cut it
            raise InvalidParams(name, f"{name} cannot be combined with suffix")
    after = tokenizer.encode_text(suffix)
    prompts = [
        fill_prompt(tokenizer, tokens, _prefix_ids(prompt, serving, f"prompt[{i}]"), after)
        for i, prompt in enumerate(sent)
    ]
    openai_request = _completion_request(data, serving, prompts, echo=False)
    params = openai_request.params
    ends = tuple(token for token in tokens.ends if token not in params.stop_token_ids)
    return replace(
        openai_request, params=replace(params, stop_token_ids=params.stop_token_ids + ends), fill_ends=ends
    )


def _prefix_ids(prompt: str | list[int], serving: Serving, item: str) -> list[int]:
    if isinstance(prompt, str):
        return serving.tokenizer.encode_text(prompt)
    return prompt_ids(prompt, serving, item)


def parse_chat_request(data: dict[str, Any], serving: Serving) -> OpenAIRequest:
    reject_unsupported(data, "chat")
    parallel = read_bool(data, "parallel_tool_calls", True)
    tool_request = read_tool_request(data, serving.tool_parser, parallel, serving.call_tags)
    messages, prefill = _chat_messages(data)
    kwargs = _template_kwargs(data)
    ids = tool_chat_ids(
        messages,
        tool_request,
        serving,
        "messages",
        continuation=prefill,
        template_kwargs=kwargs,
        # vLLM's: the tokens the tokenizer adds around a text (a BOS) over those the template writes
        add_special_tokens=read_bool(data, "add_special_tokens", False),
    )
    request = _common(data, serving, [ids], "messages", CHAT_DEFAULT_MAX_TOKENS, _chat_logprobs(data))
    params = with_tool_grammar(request.params, tool_request, request.grammar_param or "response_format")
    grammar_param = request.grammar_param
    if params is not request.params:
        grammar_param = "tool_choice" if tool_request.choice in ("function", "required") else "tools"
    thinking = serving.prompt_thinking(ids, prefilled=bool(prefill))
    if thinking == HARMONY_PREFILLED and grammar_param in ANSWER_GRAMMARS:
        raise InvalidParams(
            grammar_param,
            f"{grammar_param} puts the answer in a message of its own, but continue_final_message goes on "
            "in the final message the last assistant message opened (the model writes harmony)",
        )
    params = thoughts_first(params, thinking, grammar_param in ANSWER_GRAMMARS, serving.tokenizer)
    params = replace(params, prediction=_prediction(data.get("prediction"), serving))
    return replace(request, params=params, tools=tool_request, grammar_param=grammar_param, thinking=thinking)


def _prediction(value: Any, serving: Serving) -> tuple[int, ...]:
    """OpenAI's Predicted Outputs, `{"type": "content", "content": text or text parts}`: the text the answer
    is expected to be, mostly, as tokens the backend drafts from (backend/engine/prediction.py); as many as
    a row holds."""
    if value is None:
        return ()
    if not isinstance(value, dict) or value.get("type") != "content":
        raise InvalidParams("prediction", 'prediction must be {"type": "content", "content": ...}')
    if not isinstance(value.get("content"), str | list):
        raise InvalidParams(
            "prediction.content", "prediction.content must be a string or a list of text parts"
        )
    text = text_content(value["content"], "prediction.content")
    return tuple(serving.tokenizer.encode_text(text)[: serving.backend.max_seq_len])


def _chat_messages(data: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The messages and the prefill the answer goes on from (prompts.final_message); a chat answer always
    follows a generation prompt, so `add_generation_prompt: false` alone is a 400."""
    messages, prefill, generation_prompt = final_message(data, read_messages(data.get("messages")))
    if not generation_prompt:
        raise InvalidParams(
            "add_generation_prompt",
            "add_generation_prompt false is taken with continue_final_message true only (the answer "
            "goes on from the last assistant message); a chat answer starts its own turn",
        )
    return messages, prefill


def _template_kwargs(data: dict[str, Any]) -> dict[str, Any]:
    """The request's variables for the chat template: `chat_template_kwargs`, and OpenAI's
    `reasoning_effort` as gpt-oss's template reads it (a variable of that name)."""
    kwargs = template_kwargs(data)
    effort = read_string(data, "reasoning_effort")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def _chat_logprobs(data: dict[str, Any]) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs: N` as a count of alternatives (None: none)."""
    top = read_integer(data, "top_logprobs", None, 0, MAX_LOGPROBS)
    if not read_bool(data, "logprobs", False):
        if top is not None:
            raise InvalidParams("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return top or 0


def _common(
    data: dict[str, Any],
    serving: Serving,
    prompts: list[list[int]],
    prompt_param: str,
    default_max_tokens: int,
    logprobs: int | None,
    echo: bool = False,
) -> OpenAIRequest:
    context = serving.backend.max_seq_len
    default_max_tokens = int(serving.sampling_default("max_tokens", default_max_tokens))
    # max_tokens 0 only scores an echoed prompt (what lm-evaluation-harness asks for log-likelihoods).
    fewest = 0 if echo else 1
    max_tokens = read_integer(data, "max_completion_tokens", None, 1, context)
    if max_tokens is None:
        max_tokens = read_integer(data, "max_tokens", None, fewest, context)
    prompts = _truncated(data, prompts, context, default_max_tokens if max_tokens is None else max_tokens)
    longest = max(len(ids) for ids in prompts)
    max_tokens = completion_budget(serving, longest, max_tokens, default_max_tokens, prompt_param)
    top_k = read_integer(data, "top_k", int(serving.sampling_default("top_k", -1)), -1, MAX_TOP_K)
    stop = read_stop(data, "stop")
    stream = read_bool(data, "stream", False)
    prompt_logprobs = read_integer(data, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    if prompt_logprobs is not None and stream:  # as vLLM: they come whole, in the response's body
        raise InvalidParams("prompt_logprobs", "prompt_logprobs are not available when stream is true")
    params = SamplingParams(
        temperature=read_number(data, "temperature", serving.sampling_default("temperature", 1.0), 0.0, 2.0),
        top_p=read_number(data, "top_p", serving.sampling_default("top_p", 1.0), 0.0, 1.0, low_open=True),
        top_k=max(top_k, 0),  # -1 (as in vLLM) or 0: no top-k cut
        max_tokens=max_tokens,
        stop=stop,
        seed=read_integer(data, "seed", None, 0, SEED_MAX),
        ignore_eos=read_bool(data, "ignore_eos", False),
        logprobs=logprobs,
        prompt_logprobs=_prompt_scores(logprobs if echo else None, prompt_logprobs),
        presence_penalty=read_number(data, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=read_number(data, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=read_number(
            data,
            "repetition_penalty",
            serving.sampling_default("repetition_penalty", 1.0),
            0.0,
            MAX_REPETITION_PENALTY,
            low_open=True,
        ),
        min_p=read_number(data, "min_p", serving.sampling_default("min_p", 0.0), 0.0, 1.0),
        # TGI's and llama.cpp's, which clients of Aphrodite and TabbyAPI send here: 1 cuts nothing
        typical_p=read_number(data, "typical_p", 1.0, 0.0, 1.0, low_open=True),
        logit_bias=_logit_bias(data.get("logit_bias"), serving.token_id_limit),
        min_tokens=read_integer(data, "min_tokens", 0, 0, max_tokens),
        stop_token_ids=token_id_list(data.get("stop_token_ids"), serving.token_id_limit, "stop_token_ids")
        + stop_token_ids_of(stop, serving.tokenizer),
        allowed_token_ids=_allowed_token_ids(data.get("allowed_token_ids"), serving.token_id_limit),
        bad_words=_bad_words(data.get("bad_words"), serving.tokenizer),
        grammar=read_grammar(data, GRAMMAR_FIELDS),
        speculative=read_bool(data, "speculative", True),
        skip_special_tokens=read_bool(data, "skip_special_tokens", True),
        include_stop_str_in_output=read_bool(data, "include_stop_str_in_output", False),
        token_ids=read_bool(data, "return_token_ids", False),
    )
    include_usage, continuous_usage = _stream_options(data.get("stream_options"), stream)
    return OpenAIRequest(
        prompts=prompts,
        n=read_integer(data, "n", 1, 1, MAX_CHOICES),
        params=params,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        cache_salt=read_string(data, "cache_salt", non_empty=True),
        tokens_as_ids=read_bool(data, "return_tokens_as_token_ids", False),
        return_token_ids=params.token_ids,
        prompt_logprobs=prompt_logprobs,
        prompt_param=prompt_param,
        grammar_param=grammar_field(data, GRAMMAR_FIELDS),
    )


def _prompt_scores(echoed: int | None, asked: int | None) -> int | None:
    """The backend's prompt_logprobs: the alternatives the widest of an echo's logprobs and vLLM's
    prompt_logprobs needs (each takes its own count from them); None when neither scores the prompt."""
    counts = [count for count in (echoed, asked) if count is not None]
    return max(counts) if counts else None


def _allowed_token_ids(value: Any, vocab: int) -> tuple[int, ...]:
    """vLLM's allowed_token_ids: the only tokens the answer may have, a list of at least one id."""
    ids = token_id_list(value, vocab, "allowed_token_ids")
    if value is not None and not ids:
        raise InvalidParams("allowed_token_ids", "allowed_token_ids must name at least one token id")
    return ids


def _bad_words(value: Any, tokenizer: PromptTokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token ids, as vLLM tokenizes them: each word as it would start the text, and
    after a space where that is another token of the same length (a word in the middle of text)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(word, str) and word.strip() for word in value):
        raise InvalidParams("bad_words", "bad_words must be a list of words (strings with more than spaces)")
    if len(value) > MAX_BAD_WORDS:
        raise InvalidParams("bad_words", f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(value)}")
    sequences = []
    for word in value:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(sequences)


def _truncated(data: dict[str, Any], prompts: list[list[int]], context: int, answer: int) -> list[list[int]]:
    """vLLM's `truncate_prompt_tokens`: each prompt's last k tokens (cut from its start, as vLLM cuts),
    or with -1 the last that leave room in the context for the answer (`answer`: max_tokens, or the
    endpoint's default); the prompts as they are without it."""
    keep = read_integer(data, "truncate_prompt_tokens", None, -1, context)
    if keep is None:
        return prompts
    if keep == 0:
        raise InvalidParams(
            "truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or from 1 to {context}, got 0"
        )
    if keep == -1:
        keep = context - min(max(answer, 1), context - 1)
    return [ids[-keep:] for ids in prompts]


def _logit_bias(value: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: ids as strings, biases from -100 to 100."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidParams("logit_bias", "logit_bias must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidParams(
            "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(value)}"
        )
    biases = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or not int(key) < vocab:
            raise InvalidParams("logit_bias", f"logit_bias key {key!r} is not a token id below {vocab}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidParams("logit_bias", f"logit_bias[{key!r}] must be a number from -100 to 100")
        biases.append((int(key), float(bias)))
    return tuple(biases)


def _stream_options(options: Any, stream: bool) -> tuple[bool, bool]:
    """include_usage, and vLLM's continuous_usage_stats, which counts only with include_usage (as vLLM's)."""
    if options is None:
        return False, False
    if not stream:
        raise InvalidParams("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(options, dict):
        raise InvalidParams("stream_options", "stream_options must be an object")
    with within("stream_options"):
        include_usage = read_bool(options, "include_usage", False)
        return include_usage, include_usage and read_bool(options, "continuous_usage_stats", False)
