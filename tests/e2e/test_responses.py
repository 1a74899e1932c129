"""The Responses API (POST /v1/responses) through the official openai client.

`client.responses.create` streamed (raw events and the `responses.stream` helper) gives the
greedy text of the non-streaming call, with OpenAI's event order and numbering; a cut answer
is `incomplete`; `instructions` and a conversation of input items give exactly what the same
messages give through chat completions (text and prompt tokens); `client.responses.parse`
with a Pydantic model gives a parsed object, streamed too; stored-state fields are refused and
the fields that do not apply are named back. Function tools: a required call parses into the
function's Pydantic model; a named call streamed (raw events, the stream helper) is the
whole call; a round trip sends the answer's output items and the call's output back, giving
the prompt chat completions give for the same conversation, streamed and not alike.
"""

from __future__ import annotations

import json
from typing import Annotated, List, Literal

import openai
import pydantic
import pytest

HELLO = "Say hello."


def _kw(model_name, **extra):
    kw = dict(model=model_name, input=HELLO, max_output_tokens=64, temperature=0)
    kw.update(extra)
    return kw


def test_create_streamed_and_not_give_the_same_text(client, model_name):
    whole = client.responses.create(**_kw(model_name))
    assert whole.object == "response"
    assert whole.id.startswith("resp_")
    assert whole.status == "completed", whole.output_text
    assert whole.incomplete_details is None and whole.error is None
    text = whole.output_text
    assert text.strip()
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    assert [part.type for part in message.content] == ["output_text"]
    usage = whole.usage
    assert usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert whole.temperature == 0 and whole.max_output_tokens == 64

    events = list(client.responses.create(stream=True, **_kw(model_name)))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    assert "".join(e.delta for e in deltas) == text
    final = events[-1].response
    assert final.output_text == text
    assert final.id == events[0].response.id
    assert final.usage.output_tokens == usage.output_tokens
    assert len(deltas) <= usage.output_tokens

    # The SDK's stream helper accumulates the same response.
    with client.responses.stream(**_kw(model_name)) as stream:
        helper_deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        helped = stream.get_final_response()
    assert helper_deltas == text
    assert helped.output_text == text


def test_max_output_tokens_cut_is_incomplete(client, model_name):
    kw = dict(model=model_name, input="What is the capital of France?", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 8
    assert whole.output[0].status == "incomplete"
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == whole.output_text


def _chat(client, model_name, messages, max_tokens=64):
    return client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_instructions_are_the_system_message(client, model_name):
    instructions = "You are a pirate. Answer like a pirate."
    response = client.responses.create(**_kw(model_name, instructions=instructions))
    assert response.instructions == instructions
    chat = _chat(
        client,
        model_name,
        [{"role": "system", "content": instructions}, {"role": "user", "content": HELLO}],
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    # And they change the prompt: without them the template's default system message is used.
    plain = client.responses.create(**_kw(model_name))
    assert plain.usage.input_tokens != response.usage.input_tokens


def test_a_conversation_of_input_items(client, model_name):
    first = client.responses.create(**_kw(model_name))
    # The earlier answer goes back as the output item it came as.
    earlier = [item.model_dump(exclude_none=True) for item in first.output]
    items = [
        {"role": "developer", "content": "Answer in one short sentence."},
        {"role": "user", "content": [{"type": "input_text", "text": HELLO}]},
        *earlier,
        {"type": "message", "role": "user", "content": "Now say goodbye."},
    ]
    response = client.responses.create(model=model_name, input=items, max_output_tokens=64, temperature=0)
    chat = _chat(
        client,
        model_name,
        [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": HELLO},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Now say goodbye."},
        ],
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    species: Literal["cat", "dog", "parrot"]
    age: int = pydantic.Field(ge=0, le=30)
    toys: List[Annotated[str, pydantic.Field(max_length=20)]] = pydantic.Field(max_length=2)


def test_parse_with_a_pydantic_model(client, model_name):
    kw = dict(
        model=model_name,
        input="Invent a pet. Answer in JSON.",
        text_format=Pet,
        max_output_tokens=120,
        temperature=0,
    )
    parsed = client.responses.parse(**kw)
    assert parsed.status == "completed", parsed.output_text
    assert isinstance(parsed.output_parsed, Pet)
    assert Pet.model_validate_json(parsed.output_text) == parsed.output_parsed
    assert parsed.text.format.type == "json_schema"

    with client.responses.stream(**kw) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_parsed == parsed.output_parsed


def test_stored_state_is_refused_and_what_does_not_apply_is_named(client, model_name):
    for field, value in [
        ("previous_response_id", "resp_123"),
        ("background", True),
        ("include", ["file_search_call.results"]),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**_kw(model_name, **{field: value}))
        error = info.value.body
        assert error["code"] == "unsupported_parameter", error
        assert error["param"] == field, error

    raw = client.responses.with_raw_response.create(
        **_kw(model_name, store=True, metadata={"team": "e2e"}, reasoning={"effort": "low"})
    )
    named = raw.headers["x-kvmesh-ignored-params"].split(", ")
    assert {"store", "metadata", "reasoning"} <= set(named), named
    assert raw.parse().status == "completed"


class GetWeather(pydantic.BaseModel):
    """The current weather in a city."""

    city: str = pydantic.Field(max_length=32)
    unit: Literal["celsius", "fahrenheit"]


WEATHER_TOOL = {
    "type": "function",
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
    "strict": True,
}

TIME_TOOL = {
    "type": "function",
    "name": "get_time",
    "description": "The local time in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 32}},
        "required": ["city"],
    },
}


@pytest.mark.parametrize("city", ["Paris", "Tokyo", "Lima"])
def test_a_required_call_parses_into_the_functions_model(client, model_name, city):
    response = client.responses.parse(
        model=model_name,
        input=f"What is the weather in {city} right now?",
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        max_output_tokens=120,
        temperature=0,
    )
    assert response.status == "completed", response.output
    assert [item.type for item in response.output] == ["function_call"] * len(response.output)
    assert response.output and response.output_text == ""
    for call in response.output:
        assert call.name == "GetWeather"
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        assert isinstance(call.parsed_arguments, GetWeather), call.arguments
    assert len({call.call_id for call in response.output}) == len(response.output)


def test_a_named_call_streamed_is_the_whole_call(client, model_name):
    kw = dict(
        model=model_name,
        input="What time is it in Oslo?",
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    whole = client.responses.create(**kw)
    [call] = whole.output
    assert (call.type, call.name, call.status) == ("function_call", "get_time", "completed")
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert whole.tool_choice.name == "get_time" and whole.parallel_tool_calls is False

    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1
    assert "".join(e.delta for e in deltas) == call.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    [added] = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.name == "get_time" and added.item.arguments == ""
    assert all(e.item_id == added.item.id for e in deltas)
    final = events[-1].response
    assert [(o.name, o.arguments) for o in final.output] == [("get_time", call.arguments)]

    with client.responses.stream(**kw) as stream:
        helped = stream.get_final_response()
    assert [(o.name, o.arguments) for o in helped.output] == [("get_time", call.arguments)]


def test_a_round_trip_sends_the_call_and_its_output_back(client, model_name):
    question = "What is the weather in Paris right now?"
    first = client.responses.create(
        model=model_name,
        input=question,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
        temperature=0,
    )
    [call] = first.output
    result = json.dumps({"temperature": 12, "unit": "celsius"})
    # The SDK's idiom: the answer's output objects go back as they are.
    items = [{"role": "user", "content": question}, *first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
    kw = dict(model=model_name, input=items, tools=[WEATHER_TOOL], max_output_tokens=60, temperature=0)
    final = client.responses.create(**kw)
    assert final.status in ("completed", "incomplete")
    assert final.output

    streamed = list(client.responses.create(stream=True, **kw))[-1].response
    strip = lambda r: [o.model_dump(exclude={"id", "call_id"}) for o in r.output]  # noqa: E731
    assert strip(streamed) == strip(final)

    # Chat completions with the same conversation see the same prompt.
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
    chat = client.chat.completions.create(
        model=model_name,
        messages=[
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": result},
        ],
        tools=[chat_tool],
        max_tokens=60,
        temperature=0,
    )
    assert final.usage.input_tokens == chat.usage.prompt_tokens
