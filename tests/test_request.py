"""The typed generation request (attnqat/request.py): built by name, taken by generate and its
validator, built from the CLI's options."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from attnqat.generate import InvalidInput, resolve_settings
from attnqat.generate_cli import add_arguments, request_from
from attnqat.request import GenerationRequest


def test_the_request_and_the_keyword_form_resolve_alike():
    a, _ = resolve_settings(GenerationRequest(prompt="a cat", methods="bf16", steps="3", device="cpu"))
    b, _ = resolve_settings("a cat", methods="bf16", steps="3", device="cpu")
    assert a == b and a.steps == 3
    with pytest.raises(TypeError, match="not both"):
        GenerationRequest.of(GenerationRequest(prompt="x"), steps=2)
    with pytest.raises(TypeError, match="unknown generation field"):
        GenerationRequest.of("x", stepz=2)


def test_errors_come_in_the_requests_field_order():
    with pytest.raises(InvalidInput) as e:
        resolve_settings(GenerationRequest(prompt="", frames=6, height=7, backend="x", device="cpu"))
    assert list(e.value.errors) == ["prompt", "height", "frames", "backend"]


def test_the_cli_builds_the_request_by_name():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prompt", "a cat", "--frames", "9", "--fp4-scope", "all",
                              "--out", "x"])
    r = request_from(args)
    assert (r.prompt, r.frames, r.fp4_scope, str(r.out)) == ("a cat", 9, "all", "x")
    # every request field is an option of the command (a new field needs its option, nothing else)
    assert {f.name for f in dataclasses.fields(GenerationRequest)} <= set(vars(args))
