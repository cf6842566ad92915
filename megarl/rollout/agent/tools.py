"""Tools the model calls, the Hermes/Qwen3 tool-call format, and the built-in tools.

A tool is a Python function (sync or async) taking keyword arguments and returning text, with
its OpenAI-style JSON schema attached by :func:`tool` (``fn.tool_schema``). The model calls
tools in the Hermes format that Qwen3 (and Qwen2.5) emit:
``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``.
A call that cannot be parsed or run becomes an error observation, never an exception.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megarl.rollout.agent.sandbox import run_python

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call, or the reason it could not be parsed (``error``)."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


def tool(schema: dict[str, Any]) -> Callable[[Callable], Callable]:
    """Mark a function as a tool with its JSON schema (``{"name", "description",
    "parameters"}``, OpenAI's ``function`` object)."""
    if "name" not in schema:
        raise ValueError("tool schema: a 'name' is required")

    def mark(fn: Callable) -> Callable:
        fn.tool_schema = schema
        return fn
    return mark


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` in ``text``; malformed ones (bad JSON, no name,
    arguments not an object, an unclosed tag) come back with ``error`` set."""
    calls = []
    for body in _CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(None, {}, f"invalid JSON in <tool_call>: {err.msg}"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall(None, {}, 'a tool call needs {"name": ..., "arguments": {...}}'))
            continue
        args = data.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(data["name"], {}, "arguments must be a JSON object"))
            continue
        calls.append(ToolCall(data["name"], args))
    if text.count("<tool_call>") > len(_CALL.findall(text)):
        calls.append(ToolCall(None, {}, "<tool_call> without a closing </tool_call>"))
    return calls


async def call_tool(fn: Callable, arguments: dict[str, Any]) -> tuple[str, bool]:
    """Run one tool; returns (observation text, whether it failed). Sync tools run in a thread
    so that the episodes of other samples go on."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        return f"error: {err}", True
    try:
        if inspect.iscoroutinefunction(fn):
            result = await fn(**arguments)
        else:
            result = await asyncio.to_thread(fn, **arguments)
    except Exception as err:  # noqa: BLE001 - a tool's failure is the model's observation
        return f"error: {type(err).__name__}: {err}", True
    return str(result), False


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large (at most 64)")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


@tool({"name": "calculator",
       "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
       "parameters": {"type": "object", "required": ["expression"],
                      "properties": {"expression": {"type": "string"}}}})
def calculator(expression: str) -> str:
    """The value of an arithmetic expression; integers stay exact."""
    if len(expression) > 256:
        raise ValueError("expression longer than 256 characters")
    value = _evaluate(ast.parse(expression, mode="eval"))
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


@tool({"name": "code_interpreter",
       "description": "Run Python code in a sandbox (no network, 5 s, 256 MB) and return what "
                      "it prints.",
       "parameters": {"type": "object", "required": ["code"],
                      "properties": {"code": {"type": "string"}}}})
def code_interpreter(code: str) -> str:
    """Run ``code`` in :func:`~megarl.rollout.agent.sandbox.run_python`; stdout, or the error."""
    result = run_python(code, timeout_s=5.0, memory_mb=256)
    if result.timed_out:
        raise TimeoutError("the code ran longer than 5 s and was killed")
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit status {result.returncode}")
    return result.stdout
