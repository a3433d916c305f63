"""A Keras step compiled with XLA the way a TPU compiles it, and what the compiled program shows: the ops XLA
refuses, float64 and int64 tensors, dynamic shapes, and the memory of its buffers. The checks of
``train.fit --preflight`` (``train.preflight.check``) that need TensorFlow.

XLA runs here on the CPU (``XLA_CPU_JIT``): a TPU compiles the same TensorFlow graph through the same op
lowering (tf2xla), so an op without an XLA kernel, a float64 tensor or a shape known only at run time shows up
here as it would there. What differs is the backend: the TPU's own kernels, layouts and memory.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import tensorflow as tf

from tfpipe.runtime.errors import TfpipeError

# Ops a TPU cannot run, by kind, and the fix each needs (the op types as TensorFlow names them).
PYTHON_OPS = ("EagerPyFunc", "PyFunc", "PyFuncStateless")
PYTHON_FIX = "Python code cannot run on a TPU: write it with TensorFlow ops, or move it into the input pipeline"
PRINT_OPS = ("StringFormat", "PrintV2", "Print")
PRINT_FIX = "tf.print cannot run inside a TPU step: remove it (print from a Keras callback instead)"
STRING_FIX = "a TPU has no strings: do string work in the input pipeline (on the host), not in the model"
OTHER_FIX = "the op has no XLA kernel: replace it, or move it into the input pipeline (on the host)"
DETERMINISM_FIX = (
    "TensorFlow's op determinism is on in this process (train.fit --deterministic, or "
    "tf.config.experimental.enable_op_determinism()) and XLA has no deterministic version of this op: "
    "leave --deterministic out of a TPU run"
)
COMPILE_FIX = (
    "XLA's message says what failed (not where: remove layers until it compiles to find it); a size computed "
    "from the data (top_k's k, a reshape to a computed shape) is the usual cause: make it a constant"
)


class Finding(NamedTuple):
    """One line of the preflight's report: ``refuse`` (a TPU would refuse the step) or ``warn`` (it runs, but
    wastes the TPU), what and where (``culprit``: a layer, an input, a setting) and the fix."""

    level: str  # "refuse" or "warn"
    culprit: str
    why: str
    fix: str

    def line(self) -> str:
        return f"{self.culprit}: {self.why}; {self.fix}"


class Compiled(NamedTuple):
    """A step compiled by XLA: the program as lowered from TensorFlow (an ``HloModuleProto``: its shapes, dynamic
    dimensions and op names as traced), the optimized program (an ``HloProto``: the module XLA runs and its
    buffer assignment), and the seconds tracing and compiling took."""

    lowered: Any
    proto: Any
    seconds: float


def compile_step(step: Callable[..., Any], batch: Any) -> Compiled:
    """Compiles ``step(batch)`` with XLA on this process's CPU, as ``tf.function(jit_compile=True)`` compiles it
    on a TPU; an op XLA cannot compile is a ``StepRefused`` naming it."""
    try:
        from tensorflow.compiler.xla.service import hlo_pb2  # in TensorFlow's wheels since 2.x, outside its API
    except ImportError as e:
        raise TfpipeError(
            f"the preflight reads XLA's programs through TensorFlow's own protos, missing here: {e}"
        ) from None
    started = time.perf_counter()
    function = tf.function(step, jit_compile=True)
    try:
        with tf.device("/CPU:0"):
            compiler_ir = function.experimental_get_compiler_ir(batch)
            lowered, proto = hlo_pb2.HloModuleProto(), hlo_pb2.HloProto()
            # the lowered program keeps the dynamic dimensions that XLA's optimizations pad away
            lowered.ParseFromString(compiler_ir(stage="hlo_serialized"))
            proto.ParseFromString(compiler_ir(stage="optimized_hlo_proto_serialized"))
    except (ValueError, tf.errors.OpError) as e:
        raise StepRefused(refusals_of_compiler_error(str(e))) from None
    return Compiled(lowered, proto, time.perf_counter() - started)


class StepRefused(TfpipeError):
    """XLA refused to compile a step; ``findings`` say where and why."""

    def __init__(self, findings: list[Finding]) -> None:
        super().__init__("; ".join(f.line() for f in findings))
        self.findings = findings


UNSUPPORTED = re.compile(
    r"(\w+) \(No registered '\w+' OpKernel for \w+ devices compatible with node \{\{node ([^}]+)\}\}"
)


def refusals_of_compiler_error(message: str) -> list[Finding]:
    """The findings of XLA's compile error: one for each op without an XLA kernel ("Detected unsupported
    operations", naming the op and its node, whose path is the layer's), else the error's first line."""
    found: dict[str, Finding] = {}
    for op, node in UNSUPPORTED.findall(message):
        fix = (
            PYTHON_FIX
            if op in PYTHON_OPS
            else PRINT_FIX
            if op in PRINT_OPS
            else STRING_FIX
            if "String" in op or op == "AsString"
            else OTHER_FIX
        )
        culprit = layer_of(node)
        found.setdefault(culprit + op, Finding("refuse", culprit, f"op {op} cannot be compiled by XLA", fix))
    if found:
        return list(found.values())
    first = message.replace("Failed getting HLO text: ", "").strip(" '\"").splitlines()[0][:300]
    node = re.search(r"\{\{node ([^}]+)\}\}", message)
    culprit = layer_of(node.group(1)) if node else "the step"
    fix = DETERMINISM_FIX if "deterministic" in first else COMPILE_FIX
    return [Finding("refuse", culprit, f"XLA cannot compile it: {first}", fix)]


def layer_of(op_name: str) -> str:
    """The layer an op belongs to, from its name: ``gradient_tape/model/backbone/my_layer/EagerPyFunc`` ->
    ``model/backbone/my_layer`` (its gradient is the layer's too)."""
    path = op_name.removeprefix("gradient_tape/").split("/")
    return "/".join(path[:-1]) or op_name


def instructions(module: Any) -> Iterator[Any]:
    """Every instruction of an ``HloModuleProto``'s computations that comes from a TensorFlow op (XLA's own
    parameters and copies have no op name to point at)."""
    for computation in module.computations:
        yield from (i for i in computation.instructions if i.metadata.op_name)


def dtype_and_shape_findings(module: Any) -> list[Finding]:
    """float64 anywhere (a TPU has none: refused); a shape known only at run time (XLA's bounded dynamic
    dimensions, ``Where``/``boolean_mask`` and kin: a TPU pads them to their bound where its dynamic padder
    handles the op, and fails where not -- which, only a TPU says: warned) and 64-bit integer arrays (int64,
    uint64: emulated on a TPU: warned). One finding a layer and kind, in the program's order."""
    from tensorflow.compiler.xla import xla_data_pb2

    wide = {xla_data_pb2.S64: "int64", xla_data_pb2.U64: "uint64"}  # every 64-bit integer a TPU emulates
    found: dict[tuple[str, str], Finding] = {}
    for instruction in instructions(module):
        shape, layer = instruction.shape, layer_of(instruction.metadata.op_name)
        dims = "[" + ",".join(str(d) for d in shape.dimensions) + "]"
        if shape.element_type == xla_data_pb2.F64:
            found.setdefault(
                (layer, "f64"),
                Finding("refuse", layer, f"float64 tensor {dims} (a TPU has no float64)", "compute in float32"),
            )
        if any(shape.is_dynamic_dimension):
            found.setdefault(
                (layer, "dynamic"),
                Finding(
                    "warn",
                    layer,
                    f"a shape known only at run time (at most {dims}, op {instruction.metadata.op_type}): a TPU "
                    "pads it to that bound where XLA's dynamic padder handles the op, and fails to compile where "
                    'it does not ("Asked to propagate a dynamic dimension")',
                    "mask with multiplication instead of boolean_mask/where/unique: static shapes, no doubt",
                ),
            )
        if shape.element_type in wide and len(shape.dimensions) > 0:
            kind = wide[shape.element_type]
            found.setdefault(
                (layer, "64-bit integer"),
                Finding("warn", layer, f"{kind} tensor {dims} (a TPU emulates 64-bit integers)", "use int32"),
            )
    return list(found.values())


def buffer_bytes(proto: Any) -> tuple[int, int]:
    """(all, parameters): the bytes of the compiled step's buffers as XLA assigned them -- every buffer the step
    holds at once (XLA shares one buffer between values that are never live together) -- and the part that
    is the step's inputs (weights, optimizer slots, metric variables, the batch)."""
    allocations = proto.buffer_assignment.buffer_allocations
    return sum(a.size for a in allocations), sum(a.size for a in allocations if a.is_entry_computation_parameter)
