"""Tool calling through the official openai client, against the real model.

A required call's arguments always parse against the function's schema (the SDK's own
`pydantic_function_tool` + `parse` on several prompts); a round trip (call, tool result,
final answer) works streamed and not, and the streamed deltas add up to the same calls as
the whole answer.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest


class GetWeather(pydantic.BaseModel):
    """The current weather in a city."""

    city: str = pydantic.Field(max_length=32)
    unit: Literal["celsius", "fahrenheit"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 32}},
            "required": ["city"],
        },
    },
}

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Toronto"]


def _parse(client, **kw):
    chat = client.chat.completions
    parse = getattr(chat, "parse", None) or client.beta.chat.completions.parse
    return parse(**kw)


@pytest.mark.parametrize("city", CITIES)
def test_a_required_call_parses_into_the_functions_model(client, model_name, city):
    completion = _parse(
        client,
        model=model_name,
        messages=[{"role": "user", "content": f"What is the weather in {city} right now?"}],
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        # Greedy: the same calls every run (sampled, a small model may call again and again
        # until max_tokens cuts the last call).
        temperature=0,
        max_tokens=120,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls, choice.message
    for call in calls:
        assert call.id.startswith("call_")
        assert call.function.name == "GetWeather"
        assert isinstance(call.function.parsed_arguments, GetWeather), call
        GetWeather.model_validate_json(call.function.arguments)


def _stream_calls(stream):
    """Content, calls {index: [id, name, arguments]} and finish reason of a streamed choice."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            content += delta.content
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, [None, None, ""])
            if call.id:
                entry[0] = call.id
            if call.function and call.function.name:
                entry[1] = call.function.name
            if call.function and call.function.arguments:
                entry[2] += call.function.arguments
        if choice.finish_reason:
            finish = choice.finish_reason
    return content, calls, finish


def test_named_calls_stream_as_the_whole_answer_has_them(client, model_name):
    kw = dict(
        model=model_name,
        messages=[{"role": "user", "content": "What time is it in Tokyo, and the weather?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    whole = client.chat.completions.create(**kw)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    assert "city" in json.loads(message.tool_calls[0].function.arguments)

    content, calls, finish = _stream_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert content == ""
    assert list(calls) == [0]
    call_id, name, arguments = calls[0]
    assert call_id and call_id.startswith("call_")
    assert (name, arguments) == ("get_time", message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_a_round_trip_call_result_answer(client, model_name, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=model_name,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"}

    # The assistant's turn goes back as the SDK returned it, then the tool's result.
    messages.append(message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}
    )
    kw = dict(model=model_name, messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
              temperature=0, max_tokens=60)
    if stream:
        content, calls, finish = _stream_calls(client.chat.completions.create(stream=True, **kw))
    else:
        final = client.chat.completions.create(**kw)
        content = final.choices[0].message.content
        calls = final.choices[0].message.tool_calls or {}
        finish = final.choices[0].finish_reason
    assert finish in ("stop", "length")
    assert not calls
    assert content and content.strip(), content
    # The model read the tool's result.
    assert "21" in content, content


def test_tool_errors_are_400s(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "hi"}],
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.body["param"] == "tool_choice"
