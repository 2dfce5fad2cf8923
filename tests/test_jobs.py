"""``jobs.check_task`` (the worker's check of every delivered task) refuses exactly what
the gateway refuses for the request a task stands for: one validation path. Its fast
screen passes exactly the tasks with nothing wrong, so it is a shortcut, not a second
set of rules."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tandem.common.events import GenerationTask
from tandem.common.jobs import (
    GenerationRequest,
    JobLimits,
    Problem,
    _screen,
    build_task,
    check_request,
    check_task,
    pydantic_problems,
)
from tandem.common.models import Registry

REGISTRY = Registry.parse("")  # the built-in models, noop among them
LIMITS = JobLimits()
# Limits that bind before the models' bounds do (sizes over 512, prompts over 400
# characters, more than 4 images, 0.5 megapixel-steps), so each side of every min is tried.
TIGHT = JobLimits(max_images=4, max_prompt_chars=400, max_size=512, max_work=0.5)

# Each field's pool: good values, each model's boundaries (the built-ins: sizes 16 or
# 8..64 or 8..1024, steps up to 1000 / 200 / 1, guidance up to 1 / 20, prompts up to 500
# characters, labels 0..9) and the values just past them.
POOLS: dict[str, list[Any]] = {
    "prompt": [None, "", "  ", "a cat", "x" * 400, "x" * 401, "x" * 500, "x" * 501,
               "x" * 1500, "y" * 200_000],
    "negative_prompt": [None, "", "blur", "z" * 501],
    "class_label": [None, 0, 9, 10, -1],
    "width": [8, 16, 24, 12, 0, -8, 64, 72, 512, 520, 1024, 1032, 2048, 2056, 4096, 8192, 8200],
    "height": [16, 15, 8192, 8, 32, 64, 72, 512],
    "steps": [1, 2, 0, -1, 10, 200, 201, 1000, 1001, 5000, 10_001],
    # 1 (an int) is what a task made in Python may hold: the screen leaves it to the
    # full path, which takes it as 1.0.
    "guidance": [0.0, 1.0, 1.5, 5.0, 20.0, 20.5, 100.5, -1.0, float("inf"), float("nan"), 1],
    "seed": [0, 7, -1, 2**32 - 1, 2**32],
    "num_images": [1, 2, 0, -1, 4, 5, 8, 9, 300],
    "lane": ["interactive", "batch", "urgent"],
    "cluster": ["", "c1"],  # a task is a token at decode (elsewhere)
    "noop": [False, True],
}
GOOD: dict[str, dict[str, Any]] = {  # a task each model runs
    "digits": {"class_label": 3, "width": 16, "height": 16, "steps": 20},
    "tiny-text": {"prompt": "a cat", "width": 16, "height": 16, "steps": 10,
                  "guidance": 5.0},
    "noop": {"width": 512, "height": 512, "steps": 1, "noop": True},  # 0.26 MP-steps
    "nope": {},
}


@st.composite
def values(draw: st.DrawFn) -> dict[str, Any]:
    """A task's fields: a good one for its model with zero to three fields changed (so
    each refusal is seen alone, not only behind another field's)."""
    model = draw(st.sampled_from(sorted(GOOD)))
    v: dict[str, Any] = {"prompt": None, "negative_prompt": None, "class_label": None,
                         "width": 16, "height": 16, "steps": 1, "guidance": 1.0,
                         "seed": 0, "num_images": 1, "lane": "interactive",
                         "cluster": "", "noop": False, **GOOD[model], "model": model}
    for name in draw(st.lists(st.sampled_from(sorted(POOLS)), max_size=3, unique=True)):
        v[name] = draw(st.sampled_from(POOLS[name]))
    return v


def as_the_gateway_checks(v: dict[str, Any], limits: JobLimits = LIMITS) -> list[Problem]:
    """The gateway's two steps on the request the task stands for (an empty cluster is
    an unpinned request; the noop flag is the task's own, set from the model)."""
    body = {k: x for k, x in v.items() if k != "noop"}
    body["cluster"] = body["cluster"] or None
    try:
        req = GenerationRequest(**body)
    except ValidationError as exc:
        return pydantic_problems(exc)
    out = check_request(req, REGISTRY, limits)
    spec = REGISTRY.get(v["model"])
    if spec is not None and v["noop"] != (spec.source_kind == "noop"):
        out.append(Problem("noop", "", v["noop"]))
    return out


def fields(problems: list[Problem]) -> list[str]:
    return sorted(p.field for p in problems)


@settings(max_examples=1000, deadline=None, database=None)
@given(values(), st.sampled_from([LIMITS, TIGHT]))
@example({"model": "noop", "prompt": None, "negative_prompt": None, "class_label": None,
          "width": 32, "height": 32, "steps": 1, "guidance": 1.0, "seed": 0,
          "num_images": 1, "lane": "interactive", "cluster": "", "noop": True}, LIMITS)
def test_check_task_refuses_what_the_gateway_refuses_field_by_field(
        v: dict[str, Any], limits: JobLimits) -> None:
    task = GenerationTask(task_id="t1", **v)
    got, want = check_task(task, REGISTRY, limits), as_the_gateway_checks(v, limits)
    assert fields(got) == fields(want), (v, got, want)
    # The same messages, not only the same fields (the noop one is the task's alone).
    assert [(p.field, p.message) for p in got if p.field != "noop"] == \
        [(p.field, p.message) for p in want if p.field != "noop"]


@settings(max_examples=1000, deadline=None, database=None)
@given(values(), st.sampled_from([LIMITS, TIGHT]))
def test_the_screen_passes_exactly_the_tasks_with_nothing_wrong(
        v: dict[str, Any], limits: JobLimits) -> None:
    spec = REGISTRY.get(v["model"])
    if spec is None:
        return  # no model, no screen: the full path names the model
    passes = _screen(spec, limits).passes(GenerationTask(task_id="t1", **v))
    if type(v["guidance"]) is float:
        assert passes == (as_the_gateway_checks(v, limits) == []), (v, limits)
    else:
        assert not passes  # strict about types: the full path decides


@pytest.mark.parametrize("limits", [LIMITS, TIGHT], ids=["default", "tight"])
def test_the_screen_passes_what_the_gateway_enqueues(limits: JobLimits) -> None:
    """Every model's default request and a few at its bounds, as the gateway builds them,
    take the fast path (a screen that passed nothing would be correct and useless)."""
    passed = 0
    for spec in REGISTRY.models.values():
        bodies: list[dict[str, Any]] = [{}, {"num_images": limits.max_images},
                                        {"steps": spec.max_steps, "seed": 2**32 - 1}]
        for body in bodies:
            if spec.conditioning == "text":
                body["prompt"] = "x" * min(spec.max_prompt_chars, limits.max_prompt_chars)
            elif spec.conditioning == "class_label":
                body["class_label"] = spec.num_classes - 1
            req = GenerationRequest(model=spec.name, **body)
            if check_request(req, REGISTRY, limits):
                continue  # over the work cap for this model: not a request it enqueues
            assert _screen(spec, limits).passes(build_task(req, spec, "t1", "c1")), \
                (spec.name, body)
            passed += 1
    assert passed >= 7
