"""``jobs.check_task`` (the worker's check of every delivered task) refuses exactly what
the gateway refuses for the request a task stands for: one validation path."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tandem.common.events import GenerationTask
from tandem.common.jobs import (
    GenerationRequest,
    JobLimits,
    Problem,
    check_request,
    check_task,
    pydantic_problems,
)
from tandem.common.models import Registry

REGISTRY = Registry.parse("")  # the built-in models, noop among them
LIMITS = JobLimits()

values = st.fixed_dictionaries({
    "model": st.sampled_from(["digits", "tiny-text", "noop", "nope"]),
    "prompt": st.none() | st.sampled_from(["", "  ", "a cat", "x" * 1500, "y" * 200_000]),
    "negative_prompt": st.none() | st.sampled_from(["", "blur"]),
    "class_label": st.none() | st.sampled_from([0, 9, 10, -1]),
    "width": st.sampled_from([8, 16, 24, 12, 0, -8, 1024, 4096, 8192, 8200]),
    "height": st.sampled_from([16, 15, 8192, 8, 32]),
    "steps": st.sampled_from([1, 2, 0, -1, 50, 5000, 10_001]),
    "guidance": st.sampled_from([0.0, 1.0, 5.0, 100.5, -1.0, float("inf"), float("nan")]),
    "seed": st.sampled_from([0, 7, -1, 2**32 - 1, 2**32]),
    "num_images": st.sampled_from([1, 2, 0, -1, 9, 300]),
    "lane": st.sampled_from(["interactive", "batch", "urgent"]),
    "cluster": st.sampled_from(["", "c1"]),  # a task is a token at decode (elsewhere)
    "noop": st.booleans(),
})


def as_the_gateway_checks(v: dict[str, Any]) -> list[Problem]:
    """The gateway's two steps on the request the task stands for (an empty cluster is
    an unpinned request; the noop flag is the task's own, set from the model)."""
    body = {k: x for k, x in v.items() if k != "noop"}
    body["cluster"] = body["cluster"] or None
    try:
        req = GenerationRequest(**body)
    except ValidationError as exc:
        return pydantic_problems(exc)
    out = check_request(req, REGISTRY, LIMITS)
    spec = REGISTRY.get(v["model"])
    if spec is not None and v["noop"] != (spec.source_kind == "noop"):
        out.append(Problem("noop", "", v["noop"]))
    return out


def fields(problems: list[Problem]) -> list[str]:
    return sorted(p.field for p in problems)


@settings(max_examples=400, deadline=None, database=None)
@given(values)
@example({"model": "noop", "prompt": None, "negative_prompt": None, "class_label": None,
          "width": 32, "height": 32, "steps": 1, "guidance": 1.0, "seed": 0,
          "num_images": 1, "lane": "interactive", "cluster": "", "noop": True})
def test_check_task_refuses_what_the_gateway_refuses_field_by_field(v: dict[str, Any]
                                                                     ) -> None:
    task = GenerationTask(task_id="t1", **v)
    got, want = check_task(task, REGISTRY, LIMITS), as_the_gateway_checks(v)
    assert fields(got) == fields(want), (v, got, want)
    # The same messages, not only the same fields (the noop one is the task's alone).
    assert [(p.field, p.message) for p in got if p.field != "noop"] == \
        [(p.field, p.message) for p in want if p.field != "noop"]
