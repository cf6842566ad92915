"""What megarl serves is closed by default: loopback binds, API keys on every endpoint, and
secrets that never reach logs or the saved config.

A real embedded server bound to 0.0.0.0 with an API key: every route of the app (read from the
app itself, so a new endpoint is covered the day it is added) answers 401 without the key or
with a wrong one, and nothing it would have done happens; the client and the health probes send
the key. Then every place a key could leak to: the server's command line, log and
``/get_server_info``, library debug logs, error messages, reprs, ``megarl config show`` and the
``config.yaml`` a run saves.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml

from megarl.config import load_config_dict
from megarl.config.render import render_config
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.launch import API_KEY_ENV, build_local_command, launch_local_engines
from megarl.rollout.process import ManagedServer
from megarl.rollout.server_worker import EngineSpec
from megarl.rollout.sglang.client import EngineError, SGLangClient

from .corpus import GOOD_ROW, write_parquet

KEY = "sk-megarl-test-5f1d9c0b7e"
WANDB_KEY = "wandb-local-0123456789abcdef0123456789abcdef01234567"
PROXY_PASSWORD = "hunter2proxy"


@pytest.fixture(scope="module")
def guarded(model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[tuple[ManagedServer, Path]]:
    """An embedded server bound to 0.0.0.0 that requires KEY; (server, its log file)."""
    log_dir = tmp_path_factory.mktemp("guarded_logs")
    (server,) = launch_local_engines(str(model_dir), 1, host="0.0.0.0", num_threads=1,
                                     api_key=KEY, log_dir=log_dir, ready_timeout_s=300,
                                     extra_args=["--log-level", "debug"])
    server.url = server.url.replace("0.0.0.0", "127.0.0.1")
    yield server, log_dir / "engine_0.log"
    server.stop()


def routes() -> list[tuple[str, str]]:
    """(method, path) of every HTTP endpoint of the embedded server."""
    from fastapi.routing import APIRoute

    from megarl.rollout.local.server import build_app

    app = build_app(SimpleNamespace(engine=None, receiver=None, api_key=None))
    found = [(method, route.path) for route in app.routes if isinstance(route, APIRoute)
             for method in sorted(route.methods)]
    assert ("POST", "/megarl/weights") in found and ("POST", "/generate") in found
    return found


def test_servers_bind_loopback_unless_told_otherwise():
    from megarl.config.schema import RolloutConfig
    from megarl.rollout.local.server import build_parser

    assert build_parser().parse_args(["--model", "m"]).host == "127.0.0.1"
    assert RolloutConfig().host == "127.0.0.1" and RolloutConfig().api_key is None
    assert EngineSpec(model_path="m").host == "127.0.0.1"
    argv = build_local_command("m", port=1)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_a_non_loopback_bind_without_a_key_is_refused(model_dir):
    result = subprocess.run([sys.executable, "-m", "megarl.rollout.local.server", "--model",
                             str(model_dir), "--host", "0.0.0.0", "--port", "9"],
                            capture_output=True, text=True, timeout=120, check=False,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert result.stderr.strip().startswith(
        "--host 0.0.0.0: refusing to serve a non-loopback address without an API key")


def test_every_endpoint_requires_the_key(guarded):
    server, _ = guarded
    endpoints = routes()
    with httpx.Client(timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"authorization": f"bearer {KEY}"}):
            for method, path in endpoints:
                response = http.request(method, server.url + path, headers=headers,
                                        json={"rid": "", "abort_all": True, "tags": None,
                                              "new_version": "evil", "op": "begin"})
                assert response.status_code == 401, (method, path, headers)
                assert "Authorization: Bearer" in response.json()["message"]
                assert KEY not in response.text
        for path in ("/docs", "/openapi.json", "/nothing"):
            assert http.get(server.url + path).status_code == 401
        authorized = {"Authorization": f"Bearer {KEY}"}
        state = http.get(server.url + "/get_server_info", headers=authorized).json()
    # nothing the refused requests asked for happened
    assert state["internal_states"][0]["paused"] is False
    assert state["internal_states"][0]["released"] == []
    assert state["internal_states"][0]["weight_version"] == "default"


def test_the_client_sends_the_key_to_generation_control_and_weight_endpoints(guarded):
    server, _ = guarded

    async def scenario() -> tuple[list, list, str]:
        client = SGLangClient([server.url], api_key=KEY)
        anonymous = SGLangClient([server.url])
        try:
            samples = await client.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True))
            await client.pause("in_place")
            await client.resume()
            await client.update_weight_version("7")
            versions = await client.get_weight_version()
            with pytest.raises(EngineError) as refused:
                await anonymous.update_weight_version("evil")
            assert await anonymous.health() == [False]
            assert await client.health() == [True]
            await client.update_weight_version("default")
            return samples, versions, str(refused.value)
        finally:
            await client.close()
            await anonymous.close()

    samples, versions, refused = asyncio.run(scenario())
    assert len(samples[0].response_ids) == 3 and versions == ["7"]
    assert "missing or wrong API key" in refused and KEY not in refused
    assert server.healthy()  # ManagedServer's probe sends the key too


def test_the_weight_link_sends_the_key(guarded):
    from megarl.weights.links import HttpLink

    server, _ = guarded
    keyed, anonymous = HttpLink([server.url], timeout_s=30, api_key=KEY), HttpLink([server.url])
    try:
        (accepted,) = keyed.post([{"op": "abort", "reason": "test"}])()
        (refused,) = anonymous.post([{"op": "abort", "reason": "test"}])()
    finally:
        keyed.close()
        anonymous.close()
    assert accepted == {"ok": True}
    assert not refused["ok"] and "HTTP 401" in refused["error"] and KEY not in refused["error"]


def test_the_key_never_reaches_command_lines_logs_or_server_info(guarded, caplog):
    server, log_file = guarded
    with caplog.at_level(logging.DEBUG):
        async def scenario() -> None:
            client = SGLangClient([server.url], api_key=KEY)
            try:
                await client.generate([[5, 6]], SamplingParams(max_new_tokens=2))
                info = await client._json("GET", server.url + "/get_server_info")
                assert KEY not in str(info) and API_KEY_ENV not in str(info)
            finally:
                await client.close()

        asyncio.run(scenario())
    assert caplog.records and not [r for r in caplog.records if KEY in r.getMessage()]
    assert KEY not in " ".join(server.argv)
    cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    assert KEY.encode() not in cmdline
    log = log_file.read_text()
    assert "GET /get_server_info" in log and KEY not in log  # debug access log, no key
    assert KEY not in repr(server)
    assert KEY not in repr(EngineSpec(model_path="m", api_key=KEY))


@pytest.fixture
def secret_config(model_dir: Path, tmp_path: Path):
    """A run config holding an API key and a proxy URL with a password."""
    data = write_parquet(tmp_path / "train.parquet", [GOOD_ROW] * 8)
    cfg, sources = load_config_dict({
        "model": {"path": str(model_dir)}, "data": {"train_files": [str(data)]},
        "rollout": {"api_key": KEY, "host": "0.0.0.0", "backend": "local"},
        "trainer": {"output_dir": str(tmp_path / "run"), "loggers": ["console", "wandb"],
                    "wandb_proxy": f"http://me:{PROXY_PASSWORD}@proxy.local:3128"}})
    return cfg, sources


def test_secrets_stay_out_of_the_saved_config_and_config_show(secret_config, tmp_path,
                                                              monkeypatch, capsys):
    from megarl.cli import main
    from megarl.trainer import Trainer

    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    cfg, sources = secret_config
    assert KEY not in repr(cfg)
    Trainer(cfg, sources).save_config()  # what setup() writes to <output_dir>/config.yaml
    saved = (tmp_path / "run" / "config.yaml").read_text()
    rendered = render_config(cfg, sources)
    for text in (saved, rendered):
        assert KEY not in text and PROXY_PASSWORD not in text and WANDB_KEY not in text
        assert "api_key: null  # redacted secret: give it again (rollout.api_key=...)" in text
        assert "wandb_proxy: http://***@proxy.local:3128" in text
    reloaded = yaml.safe_load(saved)
    assert reloaded["rollout"]["api_key"] is None and reloaded["rollout"]["host"] == "0.0.0.0"
    overrides = [f"model.path={cfg.model.path}", f"data.train_files=[{cfg.data.train_files[0]}]",
                 "rollout.host=0.0.0.0", f"rollout.api_key={KEY}",
                 f"trainer.wandb_proxy=http://me:{PROXY_PASSWORD}@proxy.local:3128"]
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"rollout": {"backend": "local"}}))
    main(["config", "show", str(config), *overrides])
    shown = capsys.readouterr()
    assert "rollout:" in shown.out
    for secret in (KEY, PROXY_PASSWORD, WANDB_KEY):
        assert secret not in shown.out + shown.err
