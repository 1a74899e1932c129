"""Agent frameworks pointed at kvmesh as at any OpenAI-compatible server: LangChain's
`ChatOpenAI` and LiteLLM complete a chat and a structured call."""

from __future__ import annotations

import os
from typing import Literal

import pydantic
import pytest

# LiteLLM reads its model price map from the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    species: Literal["cat", "dog", "parrot", "rabbit"]
    age: int = pydantic.Field(ge=0, le=30)


@pytest.fixture(scope="module")
def chat_model(base_url, model_name):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=model_name, base_url=base_url + "/v1", api_key="e2e", temperature=0,
        max_tokens=60, max_retries=0, timeout=120,
    )


def test_langchain_chat(chat_model):
    reply = chat_model.invoke("Name three colours.")
    assert isinstance(reply.content, str) and reply.content.strip()
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata["output_tokens"] > 0


def test_langchain_streams(chat_model):
    pieces = [chunk.content for chunk in chat_model.stream("Count to five.")]
    assert len(pieces) > 3
    assert "".join(pieces) == chat_model.invoke("Count to five.").content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat_model, method):
    structured = chat_model.with_structured_output(Pet, method=method)
    pet = structured.invoke("Invent a pet and describe it.")
    assert isinstance(pet, Pet), pet


def test_langchain_binds_tools(chat_model):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    reply = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Oslo?"
    )
    assert len(reply.tool_calls) == 1, reply
    assert reply.tool_calls[0]["name"] == "get_weather"
    assert isinstance(reply.tool_calls[0]["args"]["city"], str)


def _litellm():
    import litellm

    litellm.telemetry = False
    return litellm


def test_litellm_chat(base_url, model_name):
    litellm = _litellm()
    reply = litellm.completion(
        model=f"openai/{model_name}", api_base=base_url + "/v1", api_key="e2e",
        messages=[{"role": "user", "content": "Say hello."}], max_tokens=20, temperature=0,
    )
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens > 0


def test_litellm_structured_output(base_url, model_name):
    litellm = _litellm()
    reply = litellm.completion(
        model=f"openai/{model_name}", api_base=base_url + "/v1", api_key="e2e",
        messages=[{"role": "user", "content": "Invent a pet. Answer in JSON."}],
        response_format=Pet, max_tokens=80, temperature=0,
    )
    Pet.model_validate_json(reply.choices[0].message.content)
