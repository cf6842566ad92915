"""Tool calls and the sandbox: Hermes ``<tool_call>`` parsing (malformed calls become error
observations), the calculator, and sandboxed Python that is killed whole at its limits and
leaves no process or file behind."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid

import psutil
import pytest

from megarl.rollout.agent import ToolEnvironment, calculator, code_interpreter, parse_tool_calls
from megarl.rollout.agent.sandbox import TEMP_PREFIX, run_python


def call(name: str, args: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def test_well_formed_calls_are_parsed_in_order() -> None:
    text = ("think<tool_call>\n" + '{"name": "calculator", "arguments": {"expression": "1+2"}}'
            "\n</tool_call> and " + call("code_interpreter", '"{\\"code\\": \\"print(1)\\"}"'))
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1+2"}, None), ("code_interpreter", {"code": "print(1)"},
                                                      None)]
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{not json}</tool_call>", "invalid JSON"),
    ('<tool_call>["calculator"]</tool_call>', '{"name": ..., "arguments": {...}}'),
    ('<tool_call>{"name": "calculator", "arguments": 3}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {}', "without a closing"),
])
def test_malformed_calls_become_error_observations(text: str, message: str) -> None:
    env = ToolEnvironment([calculator])
    result = asyncio.run(env.step(text))
    assert not result.done and message in result.observation
    assert result.observation.startswith("<tool_response>\nerror: ")
    assert result.info["tool_calls"] == 1 and result.info["tool_errors"] == 1


def test_tool_environment_runs_calls_and_reports_errors() -> None:
    env = ToolEnvironment([calculator], max_tool_response_length=30)
    text = (call("calculator", '{"expression": "123456789 * 987654321 * 1000000"}')
            + call("nope", "{}") + call("calculator", '{"expression": "1/0"}')
            + call("calculator", '{"expr": "1"}'))
    result = asyncio.run(env.step(text))
    blocks = [b.removeprefix("\n").removeprefix("<tool_response>\n")
              for b in result.observation.split("\n</tool_response>")]
    assert blocks[0] == "121932631112635269000000"
    assert blocks[1] == "error: unknown tool 'nope'; to"  # cut to 30 characters
    assert blocks[2] == "error: ZeroDivisionError: divi"
    assert blocks[3] == "error: missing a required argu"
    assert result.info["tool_calls"] == 4 and result.info["tool_errors"] == 3
    done = asyncio.run(env.step("the answer is 3"))
    assert done.done and done.observation is None


def test_calculator_is_exact_and_refuses_anything_but_arithmetic() -> None:
    assert calculator("123456789 * 987654321") == "121932631112635269"
    assert calculator("(7 + 5) / 4 - -2 ** 3") == "11"
    assert calculator("7 / 2") == "3.5"
    for bad in ("__import__('os')", "2 ** 1000", "[1]", "x + 1"):
        with pytest.raises(ValueError):
            calculator(bad)


def _sandbox_dirs() -> set[str]:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith(TEMP_PREFIX)}


def _processes_with(marker: str) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or []):
            out.append(proc)
    return out


def test_sandbox_runs_code_in_a_private_directory_without_network() -> None:
    before = _sandbox_dirs()
    code = ("import os, socket\nprint(os.getcwd().split('/')[-1][:15], os.listdir('.'))\n"
            "open('x.txt', 'w').write('hi')\n"
            "try:\n    socket.socket()\nexcept PermissionError as e:\n    print('blocked', e)\n")
    result = run_python(code, timeout_s=10)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"{TEMP_PREFIX} []"
    assert result.stdout.splitlines()[1].startswith("blocked network access is disabled")
    assert _sandbox_dirs() == before  # the directory and its file are gone


def test_sandbox_kills_an_infinite_loop_and_its_children_at_the_time_limit() -> None:
    marker = uuid.uuid4().hex
    before = _sandbox_dirs()
    code = ("import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{marker}'])\n"
            "while True:\n    pass\n")
    start = time.monotonic()
    result = run_python(code, timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.returncode is None
    assert 1.0 <= elapsed < 3.0
    deadline = time.monotonic() + 2
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []  # the grandchild died with the group
    assert _sandbox_dirs() == before


def test_sandbox_stops_a_memory_bomb_at_its_memory_limit() -> None:
    before = _sandbox_dirs()
    start = time.monotonic()
    result = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n",
                        timeout_s=10, memory_mb=128)
    assert time.monotonic() - start < 5  # stopped by memory, long before the time limit
    assert not result.timed_out and result.returncode != 0
    assert "MemoryError" in result.stderr
    assert _sandbox_dirs() == before


def test_code_interpreter_tool_returns_output_or_the_error() -> None:
    env = ToolEnvironment([code_interpreter])
    ok = asyncio.run(env.step(call("code_interpreter", '{"code": "print(sum(range(101)))"}')))
    assert ok.observation == "<tool_response>\n5050\n\n</tool_response>"
    bad = asyncio.run(env.step(call("code_interpreter", '{"code": "1/0"}')))
    assert "ZeroDivisionError: division by zero" in bad.observation
    assert bad.info["tool_errors"] == 1


def test_sandbox_cannot_reach_a_server_of_the_host_even_through_raw_sockets() -> None:
    """Where the kernel allows an unprivileged network namespace, the child has only its own
    loopback: even ``_socket`` (below the Python-level block) cannot reach the host's."""
    import socket

    probe = run_python("print(open('/proc/net/dev').read().count(':'))", timeout_s=10)
    if probe.stdout.strip() != "1":
        pytest.skip("no unprivileged network namespaces here; only the Python-level block")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = ("import _socket\ns = _socket.socket()\ns.settimeout(2)\ntry:\n"
                f"    s.connect(('127.0.0.1', {port}))\n    print('connected')\n"
                "except OSError as e:\n    print('refused', type(e).__name__)\n")
        result = run_python(code, timeout_s=10)
    assert result.stdout.startswith("refused"), (result.stdout, result.stderr)
