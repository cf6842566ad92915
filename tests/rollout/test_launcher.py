"""Launch command lines, the missing-sglang error, and restarting dead server processes."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from megarl.rollout.local.launch import build_local_command
from megarl.rollout.process import ManagedServer, ServerStartError, ServerSupervisor, free_port
from megarl.rollout.sglang.launcher import (
    SGLangLaunchConfig,
    SGLangNotInstalled,
    build_router_command,
    build_sglang_command,
    launch_sglang_engines,
    require_module,
)


def test_sglang_command_line_has_the_rl_flags():
    cfg = SGLangLaunchConfig(
        model_path="/ckpt/Qwen3-30B-A3B", host="10.0.0.5", port=30010, tp_size=4, ep_size=4,
        mem_fraction_static=0.75, enable_memory_saver=True, enable_return_routed_experts=True,
        load_format="dummy", weight_version="0", skip_server_warmup=True, base_gpu_id=4,
        nccl_port=31000, extra_args=("--chunked-prefill-size", "8192"))
    assert build_sglang_command(cfg, python="/venv/bin/python") == [
        "/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/ckpt/Qwen3-30B-A3B",
        "--host", "10.0.0.5", "--port", "30010", "--tp-size", "4", "--ep-size", "4",
        "--mem-fraction-static", "0.75", "--load-format", "dummy", "--weight-version", "0",
        "--nccl-port", "31000", "--base-gpu-id", "4", "--enable-memory-saver",
        "--skip-tokenizer-init", "--enable-return-routed-experts", "--skip-server-warmup",
        "--chunked-prefill-size", "8192"]


def test_sglang_multi_node_command_and_its_validation():
    cfg = SGLangLaunchConfig(model_path="/m", tp_size=16, nnodes=2, node_rank=1,
                             dist_init_addr="10.0.0.1:5000", mem_fraction_static=None,
                             skip_tokenizer_init=False, enable_dp_attention=True, dp_size=2)
    assert build_sglang_command(cfg, python="py") == [
        "py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
        "--port", "30000", "--tp-size", "16", "--dp-size", "2", "--nnodes", "2",
        "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000", "--enable-dp-attention"]
    with pytest.raises(ValueError, match="dist_init_addr"):
        build_sglang_command(SGLangLaunchConfig(model_path="/m", nnodes=2))


def test_router_and_local_command_lines():
    assert build_router_command(["http://a:1", "http://b:2"], port=8000, python="py") == [
        "py", "-m", "sglang_router.launch_router", "--worker-urls", "http://a:1", "http://b:2",
        "--policy", "cache_aware", "--host", "127.0.0.1", "--port", "8000"]
    with pytest.raises(ValueError, match="policy"):
        build_router_command(["http://a:1"], policy="fastest")
    assert build_local_command("/m", port=9, num_threads=2, python="py") == [
        "py", "-m", "megarl.rollout.local.server", "--model", "/m", "--host", "127.0.0.1",
        "--port", "9", "--num-threads", "2"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang installed")
def test_missing_sglang_says_how_to_install_it(tmp_path):
    with pytest.raises(SGLangNotInstalled, match=r"pip install \"sglang\[all\]"):
        require_module("sglang")
    with pytest.raises(SGLangNotInstalled, match="rollout.backend=local"):
        launch_sglang_engines([SGLangLaunchConfig(model_path="/m")], log_dir=tmp_path)
    assert not (tmp_path / "sglang_0.log").exists()  # nothing was started
    other = tmp_path / "python"  # another interpreter path is probed in a subprocess
    other.symlink_to(sys.executable)
    require_module("json", python=str(other))
    with pytest.raises(SGLangNotInstalled, match=str(other)):
        require_module("sglang", python=str(other))


HEALTH_SERVER = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_supervisor_restarts_a_dead_server(tmp_path):
    port = free_port()
    server = ManagedServer([sys.executable, "-c", HEALTH_SERVER, str(port)],
                           f"http://127.0.0.1:{port}", name="toy", log_path=tmp_path / "toy.log")
    server.start()
    restarted = threading.Event()
    supervisor = ServerSupervisor([server], poll_s=0.1, ready_timeout_s=20,
                                  on_restart=lambda i: restarted.set())
    try:
        server.wait_ready(20)
        first_pid = server.process.pid
        supervisor.start()
        os.kill(first_pid, signal.SIGKILL)
        assert restarted.wait(20)
        assert server.restarts == 1 and server.process.pid != first_pid and server.healthy()
    finally:
        supervisor.stop()
        server.stop()
    assert not server.alive


def test_a_server_runs_in_its_own_process_group_of_the_callers_session(tmp_path):
    """stop() signals the server's process group (its children too: SGLang's schedulers), so
    the server leads one; but it stays in the caller's process session. In a session of its own
    it was a scheduling group of its own under the kernel's autogroup (on by default, and on
    the CI machines): with two other busy processes on 2 cores the demo's engine got ~4% of a
    core while runnable, and a 16 x 48-token generation took 0.5-28 s instead of 0.2 s."""
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print('child started', flush=True); time.sleep(60)")
    server = ManagedServer([sys.executable, "-c", script], f"http://127.0.0.1:{free_port()}",
                           name="group", log_path=tmp_path / "group.log")
    server.start()
    try:
        pid = server.process.pid
        assert os.getpgid(pid) == pid  # the leader of its own process group
        assert os.getsid(pid) == os.getsid(0)  # in the caller's session
        deadline = time.monotonic() + 20
        while "child started" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchildren = [p for p in _processes_in_group(pid) if p != pid]
        assert len(grandchildren) == 1, grandchildren
    finally:
        server.stop(timeout_s=5)
    deadline = time.monotonic() + 10
    while _processes_in_group(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_in_group(pid) == []  # the grandchild went with it


def _processes_in_group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


def test_a_server_that_exits_reports_its_log(tmp_path):
    script = "import sys; print('bad flag --foo'); sys.exit(3)"
    server = ManagedServer([sys.executable, "-c", script], f"http://127.0.0.1:{free_port()}",
                           name="broken", log_path=tmp_path / "broken.log")
    server.start()
    start = time.monotonic()
    with pytest.raises(ServerStartError, match="exited with code 3(.|\n)*bad flag --foo"):
        server.wait_ready(20)
    assert time.monotonic() - start < 10
    server.stop()


def test_a_seed_turns_on_deterministic_inference():
    argv = build_sglang_command(SGLangLaunchConfig(model_path="/m", random_seed=3), python="py")
    assert argv[-3:] == ["3", "--skip-tokenizer-init", "--enable-deterministic-inference"]
    assert "--enable-deterministic-inference" not in build_sglang_command(
        SGLangLaunchConfig(model_path="/m"), python="py")
    assert build_local_command("/m", port=9, seed=4, python="py")[-3:] == [
        "--random-seed", "4", "--enable-deterministic-inference"]


def test_an_fp8_sglang_engine_serves_an_fp8_config_with_dummy_weights(tmp_path):
    """rollout.quantization=fp8 on SGLang: the engine is launched with ``--quantization fp8
    --load-format dummy`` on a directory whose config.json carries the block-FP8
    quantization_config and which links every file of the model but its weights; the trainer
    syncs before the first generation. The embedded engine quantizes the checkpoint itself."""
    import json

    from megarl.config import load_config
    from megarl.config.validate_options import engines_start_without_weights
    from megarl.data.tiny_model import make_tiny_model
    from megarl.rollout.server_worker import EngineSpec, engine_command
    from megarl.trainer.workers import engine_spec
    from megarl.weights.fp8 import QUANTIZATION_CONFIG

    model = make_tiny_model(tmp_path / "model", arch="qwen3_moe")
    spec = EngineSpec(model_path=str(model), backend="sglang", quantization="fp8",
                      log_dir=str(tmp_path / "logs"))
    argv = engine_command(spec, rank=3, port=9, device="cuda")
    served = Path(argv[argv.index("--model-path") + 1])
    assert served == tmp_path / "logs" / "fp8_model_engine3"
    assert argv[argv.index("--quantization") + 1] == "fp8"
    assert argv[argv.index("--load-format") + 1] == "dummy"
    config = json.loads((served / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert config["hidden_size"] == json.loads((model / "config.json").read_text())["hidden_size"]
    linked = sorted(p.name for p in served.iterdir() if p.name != "config.json")
    assert linked and not [n for n in linked if n.endswith((".safetensors", ".bin"))]
    assert all((served / n).resolve() == (model / n).resolve() for n in linked)
    assert "tokenizer.json" in linked or "tokenizer_config.json" in linked
    # a second launch (an engine restart) reuses the directory
    assert engine_command(spec, rank=3, port=9, device="cuda") == argv
    local = engine_command(EngineSpec(model_path=str(model), quantization="fp8"), rank=0,
                           port=9, device="cpu")
    assert local[local.index("--quantization") + 1] == "fp8" and "--load-format" not in local
    demo = Path(__file__).parents[2] / "configs" / "tiny-moe-cpu.yaml"
    overrides = [f"model.path={model}", "rollout.quantization=fp8"]
    assert engines_start_without_weights(load_config(demo, [*overrides,
                                                            "rollout.backend=sglang"])[0])
    assert not engines_start_without_weights(load_config(demo, overrides)[0])
    assert not engines_start_without_weights(load_config(demo, ["rollout.backend=sglang"])[0])
    # rollout.load_format=dummy: any engine starts without reading the checkpoint, SGLang with
    # its own --load-format dummy, and the trainer syncs before the first generation
    for backend, device in (("local", "cpu"), ("sglang", "cuda")):
        dummy, _ = load_config(demo, [f"model.path={model}", f"rollout.backend={backend}",
                                      "rollout.load_format=dummy"])
        assert engines_start_without_weights(dummy)
        argv = engine_command(engine_spec(dummy, tmp_path), rank=0, port=9, device=device)
        assert argv[argv.index("--load-format") + 1] == "dummy", argv


def test_engines_for_the_adapter_sync_start_with_lora_serving(tmp_path):
    """actor.lora.sync=adapter: the embedded engine starts with --enable-lora; SGLang also with
    --max-lora-rank (the actor's rank) and --lora-target-modules (the HF projections of the
    actor's targets, every one SGLang's parser knows: tests/conformance). Both keep released
    weights in host memory (--enable-weights-cpu-backup; SGLang's only when colocated, where
    it releases them), since the adapter sync never resends the base; every other engine
    drops them."""
    from megarl.config import load_config
    from megarl.config.lora_layers import hf_leaf_modules
    from megarl.rollout.server_worker import engine_command
    from megarl.trainer.workers import engine_spec

    demo = Path(__file__).parents[2] / "configs" / "tiny-moe-cpu.yaml"
    adapter = ["actor.lora.rank=8", "actor.lora.sync=adapter"]
    cfg, _ = load_config(demo, [*adapter, "actor.lora.target_modules=[linear_qkv,linear_fc2]"])
    local = engine_command(engine_spec(cfg, tmp_path), rank=0, port=9, device="cpu")
    assert "--enable-lora" in local and "--enable-weights-cpu-backup" in local
    cfg, _ = load_config(demo, [*adapter, "actor.lora.target_modules=[linear_qkv,linear_fc2]",
                                "rollout.backend=sglang"])
    argv = engine_command(engine_spec(cfg, tmp_path), rank=0, port=9, device="cuda")
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "8"
    assert "--enable-weights-cpu-backup" not in argv  # separate pools: never released
    colocated, _ = load_config(demo, [*adapter, "rollout.backend=sglang", "rollout.colocate=true",
                                      "resources.rollout_pool=null"])
    assert "--enable-weights-cpu-backup" in engine_command(
        engine_spec(colocated, tmp_path), rank=0, port=9, device="cuda")
    start = argv.index("--lora-target-modules") + 1
    assert argv[start:start + 4] == ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert hf_leaf_modules(None) == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj")
    # a routed expert's projections, as SGLang names them (experts.{e}.gate_proj, ...)
    assert hf_leaf_modules(["linear_proj", "experts.linear_fc2", "experts.linear_fc1"]) == (
        "o_proj", "down_proj", "gate_proj", "up_proj")
    merged, _ = load_config(demo, ["actor.lora.rank=8", "rollout.backend=sglang",
                                   "rollout.colocate=true", "resources.rollout_pool=null"])
    argv = engine_command(engine_spec(merged, tmp_path), rank=0, port=9, device="cuda")
    assert "--enable-lora" not in argv and "--enable-weights-cpu-backup" not in argv
    merged, _ = load_config(demo, ["actor.lora.rank=8"])
    assert "--enable-weights-cpu-backup" not in engine_command(engine_spec(merged, tmp_path),
                                                               rank=0, port=9, device="cpu")


def test_fp8_engines_keep_the_attention_in_the_model_dtype_when_asked(tmp_path):
    """``rollout.fp8_attention=false``: SGLang's FP8 config lists the attention in
    ``ignored_layers`` (what its is_layer_skipped reads), the embedded server gets
    ``--fp8-ignored-layers self_attn``, and the sync's plan sends those weights unquantized."""
    import json

    from megarl.config import load_config, validate_config
    from megarl.data.tiny_model import make_tiny_model
    from megarl.rollout.server_worker import engine_command
    from megarl.trainer.workers import engine_spec
    from megarl.weights.fp8 import QUANTIZATION_CONFIG

    model = make_tiny_model(tmp_path / "model", arch="qwen3_moe")
    demo = Path(__file__).parents[2] / "configs" / "tiny-moe-cpu.yaml"
    base = [f"model.path={model}", "rollout.quantization=fp8", "rollout.fp8_attention=false"]
    sglang, _ = load_config(demo, [*base, "rollout.backend=sglang"])
    argv = engine_command(engine_spec(sglang, tmp_path), rank=0, port=9, device="cuda")
    config = json.loads((Path(argv[argv.index("--model-path") + 1]) / "config.json").read_text())
    assert config["quantization_config"] == {**QUANTIZATION_CONFIG, "ignored_layers": ["self_attn"]}
    local, _ = load_config(demo, base)
    argv = engine_command(engine_spec(local, tmp_path), rank=0, port=9, device="cpu")
    assert argv[argv.index("--fp8-ignored-layers") + 1:][:1] == ["self_attn"]
    default, _ = load_config(demo, [f"model.path={model}", "rollout.quantization=fp8"])
    assert "--fp8-ignored-layers" not in engine_command(engine_spec(default, tmp_path), rank=0,
                                                        port=9, device="cpu")
    # without FP8 engines the setting has nothing to act on: refused, naming both fields
    plain, _ = load_config(demo, [f"model.path={model}", "rollout.fp8_attention=false"])
    errors = [p for p in validate_config(plain, allow_missing_files=True) if p.is_error]
    assert any("rollout.fp8_attention" in p.fields and "rollout.quantization=fp8" in p.fix
               for p in errors), errors


def test_engine_token_budget_and_sglang_flags_reach_the_command_lines(tmp_path):
    """rollout.max_prefill_tokens goes to both engines (the embedded server's flag is SGLang's),
    chunked prefill and the verbatim flags to SGLang's (refused with the embedded engine:
    tests/config)."""
    from megarl.config import load_config
    from megarl.rollout.server_worker import engine_command
    from megarl.trainer.workers import engine_spec

    demo = Path(__file__).parents[2] / "configs" / "tiny-moe-cpu.yaml"
    cfg, _ = load_config(demo, ["rollout.max_prefill_tokens=4096"])
    local = engine_command(engine_spec(cfg, tmp_path), rank=0, port=9, device="cpu")
    assert local[local.index("--max-prefill-tokens") + 1] == "4096"
    cfg, _ = load_config(demo, ["rollout.backend=sglang", "rollout.max_prefill_tokens=4096",
                                "rollout.chunked_prefill_size=2048",
                                "rollout.sglang_args=[--cuda-graph-max-bs,'256']"])
    argv = engine_command(engine_spec(cfg, tmp_path), rank=0, port=9, device="cuda")
    assert argv[argv.index("--max-prefill-tokens") + 1] == "4096"
    assert argv[argv.index("--chunked-prefill-size") + 1] == "2048"
    assert argv[-2:] == ["--cuda-graph-max-bs", "256"]
