"""Structured outputs and tolerant parameters through the official openai client.

A Pydantic model through `client.chat.completions.parse` gives a parsed object on 20 varied
prompts, every one valid against the schema; json_object answers parse as JSON objects,
streamed too; kvmesh's choice and regex formats hold; fields OpenAI defines that do not
apply here (store, metadata, service_tier, reasoning_effort) and unknown ones are accepted
and named back.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, List, Literal

import pydantic
import pytest


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    city: Literal["Paris", "London", "Tokyo", "Lima"]
    hobbies: List[Annotated[str, pydantic.Field(max_length=24)]] = pydantic.Field(max_length=3)


TOPICS = [
    "a retired sailor", "a young painter", "a chess champion", "a baker who loves music",
    "a marathon runner", "a quiet librarian", "a street musician", "a famous chef",
    "a gardener", "a software engineer", "a beekeeper", "a mountain guide",
    "a poet", "a nurse on night shifts", "a taxi driver", "an astronomer",
    "a carpenter", "a violin teacher", "a football coach", "a fisherman",
]


def _parse(client, **kw):
    # openai moved parse() out of beta; take whichever this version has.
    chat = client.chat.completions
    parse = getattr(chat, "parse", None) or client.beta.chat.completions.parse
    return parse(**kw)


@pytest.mark.parametrize("topic", TOPICS)
def test_pydantic_parse_gives_a_valid_object(client, model_name, topic):
    completion = _parse(
        client,
        model=model_name,
        messages=[{"role": "user", "content": f"Invent {topic}. Answer in JSON."}],
        response_format=Person,
        max_tokens=200,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    person = choice.message.parsed
    assert isinstance(person, Person), choice.message.content
    Person.model_validate_json(choice.message.content)


def test_json_object_streamed_and_not(client, model_name):
    kw = dict(
        model=model_name,
        messages=[{"role": "user", "content": 'What is the capital of France? Answer as JSON like {"capital": "..."}.'}],
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict), text
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    )
    assert streamed == text


def test_kvmesh_choice_and_regex_formats(client, model_name):
    answer = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        response_format={"type": "choice", "choices": ["yes", "no", "maybe"]},
        max_tokens=8,
        temperature=0,
    ).choices[0].message.content
    assert answer in ("yes", "no", "maybe")
    code = client.completions.create(
        model=model_name,
        prompt="A product code:",
        extra_body={"response_format": {"type": "regex", "pattern": "[A-Z]{3}-[0-9]{4}"}},
        max_tokens=16,
        temperature=0.8,
        seed=1,
    ).choices[0].text
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", code), code


def test_fields_that_do_not_apply_are_accepted_and_named(client, model_name):
    raw = client.chat.completions.with_raw_response.create(
        model=model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        store=False,
        metadata={"team": "e2e"},
        service_tier="auto",
        reasoning_effort="low",
        extra_body={"frobnicate": True},
    )
    named = raw.headers["x-kvmesh-ignored-params"].split(", ")
    assert set(named) == {"store", "metadata", "service_tier", "reasoning_effort", "frobnicate"}, named
    assert raw.parse().choices[0].message.content is not None
