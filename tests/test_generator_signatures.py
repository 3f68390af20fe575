"""The batch generators the engine can be given speak mlx-lm's ``BatchGenerator`` interface.

``EngineCore`` calls ``insert_segments``, ``next``, ``remove``,
``extract_cache``, ``prompt_cache_nbytes`` and ``close`` and reads the fields
of the prompt and generation responses; the prompt cache's methods likewise.
The fakes (``tests.fakes``) and ``SerialGenerator`` must take the same
parameters under the same names as mlx-lm's own classes, and give responses
with the same fields, or the tests that use the fakes would test another
interface than the one served.
"""

from __future__ import annotations

import dataclasses
import inspect

import attrs
import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import LRUPromptCache

from runtime.engine import serial
from runtime.engine.serial import SerialGenerator
from tests import fakes

ENGINE_CALLS = ("insert_segments", "next", "remove", "extract_cache", "close")


def parameters(function) -> list[tuple[str, object]]:
    """(name, kind) of each parameter after ``self``."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind) for p in params]


def fields(cls) -> list[str]:
    if attrs.has(cls):
        return [f.name for f in attrs.fields(cls)]
    return [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("generator", [fakes.FakeBatchGenerator, SerialGenerator])
@pytest.mark.parametrize("method", ENGINE_CALLS)
def test_the_methods_the_engine_calls_take_mlx_lms_parameters(generator, method):
    real = parameters(getattr(BatchGenerator, method))
    ours = parameters(getattr(generator, method))
    if generator is SerialGenerator and method == "insert_segments":
        # One more, last and optional: the engine passes it only to this generator.
        assert ours[-1] == ("num_draft_tokens", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        assert inspect.signature(generator.insert_segments).parameters[
            "num_draft_tokens"
        ].default is None
        ours = ours[:-1]
    assert ours == real, f"{generator.__name__}.{method}: {ours} != BatchGenerator's {real}"


@pytest.mark.parametrize("generator", [fakes.FakeBatchGenerator, SerialGenerator])
def test_prompt_cache_nbytes_is_a_property_as_in_mlx_lm(generator):
    assert isinstance(inspect.getattr_static(BatchGenerator, "prompt_cache_nbytes"), property)
    assert isinstance(inspect.getattr_static(generator, "prompt_cache_nbytes"), property)


@pytest.mark.parametrize(
    ("ours", "real"),
    [
        (fakes.FakePromptResponse, PromptProcessingBatch.Response),
        (serial.PromptResponse, PromptProcessingBatch.Response),
        (fakes.FakeGenerationResponse, GenerationBatch.Response),
        (serial.GenerationResponse, GenerationBatch.Response),
    ],
)
def test_responses_have_mlx_lms_fields(ours, real):
    assert fields(ours) == fields(real)


@pytest.mark.parametrize("method", ["fetch_nearest_cache", "insert_cache"])
def test_the_fake_prompt_cache_takes_mlx_lms_parameters(method):
    real = parameters(getattr(LRUPromptCache, method))
    assert parameters(getattr(fakes.FakePromptCache, method)) == real


@pytest.mark.parametrize("method", ["has_entry", "remove_entry"])
def test_the_fake_prompt_cache_takes_the_stores_parameters(method):
    from runtime.prompt_cache_store import PromptCacheStore

    real = parameters(getattr(PromptCacheStore, method))
    assert parameters(getattr(fakes.FakePromptCache, method)) == real


def test_the_fake_prompt_cache_has_the_size_readings():
    assert isinstance(inspect.getattr_static(LRUPromptCache, "nbytes"), property)
    assert isinstance(inspect.getattr_static(fakes.FakePromptCache, "nbytes"), property)
    assert hasattr(LRUPromptCache, "__len__") and hasattr(fakes.FakePromptCache, "__len__")
