"""Megatron train ranks -> checkpoint engine -> two real embedded engine servers, end to end.

A tiny Qwen3-MoE is built by Megatron under TP=2 and under EP=2 (two gloo ranks), its weights
are changed (``p * scale + shift``, a different change per case, so every sync must move new
bits), and rank 0 streams the export over each transport (nccl on gloo, nixl, ipc, disk) to two
embedded servers through ``POST /megarl/weights``. Then, on both engines:

- every HF tensor, read back through ``/get_weights_by_name`` in full, is bit-identical to the
  same change exported without model parallelism (rank 0 of TP=PP=EP=1: no gathers, no
  merges), and the engines' own checksums equal SHA-256 hashes of that export computed here;
- greedy generations equal those of plain transformers loaded from that export;
- ``weight_version`` is the update's; the sender held at most two buckets.

A plan with a wrong shape (sent directly, or from a TP=2 trainer built from another config) is
rejected by both engines, which keep serving the old weights; every train rank still returns.
The file takes about 1.5 minutes on 2 cores (servers and ranks are shared by all cases).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from dist_utils import RankPool
from e2e_ranks import BUCKET_MB, export_on_rank, rejected_sync_on_rank, sync_on_rank

from megarl.data.tiny_model import make_tiny_model
from megarl.megatron.parallel import ParallelSizes
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.local.weights import iter_safetensors
from megarl.rollout.process import ManagedServer
from megarl.weights import UpdateRejected, WeightSender
from megarl.weights.links import HttpLink
from megarl.weights.transports import IpcSender

pytestmark = pytest.mark.timeout(300)

KINDS = ["nccl", "nixl", "ipc", "disk"]
LAYOUTS = {"tp2": ParallelSizes(tp=2), "ep2": ParallelSizes(ep=2)}
PROMPTS = [[5, 9, 30, 31], [70, 71, 72, 73, 74, 75, 76], [100, 3]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE the engines start from (4 experts, 2 layers, fp32)."""
    return make_tiny_model(tmp_path_factory.mktemp("e2e") / "moe", arch="qwen3_moe", seed=3,
                           with_tokenizer=False)


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """Two gloo train ranks, shared by every case (started before the servers)."""
    ranks = RankPool(2)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def urls(pool: RankPool, model_dir: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two embedded engine servers on ``model_dir``."""
    servers: list[ManagedServer] = launch_local_engines(
        str(model_dir), 2, num_threads=1, seed=0,
        log_dir=tmp_path_factory.mktemp("engine_logs"), ready_timeout_s=180)
    yield [s.url for s in servers]
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One HTTP client for the test's own requests (a new connection per request costs 25 ms)."""
    with httpx.Client(timeout=60) as client:
        yield client


def engine_generations(http: httpx.Client, url: str) -> list[list[int]]:
    """Greedy continuations of PROMPTS on one engine."""
    body = {"input_ids": PROMPTS, "sampling_params": {"temperature": 0.0, "ignore_eos": True,
                                                      "max_new_tokens": NEW_TOKENS}}
    response = http.post(url + "/generate", json=body)
    response.raise_for_status()
    return [out["output_ids"] for out in response.json()]


def hf_generations(weights: dict[str, torch.Tensor], model_dir: Path,
                   out_dir: Path) -> list[list[int]]:
    """Greedy continuations of PROMPTS by transformers loaded from ``weights``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        (out_dir / name).write_bytes((model_dir / name).read_bytes())
    save_file({n: t.contiguous() for n, t in weights.items()}, str(out_dir / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in PROMPTS]


@pytest.fixture(scope="module")
def original_generations(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                         ) -> list[list[int]]:
    """What the unchanged model generates: every case's change must alter it."""
    return hf_generations(dict(iter_safetensors(model_dir)), model_dir,
                          tmp_path_factory.mktemp("original"))


def engine_tensor(http: httpx.Client, url: str, name: str) -> torch.Tensor:
    """One whole weight as the engine holds it (float32 values through JSON are exact)."""
    response = http.post(url + "/get_weights_by_name",
                         json={"name": name, "truncate_size": 1 << 30})
    response.raise_for_status()
    return torch.tensor(response.json(), dtype=torch.float32)


def weight_version(http: httpx.Client, url: str) -> str:
    """The engine's current weight version."""
    return http.get(url + "/model_info").json()["weight_version"]


def sha256_checksum(tensor: torch.Tensor) -> str:
    """megarl's checksum format, written independently: dtype[shape]:sha256(bytes)."""
    shape = ",".join(str(s) for s in tensor.shape)
    digest = hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()
    return f"{str(tensor.dtype).removeprefix('torch.')}[{shape}]:{digest}"


def change(case: int) -> tuple[float, float]:
    """A weight change that differs from case to case: sign, scale and shift."""
    return (-1.0) ** case * (1.0 + 0.125 * case), 0.001 * (case + 1)


CASES = [(layout, kind) for layout in LAYOUTS for kind in KINDS]


@pytest.mark.parametrize(("layout", "kind"), CASES, ids=[f"{lay}-{k}" for lay, k in CASES])
def test_megatron_to_two_engines(layout: str, kind: str, pool: RankPool, model_dir: Path,
                                 urls: list[str], http: httpx.Client,
                                 original_generations: list[list[int]], tmp_path: Path) -> None:
    case = CASES.index((layout, kind))
    scale, shift = change(case)
    reference, _ = pool.run(export_on_rank, str(model_dir), ParallelSizes(), scale, shift)[0]
    before = {url: engine_tensor(http, url, "model.layers.1.mlp.experts.3.down_proj.weight")
              for url in urls}
    version = f"{layout}-{kind}"
    replies = pool.run(sync_on_rank, str(model_dir), LAYOUTS[layout], scale, shift, kind, urls,
                       version, str(tmp_path / "disk"))
    report = replies[0]
    assert replies[1] is None
    assert report["num_tensors"] == len(reference) == 45
    assert report["mismatches"] == {0: [], 1: []}
    assert report["sender_checksums"] == {n: sha256_checksum(t) for n, t in reference.items()}
    bucket_bytes = int(BUCKET_MB * (1 << 20))
    assert report["num_buckets"] >= 8
    assert report["peak_buffer_bytes"] <= 2 * bucket_bytes < report["bytes"]

    expected = hf_generations(reference, model_dir, tmp_path / "hf")
    assert expected != original_generations
    for url in urls:
        assert weight_version(http, url) == version
        assert not torch.equal(before[url],
                               reference["model.layers.1.mlp.experts.3.down_proj.weight"])
        for name, tensor in reference.items():
            got = engine_tensor(http, url, name)
            assert got.shape == tensor.shape and torch.equal(got, tensor), (url, name)
        assert engine_generations(http, url) == expected, url


def test_export_specs_and_every_rank_agree_with_one_rank(pool: RankPool, model_dir: Path) -> None:
    """Every rank of a TP, EP or PP layout exports the one-rank tensors bit for bit, and
    specs() lists the stream's own names and shapes in its order."""
    (reference, ref_specs), _ = pool.run(export_on_rank, str(model_dir), ParallelSizes(), 1.0,
                                         0.0)
    assert ref_specs == [(n, list(t.shape)) for n, t in reference.items()]
    original = dict(iter_safetensors(model_dir))
    assert reference.keys() == original.keys()
    assert all(torch.equal(reference[n], original[n]) for n in original)
    for sizes in (ParallelSizes(tp=2), ParallelSizes(ep=2), ParallelSizes(pp=2)):
        ranks = pool.run(export_on_rank, str(model_dir), sizes, 1.0, 0.0)
        for exported, specs in ranks:
            # EP yields the experts of one local index together (0, 2, 1, 3 with 4 experts)
            assert specs == ranks[0][1] == [(n, list(t.shape)) for n, t in exported.items()]
            assert exported.keys() == reference.keys(), sizes
            assert all(torch.equal(exported[n], t) for n, t in reference.items()), sizes


def test_wrong_shape_is_rejected_and_engines_keep_serving(urls: list[str], model_dir: Path,
                                                          http: httpx.Client,
                                                          tmp_path: Path) -> None:
    """Both engines refuse a plan with one wrong shape; weights, version, outputs stay."""
    good = {n: t.mul(0.5) for n, t in iter_safetensors(model_dir)}
    link = HttpLink(urls, timeout_s=60)
    sender = WeightSender(IpcSender(), link, bucket_size_mb=BUCKET_MB)
    sender.connect()
    try:
        sender.update(good, version="good")
        served = [engine_generations(http, url) for url in urls]
        assert served[0] == served[1] == hf_generations(good, model_dir, tmp_path / "hf")
        q_proj = "model.layers.1.self_attn.q_proj.weight"
        bad = {n: t.neg() for n, t in good.items()}
        bad[q_proj] = torch.zeros(32, 128)
        with pytest.raises(UpdateRejected, match=r"begin failed on 2 of 2 engines: engine 0: "
                                                 r"WeightMismatch: weight model.layers.1.self_"
                                                 r"attn.q_proj.weight: sent with shape \[32, "
                                                 r"128\], the engine's model has \[64, 64\]"):
            sender.update(bad, version="bad")
        for url, outputs in zip(urls, served):
            assert weight_version(http, url) == "good"
            assert engine_generations(http, url) == outputs
            assert torch.equal(engine_tensor(http, url, q_proj), good[q_proj])
            embed = "model.embed_tokens.weight"
            assert torch.equal(engine_tensor(http, url, embed), good[embed])
    finally:
        sender.close()
        link.close()


def test_trainer_model_of_another_config_is_rejected(pool: RankPool, urls: list[str],
                                                     http: httpx.Client,
                                                     tmp_path: Path) -> None:
    """A TP=2 trainer whose experts are wider than the engines' is refused at ``begin``; both
    ranks return (the sender drains the export), the engines keep weights and version."""
    wider = make_tiny_model(tmp_path / "wider", arch="qwen3_moe", seed=5, with_tokenizer=False,
                            moe_intermediate_size=48)
    expert = "model.layers.0.mlp.experts.1.up_proj.weight"
    before = [(weight_version(http, url), engine_tensor(http, url, expert)) for url in urls]
    messages = pool.run(rejected_sync_on_rank, str(wider), LAYOUTS["tp2"], 1.0, 0.0, "ipc",
                        urls, "wider", str(tmp_path / "disk"))
    assert messages[1] is None
    # the first expert weight the export yields (megatron order: the layer's last expert)
    assert re.search(r"begin failed on 2 of 2 engines: engine 0: WeightMismatch: weight "
                     r"model\.layers\.0\.mlp\.experts\.\d+\.gate_proj\.weight: sent with shape "
                     r"\[48, 64\], the engine's model has \[32, 64\]", messages[0]), messages[0]
    for url, (version, tensor) in zip(urls, before):
        assert weight_version(http, url) == version
        assert torch.equal(engine_tensor(http, url, expert), tensor)
