"""Read the API surface of one installed SGLang release from its own code (stdlib + sglang).

Run by the python of an env that ``evalsvc.builds.sglang_env`` built, never by evalsvc's own
python, and without importing evalsvc::

    <env python> tests/engines/sglang_surface.py > surface.json

Prints, as JSON on stdout (SGLang's own prints go to stderr):

* ``generate_fields``: every field of ``io_struct.GenerateReqInput``, in order, with its default
  (``default`` as JSON, ``default_repr`` when it is not JSON);
* ``sampling_fields``: every field of ``sampling_params.SamplingParams`` with its default;
* ``meta_info_keys``: every constant key the tokenizer manager writes into a response's
  ``meta_info`` (``tokenizer_manager.py``, found with ``ast``: ``meta_info[...] = ``,
  ``meta_info = {...}``, ``meta_info.update({...})``, ``meta_info.setdefault(...)``,
  ``out["meta_info"][...] = ``), each with the functions that write it;
* ``openai_fields``: the fields of ``CompletionRequest`` and ``ChatCompletionRequest``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import sys
from typing import Any


def _default(value: Any) -> dict[str, Any]:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return {"default": None, "default_repr": repr(value)}
    return {"default": value}


def generate_fields() -> list[dict[str, Any]]:
    from sglang.srt.managers.io_struct import GenerateReqInput

    out = []
    for f in dataclasses.fields(GenerateReqInput):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        out.append({"name": f.name, **_default(value)})
    return out


def sampling_fields() -> list[dict[str, Any]]:
    from sglang.srt.sampling import sampling_params

    cls = sampling_params.SamplingParams
    names = getattr(cls, "__struct_fields__", None)
    if names is not None:  # msgspec.Struct (0.5.2x)
        defaults = cls.__struct_defaults__
        pad = len(names) - len(defaults)
        return [{"name": n, **_default(defaults[i - pad] if i >= pad else None)}
                for i, n in enumerate(names)]
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return [{"name": n, **_default(None if p.default is inspect.Parameter.empty else p.default)}
            for n, p in params.items() if n != "self"]


def _is_meta_info(node: ast.AST) -> bool:
    if isinstance(node, ast.Name) and node.id == "meta_info":
        return True
    return (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and node.slice.value == "meta_info")


class _MetaKeys(ast.NodeVisitor):
    def __init__(self) -> None:
        self.keys: dict[str, set[str]] = {}
        self.function = "<module>"

    def visit_FunctionDef(self, node: ast.AST) -> None:
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def add(self, key: Any) -> None:
        if isinstance(key, str):
            self.keys.setdefault(key, set()).add(self.function)

    def add_dict(self, node: ast.AST) -> None:
        if isinstance(node, ast.Dict):
            for k in node.keys:
                if isinstance(k, ast.Constant):
                    self.add(k.value)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if (isinstance(target, ast.Subscript) and _is_meta_info(target.value)
                    and isinstance(target.slice, ast.Constant)):
                self.add(target.slice.value)
            if isinstance(target, ast.Name) and target.id == "meta_info":
                self.add_dict(node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (isinstance(func, ast.Attribute) and _is_meta_info(func.value)
                and func.attr in ("update", "setdefault") and node.args):
            first = node.args[0]
            if isinstance(first, ast.Constant):
                self.add(first.value)
            else:
                self.add_dict(first)
        self.generic_visit(node)


def meta_info_keys() -> dict[str, list[str]]:
    spec = importlib.util.find_spec("sglang.srt.managers.tokenizer_manager")
    with open(spec.origin, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    visitor = _MetaKeys()
    visitor.visit(tree)
    return {k: sorted(v) for k, v in sorted(visitor.keys.items())}


def openai_fields() -> dict[str, list[str]]:
    from sglang.srt.entrypoints.openai import protocol

    return {name: list(getattr(protocol, name).model_fields)
            for name in ("CompletionRequest", "ChatCompletionRequest")}


def main() -> int:
    with contextlib.redirect_stdout(sys.stderr):
        surface = {"sglang_version": importlib.metadata.version("sglang"),
                   "generate_fields": generate_fields(), "sampling_fields": sampling_fields(),
                   "meta_info_keys": meta_info_keys(), "openai_fields": openai_fields()}
    json.dump(surface, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
