"""Capture: decorators on imperative PyTorch code -> the Walk Graph IR.

from walkserve import capture
captured = capture.trace(model, sample_inputs)
captured.run(inputs)                  # the reference interpreter
"""

from walkserve.capture.api import (
    ComponentSpec,
    Dim,
    Input,
    component,
    iterations,
    loop,
    mark_component,
    register_component,
    stream,
    walk,
)
from walkserve.capture.chunk import EndOfStream, FixedChunk, LeftContext, SlidingWindow
from walkserve.capture.errors import CaptureError
from walkserve.capture.gluefn import glue_function
from walkserve.capture.inputs import InputError, check_inputs
from walkserve.capture.model import CapturedModel
from walkserve.capture.trace import trace

__all__ = [
    "CaptureError",
    "CapturedModel",
    "ComponentSpec",
    "Dim",
    "Input",
    "InputError",
    "EndOfStream",
    "FixedChunk",
    "LeftContext",
    "SlidingWindow",
    "component",
    "check_inputs",
    "glue_function",
    "iterations",
    "loop",
    "mark_component",
    "register_component",
    "stream",
    "trace",
    "walk",
]
