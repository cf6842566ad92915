"""Every leaf field of RunConfig acts or is refused (issue 20, item 2).

FIELDS holds one row per dotted field name; each row's check is run against a small valid run
(the tiny MoE model on a 2-GPU train pool) and asserts one of:
- spec: changing the value changes a built object (the actor/critic/engine spec, the engine's
  argv, the sampling params, the derived sizes, the memory estimate, the KL controller, the
  fully_async queue capacity, the checkpoint steps);
- refused: validation (which includes config/not_built.py's list of machinery not built yet)
  reports an error naming the field for some value;
- derived: a documented input of `megarl config show`'s sizes or estimates only;
- read: run-time code reads the field (the names appear in its bytecode, docstrings excluded);
  weaker than spec, used where the consumer needs a running trainer (data files, trackers, Ray).
Fields that are accepted and then ignored are listed in KNOWN_IGNORED (issue 20's debts); that
set may only shrink. A new field without a row fails test_every_field_has_a_row.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import megarl.trainer as trainer_module
from megarl import memory_preflight
from megarl.config import load_config_dict, validate_config
from megarl.config.derived import derive_sizes
from megarl.config.estimates import estimate
from megarl.config.model_info import load_model_info
from megarl.config.schema import RunConfig
from megarl.config.schema_common import Section
from megarl.scheduler import dynamic_sampling, fully_async
from megarl.trainer import Trainer
from megarl.trainer import base as trainer_base
from megarl.trainer import checkpoint as trainer_checkpoint
from megarl.trainer import main as trainer_main
from megarl.trainer import phases as trainer_phases
from megarl.trainer import workers as trainer_workers


def leaf_fields(cls: type[Section] = RunConfig, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field (sections, optional ones included, are walked into)."""
    names = []
    for name, info in cls.model_fields.items():
        ann = info.annotation
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        sections = [a for a in (typing.get_args(ann) if union else (ann,))
                    if isinstance(a, type) and issubclass(a, Section)]
        if sections:
            names += leaf_fields(sections[0], f"{prefix}{name}.")
        else:
            names.append(prefix + name)
    return names


@dataclass
class Run:
    """The base run: a tiny MoE model dir and an (empty) data file on disk."""

    model: Path
    data: Path
    tmp: Path

    def base(self) -> dict[str, Any]:
        """A run that validates without any problem."""
        return {
            "model": {"path": str(self.model)},
            "data": {"train_files": [str(self.data)], "train_batch_size": 8,
                     "max_prompt_length": 64, "max_response_length": 64},
            "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
            "rollout": {"n": 4},
            "resources": {"device": "cuda", "gpu_memory_gb": 80,
                          "train_pool": {"nnodes": 1, "gpus_per_node": 2}},
            "trainer": {"loggers": ["console"]},
        }

    def config(self, *overrides: str) -> tuple[RunConfig, dict[str, str]]:
        """The base config with ``key=value`` overrides."""
        return load_config_dict(self.base(), list(overrides))

    def built(self, *overrides: str) -> dict[str, Any]:
        """Everything the config is turned into without starting a process."""
        from megarl.rollout.server_worker import engine_command
        from megarl.trainer import Trainer
        from megarl.trainer.critic import critic_spec
        from megarl.trainer.workers import actor_spec, engine_spec, weight_sync_backend

        cfg, _ = self.config(*overrides)
        info = load_model_info(cfg.model.path)
        sizes = derive_sizes(cfg, info)
        engine = engine_spec(cfg, self.tmp / "logs")
        trainer = Trainer(cfg)
        trainer.loop.close()
        trainer.tokenizer = types.SimpleNamespace(eos_token_id=1)
        kl = trainer.kl_ctrl
        agent = trainer_module.make_agent_loop(cfg, trainer.tokenizer)
        return {"agent": None if agent is None else {
                    "settings": agent.settings, "tools": agent.tools, "env": agent.env_factory,
                    "max_tool_response_length": agent.max_tool_response_length},
                "actor": actor_spec(cfg), "critic": critic_spec(cfg), "engine": engine,
                "argv": engine_command(engine, rank=0, port=1, device="cuda"),
                "sampling": trainer.sampling_params(), "sizes": sizes,
                "estimate": estimate(cfg, info, sizes),
                "kl_ctrl": None if kl is None else vars(kl),
                "generation": trainer.generation_options(),
                "seeds": trainer.prompt_seeds(1, 2), "weight_sync": weight_sync_backend(cfg),
                "queue_capacity": fully_async.queue_capacity(
                    cfg.scheduler, cfg.data.train_batch_size, cfg.rollout.n),
                "save_due": [trainer_checkpoint.save_due(types.SimpleNamespace(
                    cfg=cfg, steps_done=step)) for step in range(1, cfg.trainer.total_steps + 1)]}

    def errors_naming(self, field: str, *overrides: str) -> list[str]:
        """Validation errors of the base + overrides that name ``field``."""
        cfg, sources = self.config(*overrides)
        return [p.line() for p in validate_config(cfg, sources=sources)
                if p.is_error and any(f == field or f.startswith(field + ".") for f in p.fields)]


def dig(obj: Any, path: str) -> Any:
    """``obj["a"].b.c`` for path ``a.b.c``."""
    head, *rest = path.split(".")
    obj = obj[head]
    for part in rest:
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


Check = Callable[[Run, str], None]


@dataclass(frozen=True)
class Row:
    """How one field acts: its kind and the check that shows it."""

    kind: str
    check: Check


def spec(value: Any, where: str, *extra: str) -> Row:
    """Setting the field to ``value`` (on top of ``extra``) changes ``built()[where]``."""
    def check(run: Run, field: str) -> None:
        before, after = run.built(*extra), run.built(*extra, f"{field}={value}")
        assert dig(before, where) != dig(after, where), f"{field}={value} left {where} unchanged"
    return Row("spec", check)


def derived(value: Any, where: str, *extra: str) -> Row:
    """A documented input of the derived sizes / estimates only: ``built()[where]`` changes."""
    return Row("derived", spec(value, where, *extra).check)


def refused(value: Any, *extra: str) -> Row:
    """Validation refuses ``value`` (on top of ``extra``) with an error naming the field."""
    def check(run: Run, field: str) -> None:
        assert not run.errors_naming(field, *extra), f"the base already refuses {field}"
        assert run.errors_naming(field, *extra, f"{field}={value}"), f"{field}={value} accepted"
    return Row("refused", check)


def code_names(consumer: Any) -> set[str]:
    """Names and attributes the code of a function or module uses (docstrings excluded)."""
    if inspect.ismodule(consumer):
        code = compile(inspect.getsource(consumer), consumer.__file__, "exec")
    else:
        code = consumer.__code__
    names, todo = set(), [code]
    while todo:
        current = todo.pop()
        names |= set(current.co_names)
        todo += [c for c in current.co_consts if inspect.iscode(c)]
    return names


def reads(consumer: Any, *names: str) -> Row:
    """``consumer`` (run-time code that needs a live trainer) reads the field: its code uses
    ``names`` (default: the field's section and key, e.g. ``data`` and ``seed``)."""
    def check(run: Run, field: str) -> None:
        wanted = set(names or field.split(".")[-2:])
        missing = wanted - code_names(consumer)
        assert not missing, f"{consumer.__name__} does not read {field} (no {sorted(missing)})"
    return Row("read", check)


GAE = "algorithm.adv_estimator=gae"
MULTI_TURN = "rollout.multi_turn.enable=true"
CALCULATOR = "rollout.multi_turn.tools=[megarl.rollout.agent:calculator]"
KL_IN_REWARD = "algorithm.use_kl_in_reward=true"
SEPARATE = ("rollout.colocate=false", "resources.rollout_pool.nnodes=1",
            "resources.rollout_pool.gpus_per_node=2")


def parallel_rows(role: str, *extra: str) -> dict[str, Row]:
    """The layout fields of ``role``, read from its spec's ParallelSizes."""
    return {
        f"{role}.parallel.tp": spec(2, f"{role}.sizes.tp", *extra),
        f"{role}.parallel.pp": spec(2, f"{role}.sizes.pp", *extra),
        f"{role}.parallel.vpp": spec(2, f"{role}.sizes.vpp", f"{role}.parallel.pp=2", *extra),
        f"{role}.parallel.ep": spec(2, f"{role}.sizes.ep", *extra),
        f"{role}.parallel.etp": spec(1, f"{role}.sizes.etp", *extra),
        f"{role}.parallel.cp": spec(2, f"{role}.sizes.cp", *extra),
        f"{role}.parallel.sequence_parallel": spec(
            "false", f"{role}.sizes.sequence_parallel", f"{role}.parallel.tp=2", *extra),
    }


def optim_rows(role: str, *extra: str) -> dict[str, Row]:
    """The optimizer fields of ``role``, read from its spec's OptimizerSettings."""
    return {
        f"{role}.optim.lr": spec(3e-6, f"{role}.optim.lr", *extra),
        f"{role}.optim.weight_decay": spec(0.1, f"{role}.optim.weight_decay", *extra),
        f"{role}.optim.betas": spec("[0.9,0.95]", f"{role}.optim.betas", *extra),
        f"{role}.optim.lr_warmup_steps": spec(5, f"{role}.optim.lr_warmup_steps", *extra),
        f"{role}.optim.lr_decay_style": spec("cosine", f"{role}.optim.lr_decay_style", *extra),
        f"{role}.optim.min_lr": spec(1e-7, f"{role}.optim.min_lr", *extra),
    }


FIELDS: dict[str, Row] = {
    # model
    "model.path": refused("/nonexistent/model"),
    "model.tokenizer_path": refused("/nonexistent/tokenizer"),
    "model.dtype": spec("float32", "actor.dtype"),
    "model.mcore_checkpoint": spec("/ckpt", "actor.init_checkpoint"),
    "model.trust_remote_code": spec("true", "argv"),
    # data
    "data.train_files": reads(Trainer.setup),
    "data.val_files": reads(Trainer.setup),
    "data.prompt_key": reads(Trainer.setup),
    "data.max_prompt_length": spec(128, "actor.max_tokens_per_micro_batch"),
    "data.max_response_length": spec(128, "sampling.max_new_tokens"),
    "data.train_batch_size": spec(16, "actor.optim.total_steps"),
    "data.val_batch_size": reads(Trainer.validate),
    "data.shuffle": reads(Trainer.setup),
    "data.seed": reads(Trainer.setup),
    # actor
    "actor.ppo_mini_batch_size": spec(2, "actor.optim.total_steps"),
    "actor.ppo_micro_batch_size": refused(4),
    "actor.ppo_micro_batch_size_per_gpu": spec(4, "actor.max_tokens_per_micro_batch"),
    "actor.use_dynamic_bsz": spec("true", "actor.max_tokens_per_micro_batch"),
    "actor.ppo_max_token_len_per_gpu": spec(8192, "actor.max_tokens_per_micro_batch",
                                            "actor.use_dynamic_bsz=true"),
    "actor.ppo_epochs": spec(2, "actor.optim.total_steps"),
    "actor.clip_ratio_low": spec(0.1, "actor.loss.clip_ratio_low"),
    "actor.clip_ratio_high": spec(0.3, "actor.loss.clip_ratio_high"),
    "actor.clip_ratio_c": spec(4.0, "actor.loss.clip_ratio_c"),
    "actor.loss_agg_mode": spec("seq-mean-token-sum", "actor.loss.loss_agg_mode"),
    "actor.entropy_coeff": spec(0.01, "actor.loss.entropy_coeff"),
    "actor.use_kl_loss": spec("true", "actor.loss.use_kl_loss"),
    "actor.kl_loss_coef": spec(0.01, "actor.loss.kl_loss_coef"),
    "actor.kl_loss_type": spec("k1", "actor.loss.kl_loss_type"),
    "actor.policy_loss.loss_mode": spec("cispo", "actor.loss.loss_mode"),
    "actor.policy_loss.clip_cov_ratio": spec(1e-3, "actor.loss.clip_cov_ratio"),
    "actor.policy_loss.clip_cov_lb": spec(0.5, "actor.loss.clip_cov_lb"),
    "actor.policy_loss.clip_cov_ub": spec(4.0, "actor.loss.clip_cov_ub"),
    "actor.policy_loss.kl_cov_ratio": spec(1e-3, "actor.loss.kl_cov_ratio"),
    "actor.policy_loss.ppo_kl_coef": spec(0.5, "actor.loss.ppo_kl_coef"),
    "actor.tau_pos": spec(2.0, "actor.loss.tau_pos"),
    "actor.tau_neg": spec(2.0, "actor.loss.tau_neg"),
    "actor.grad_clip": spec(0.5, "actor.optim.grad_clip"),
    **optim_rows("actor"),
    **parallel_rows("actor"),
    "actor.use_distributed_optimizer": spec("false", "actor.optim.use_distributed_optimizer"),
    "actor.offload.param_offload": spec("true", "actor.offload.param_offload"),
    "actor.offload.grad_offload": spec("false", "actor.offload.grad_offload"),  # null: colocated
    "actor.offload.optimizer_offload": spec("false", "actor.offload.optimizer_offload"),
    "actor.offload.optimizer_step_chunk_mb": spec(256, "actor.offload.optimizer_step_chunk_mb"),
    "actor.recompute.granularity": spec("full", "actor.recompute"),
    "actor.recompute.method": spec("block", "actor.recompute", "actor.recompute.granularity=full"),
    "actor.recompute.num_layers": spec(2, "actor.recompute", "actor.recompute.granularity=full"),
    "actor.recompute.modules": spec("[mlp]", "actor.recompute",
                                    "actor.recompute.granularity=selective"),
    "actor.router_replay.mode": spec("R2", "actor.router_replay"),
    "actor.router_replay.diagnose_no_replay": reads(Trainer.compute_old_log_probs),
    "actor.lora.rank": spec(8, "actor.lora.rank"),
    "actor.lora.alpha": spec(32, "actor.lora.alpha", "actor.lora.rank=8"),
    "actor.lora.dropout": spec(0.1, "actor.lora.dropout", "actor.lora.rank=8"),
    "actor.lora.target_modules": spec("[linear_qkv]", "actor.lora.target_modules",
                                      "actor.lora.rank=8"),
    "actor.lora.exclude_modules": spec("[layers.0.*]", "actor.lora.exclude_modules",
                                       "actor.lora.rank=8"),
    "actor.lora.sync": spec("adapter", "argv", "actor.lora.rank=8", "rollout.backend=local"),
    "actor.cuda_graphs": spec("true", "actor.cuda_graphs"),
    "actor.cuda_graph_bucket_tokens": spec(512, "actor.cuda_graph_bucket_tokens"),
    "actor.log_prob_micro_batch_size_per_gpu": spec(
        4, "actor.log_prob_max_tokens_per_micro_batch"),
    "actor.log_prob_max_token_len_per_gpu": spec(
        65536, "actor.log_prob_max_tokens_per_micro_batch", "actor.use_dynamic_bsz=true"),
    # ref
    "ref.enabled": spec("true", "actor.with_ref"),
    "ref.offload.param_offload": spec("true", "actor.ref_param_offload"),
    "ref.log_prob_micro_batch_size_per_gpu": spec(4, "actor.ref_max_tokens_per_micro_batch"),
    "ref.log_prob_max_token_len_per_gpu": spec(65536, "actor.ref_max_tokens_per_micro_batch",
                                               "actor.use_dynamic_bsz=true"),
    **{f"ref.parallel.{name}": refused(value) for name, value in (
        ("tp", 2), ("pp", 2), ("vpp", 2), ("ep", 2), ("etp", 2), ("cp", 2),
        ("sequence_parallel", "false"))},
    # critic (on with gae)
    "critic.enabled": reads(trainer_workers),
    "critic.model_path": spec("/critic", "critic.model_path", GAE),
    **optim_rows("critic", GAE),
    "critic.ppo_mini_batch_size": spec(2, "critic.optim.total_steps", GAE),
    "critic.ppo_micro_batch_size_per_gpu": spec(4, "critic.max_tokens_per_micro_batch", GAE),
    "critic.ppo_epochs": spec(2, "critic.optim.total_steps", GAE),
    "critic.cliprange_value": spec(0.2, "critic.loss.cliprange_value", GAE),
    "critic.grad_clip": spec(0.5, "critic.optim.grad_clip", GAE),
    **parallel_rows("critic", GAE),
    "critic.offload.param_offload": spec("true", "critic.offload.param_offload", GAE),
    "critic.offload.grad_offload": spec("false", "critic.offload.grad_offload", GAE),
    "critic.offload.optimizer_offload": spec("false", "critic.offload.optimizer_offload", GAE),
    "critic.offload.optimizer_step_chunk_mb": spec(256, "critic.offload.optimizer_step_chunk_mb",
                                                   GAE),
    # rollout
    "rollout.backend": spec("local", "argv"),
    "rollout.n": spec(2, "sampling.n"),
    "rollout.gpus_per_engine": spec(2, "argv"),
    "rollout.temperature": spec(0.7, "sampling.temperature"),
    "rollout.top_p": spec(0.9, "sampling.top_p"),
    "rollout.top_k": spec(20, "sampling.top_k"),
    "rollout.max_num_seqs": spec(7, "argv"),
    "rollout.gpu_memory_utilization": spec(0.5, "argv"),
    "rollout.colocate": spec("false", "argv", *SEPARATE[1:]),
    "rollout.enable_return_routed_experts": spec("true", "argv"),
    "rollout.dtype": spec("float32", "argv"),
    "rollout.quantization": spec("fp8", "argv", "rollout.backend=local"),
    "rollout.fp8_attention": spec("false", "argv", "rollout.backend=local",
                                  "rollout.quantization=fp8"),
    "rollout.load_format": spec("dummy", "argv", "rollout.backend=local"),
    "rollout.api_key": spec("secret", "argv"),
    "rollout.max_prefill_tokens": spec(4096, "argv"),
    "rollout.chunked_prefill_size": spec(4096, "argv"),
    "rollout.sglang_args": spec("[--cuda-graph-max-bs,'256']", "argv"),
    "rollout.host": spec("127.0.0.2", "argv"),
    "rollout.multi_turn.enable": spec("true", "agent", CALCULATOR),
    "rollout.multi_turn.max_assistant_turns": spec(2, "agent", MULTI_TURN, CALCULATOR),
    "rollout.multi_turn.max_user_turns": spec(2, "agent", MULTI_TURN, CALCULATOR),
    "rollout.multi_turn.max_tokens_per_turn": spec(8, "agent", MULTI_TURN, CALCULATOR),
    "rollout.multi_turn.format": reads(trainer_module.make_agent_loop),
    "rollout.multi_turn.tools": spec("[megarl.rollout.agent:code_interpreter]", "agent",
                                     MULTI_TURN),
    "rollout.multi_turn.env": spec("megarl.rollout.agent:ToolEnvironment", "agent",
                                   MULTI_TURN),
    "rollout.multi_turn.max_tool_response_length": spec(8, "agent", MULTI_TURN, CALCULATOR),
    # checkpoint engine
    "checkpoint_engine.backend": spec("nccl", "weight_sync"),
    "checkpoint_engine.bucket_size_mb": reads(trainer_workers),
    # algorithm
    "algorithm.adv_estimator": reads(Trainer.compute_advantages),
    "algorithm.norm_adv_by_std_in_grpo": reads(Trainer.compute_advantages),
    "algorithm.gamma": reads(Trainer.compute_advantages, "algorithm", "gamma"),
    "algorithm.lam": reads(Trainer.compute_advantages, "algorithm", "lam"),
    "algorithm.use_kl_in_reward": spec("true", "kl_ctrl"),
    "algorithm.kl_penalty": refused("full", KL_IN_REWARD),
    "algorithm.kl_ctrl.type": spec("adaptive", "kl_ctrl", KL_IN_REWARD),
    "algorithm.kl_ctrl.kl_coef": spec(0.01, "kl_ctrl", KL_IN_REWARD),
    "algorithm.kl_ctrl.horizon": spec(100, "kl_ctrl", KL_IN_REWARD,
                                      "algorithm.kl_ctrl.type=adaptive"),
    "algorithm.kl_ctrl.target_kl": spec(0.5, "kl_ctrl", KL_IN_REWARD,
                                        "algorithm.kl_ctrl.type=adaptive"),
    "algorithm.filter_groups.enable": reads(fully_async),
    "algorithm.filter_groups.max_num_gen_batches": reads(dynamic_sampling),
    "algorithm.filter_groups.metric": refused("acc"),
    "algorithm.rollout_correction.rollout_is": reads(trainer_phases),
    "algorithm.rollout_correction.rollout_is_threshold": reads(trainer_phases,
                                                                "rollout_correction"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": reads(trainer_phases),
    "algorithm.rollout_correction.rollout_rs": reads(trainer_phases, "rollout_correction",
                                                     "rs_criteria"),
    "algorithm.rollout_correction.rollout_rs_threshold": reads(trainer_phases,
                                                                "rollout_correction"),
    "algorithm.rollout_correction.rollout_rs_threshold_lower": reads(trainer_phases,
                                                                      "rollout_correction"),
    "algorithm.rollout_correction.bypass_mode": reads(trainer_phases),
    # scheduler
    "scheduler.mode": refused("one_step_off"),
    "scheduler.staleness_threshold": spec(0.5, "queue_capacity"),
    "scheduler.trigger_parameter_sync_step": spec(2, "queue_capacity"),
    "scheduler.partial_rollout": reads(fully_async, "partial_rollout"),
    "scheduler.max_queue_length": spec(10, "queue_capacity"),
    # resources
    "resources.train_pool.nnodes": spec(2, "argv"),
    "resources.train_pool.gpus_per_node": spec(4, "argv"),
    "resources.rollout_pool.nnodes": spec(2, "argv", *SEPARATE),
    "resources.rollout_pool.gpus_per_node": spec(4, "argv", *SEPARATE),
    "resources.device": reads(trainer_workers),
    # documented as an input of the estimates only (a too small GPU is a warning)
    "resources.gpu_memory_gb": derived(40, "estimate"),
    # trainer
    "trainer.total_steps": spec(7, "actor.optim.total_steps"),
    "trainer.output_dir": reads(Trainer.__init__),
    "trainer.save_every": spec(10, "save_due"),
    "trainer.resume": spec("never", "save_due"),
    "trainer.keep_last": reads(trainer_checkpoint),
    "trainer.async_save": reads(trainer_checkpoint),
    "trainer.loggers": reads(Trainer.setup),
    "trainer.project_name": reads(Trainer.setup),
    "trainer.experiment_name": reads(Trainer.setup),
    "trainer.wandb_proxy": reads(Trainer.setup),
    "trainer.worker_group": reads(trainer_base),
    "trainer.val_every": reads(Trainer.setup),
    "trainer.phase_timeout_s": reads(trainer_main),
    "trainer.seed": spec(7, "actor.seed"),
    "trainer.max_nonfinite_updates": reads(Trainer.__init__),
    "trainer.preflight": reads(memory_preflight.device_preflight),
    # reward
    "reward.function": reads(Trainer.setup),
    "reward.batched": reads(Trainer.setup),
    "reward.format_score": reads(Trainer.setup),
    "reward.timeout_s": reads(Trainer.setup),
    "reward.num_workers": reads(Trainer.setup),
    # ray
    "ray.address": reads(trainer_workers),
    "ray.num_cpus": reads(trainer_workers),
    "ray.timeline_file": reads(trainer_base),
}

# Accepted and ignored: neither reaches a build nor is refused (issue 20's debts, all paid). This
# set may only shrink.
KNOWN_IGNORED: dict[str, str] = {}


@pytest.fixture(scope="module")
def run(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The base run over the session's tiny MoE model."""
    tmp = tmp_path_factory.mktemp("acts")
    data = tmp / "train.parquet"
    data.write_bytes(b"")
    return Run(model=tiny_moe_dir, data=data, tmp=tmp)


def test_base_run_validates_cleanly(run: Run) -> None:
    cfg, sources = run.config()
    assert validate_config(cfg, sources=sources) == []


def test_every_field_has_a_row() -> None:
    fields = set(leaf_fields())
    missing = fields - set(FIELDS) - set(KNOWN_IGNORED)
    assert not missing, f"fields without a row in FIELDS: {sorted(missing)}"
    stale = (set(FIELDS) | set(KNOWN_IGNORED)) - fields
    assert not stale, f"rows of fields that no longer exist: {sorted(stale)}"
    assert not set(FIELDS) & set(KNOWN_IGNORED)


def test_known_ignored_only_shrinks() -> None:
    """Paying a debt removes its entry; nothing new may be accepted and ignored."""
    assert set(KNOWN_IGNORED) == set()


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_field_acts(run: Run, field: str) -> None:
    FIELDS[field].check(run, field)


def test_trust_remote_code_reaches_every_loader(run: Run) -> None:
    """Actor, critic, both engine backends (their argv parses) and the prompt tokenizer."""
    from megarl.rollout.local.server import build_parser

    sglang = run.built("model.trust_remote_code=true", GAE)
    assert sglang["actor"].trust_remote_code and sglang["critic"].trust_remote_code
    assert "--trust-remote-code" in sglang["argv"]
    local = run.built("model.trust_remote_code=true", "rollout.backend=local")["argv"]
    args = build_parser().parse_args(local[local.index("--model"):])
    assert args.trust_remote_code
    assert "trust_remote_code" in code_names(Trainer.setup)


def test_dynamic_token_budget_counts_per_cp_rank(run: Run) -> None:
    """ppo_max_token_len_per_gpu is per GPU: a packed row of a model replica with cp=2 holds
    twice as many tokens (actor and critic), as `megarl config show` prints."""
    built = run.built(GAE, "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=8192",
                      "actor.parallel.cp=2")
    assert built["actor"].max_tokens_per_micro_batch == 16384
    assert built["critic"].max_tokens_per_micro_batch == 16384
    assert built["sizes"].token_budget_per_micro_batch == 16384
    # the log-prob forwards: their own budget, per GPU too; the reference's defaults to it
    built = run.built(GAE, "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=8192",
                      "actor.log_prob_max_token_len_per_gpu=32768", "actor.parallel.cp=2")
    assert built["actor"].log_prob_max_tokens_per_micro_batch == 65536
    assert built["actor"].ref_max_tokens_per_micro_batch == 65536
    assert built["actor"].max_tokens_per_micro_batch == 16384
