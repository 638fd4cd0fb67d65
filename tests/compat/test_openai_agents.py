"""openai-agents, unchanged, on its default model (OpenAI's Responses API), against the real default model
through the JWT proxy with a token as its api_key: an Agent with a @function_tool calls it with valid
arguments and ends with a text answer, run whole and streamed; an output_type comes back as that type.

Tracing is off: the SDK would post every run's trace to api.openai.com.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import agents
import jsonschema
import pytest
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from agents.models.openai_provider import OpenAIProvider
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.compat.conftest import MODEL
from tests.proxy.conftest import token

# The first turn must call the tool (tool_choice required); the tool is then withdrawn (is_enabled), since,
# greedy and offered it again, this small model calls it again and again until max_turns. With these
# instructions it answers the tool's result in text.
INSTRUCTIONS = (
    "You answer questions about the weather. Call get_weather to find it out, then answer in one sentence."
)
QUESTION = "What is the weather in Paris?"
RESPONSES_CALLS = 'inference_requests_total{endpoint="/v1/responses",status="200"}'


@pytest.fixture(autouse=True, scope="module")
def no_tracing() -> Iterator[None]:
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


def run_config(proxy) -> RunConfig:
    """The SDK's own provider, which uses the Responses API unless told otherwise, on the proxy's URL."""
    client = AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=token(), max_retries=0, timeout=300)
    return RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)


def responses_answered(server) -> float:
    """How many /v1/responses requests the server has answered 200 (no sample before the first)."""
    try:
        return server.metric(RESPONSES_CALLS)
    except AssertionError:
        return 0.0


def weather_agent() -> tuple[Agent, list[str]]:
    """The agent, and the cities its tool was called with."""
    cities: list[str] = []

    @function_tool(is_enabled=lambda context, agent: not cities)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is sunny and 22 degrees in {city}."

    settings = ModelSettings(tool_choice="required", temperature=0, max_tokens=60)
    agent = Agent(
        name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model=MODEL, model_settings=settings
    )
    return agent, cities


def check_run(agent: Agent, cities: list[str], result) -> None:
    """One call with arguments that fit the tool's schema, its output, then a final text answer."""
    assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    call = result.new_items[0].raw_item
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), agent.tools[0].params_json_schema)
    assert len(cities) == 1 and cities[0].strip()
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert "<tool_call>" not in result.final_output


def test_an_agent_calls_its_tool_and_answers_in_text(server, proxy):
    agent, cities = weather_agent()
    before = responses_answered(server)
    result = asyncio.run(Runner.run(agent, QUESTION, run_config=run_config(proxy), max_turns=3))
    check_run(agent, cities, result)
    assert responses_answered(server) == before + 2  # both turns went to /v1/responses


def test_a_streamed_run_calls_the_tool_and_answers_in_text(server, proxy):
    agent, cities = weather_agent()

    async def streamed():
        result = Runner.run_streamed(agent, QUESTION, run_config=run_config(proxy), max_turns=3)
        events = [event async for event in result.stream_events()]
        return result, events

    result, events = asyncio.run(streamed())
    check_run(agent, cities, result)
    raw = [event.data.type for event in events if event.type == "raw_response_event"]
    assert raw.count("response.completed") == 2
    assert "response.function_call_arguments.delta" in raw and "response.output_text.delta" in raw
    named = [event.name for event in events if event.type == "run_item_stream_event"]
    assert named == ["tool_called", "tool_output", "message_output_created"]


class Place(BaseModel):
    city: str
    country: str


def test_an_output_type_comes_back_as_that_type(proxy):
    settings = ModelSettings(temperature=0, max_tokens=60)
    agent = Agent(
        name="places", instructions="Name a city.", output_type=Place, model=MODEL, model_settings=settings
    )
    result = asyncio.run(
        Runner.run(agent, "Which city is the capital of France?", run_config=run_config(proxy))
    )
    assert isinstance(result.final_output, Place) and result.final_output.city.strip()
