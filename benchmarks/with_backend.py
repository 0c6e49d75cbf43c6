"""Run a module with torch.compile's default backend replaced, for checking compiled code paths on a CPU:

    python benchmarks/with_backend.py aot_eager -m attnlab train --compile ...

``aot_eager`` traces with Dynamo and AOT autograd (graph breaks, guards, recompiles, the backward graph) and runs the
traced graphs eagerly: what compilation does to the program, without inductor's minutes of code generation per
model on a CPU. Calls that name a backend keep it.
"""

import functools
import runpy
import sys

import torch

if len(sys.argv) < 4 or sys.argv[2] != "-m":
    raise SystemExit("usage: python benchmarks/with_backend.py BACKEND -m MODULE [ARGS...]")
backend, module = sys.argv[1], sys.argv[3]
_compile = torch.compile


@functools.wraps(_compile)
def compile_with(*args, **kwargs):
    if "backend" not in kwargs:
        kwargs["backend"] = backend
        if kwargs.get("mode") in (None, "default"):  # inductor's modes mean nothing to another backend
            kwargs.pop("mode", None)
    return _compile(*args, **kwargs)


torch.compile = compile_with
sys.argv = [module, *sys.argv[4:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
