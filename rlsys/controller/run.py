"""Building a run: every object ``loop.step`` uses, made once from the config, closed once.

The three modes are three choices of objects, made here and nowhere else:

===============  ==========================  ================  ================  ===============
mode             batches from                Megatron roles    weight sync       checkpoints
===============  ==========================  ================  ================  ===============
full             ``EngineRollout`` (engines)  actor, ref, ...   ``EngineSync``    ``Checkpoints``
rollout          ``EngineRollout``            none              ``NoSync``        ``NoCheckpoints``
train            ``Replay`` (saved batches)   actor, ref, ...   ``NoSync``        ``Checkpoints``
===============  ==========================  ================  ================  ===============
"""

from __future__ import annotations

import functools
import json
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlsys.algorithms import AdaptiveKLController, FixedKLController
from rlsys.architectures.hf_checkpoint import HFCheckpoint
from rlsys.architectures.hf_config import read_arch
from rlsys.config import RunConfig, config_to_dict, dump_yaml
from rlsys.config.resolve import resolve
from rlsys.controller.ahead import AheadRollout, pending_dir
from rlsys.controller.checkpoints import Checkpoints, NoCheckpoints
from rlsys.controller.colocation import Turns
from rlsys.controller.group import RoleGroup
from rlsys.controller.placement import Placement
from rlsys.controller.replay import Replay, rollout_dir
from rlsys.controller.seams import BatchSource, CheckpointStore, EngineUpdates, KLController
from rlsys.controller.setup import check_machine, prepare_model_dir, role_spec, start_ray
from rlsys.controller.stream import StreamRollout
from rlsys.controller.weights import EngineSync, NoSync, shared_fate
from rlsys.data.prompts import PromptSource
from rlsys.envs.registry import env_tools
from rlsys.plan import build_plan, enabled_roles, model_arch, sync_transports
from rlsys.rollout.agent import AgentDriver, agent_function
from rlsys.rollout.batch import EngineRollout
from rlsys.rollout.launch import start_engines
from rlsys.rollout.multi_turn import MultiTurnDriver
from rlsys.rollout.openai_server import ChatServer
from rlsys.rollout.pool import EnginePool

if TYPE_CHECKING:
    from rlsys.telemetry.metrics import MetricsLogger
    from rlsys.telemetry.progress import ProgressReporter

MODES = ("full", "rollout", "train")


@dataclass
class Run:
    cfg: RunConfig
    prompts: PromptSource
    source: BatchSource
    roles: dict[str, RoleGroup]  # enabled roles by name; none in rollout mode
    turns: Turns
    weights: EngineUpdates
    checkpoints: CheckpointStore
    kl: KLController
    logger: MetricsLogger
    progress: ProgressReporter
    start: int  # the last step done before this run (a resumed checkpoint's step), 0 for a fresh one
    last_step: int
    closers: list = field(default_factory=list)  # (on success, on failure or None), in building order
    bad_steps: list = field(default_factory=list)  # the current run of steps with skipped updates
    moe_shape: tuple[int, int] | None = None  # (layers, top_k) of the engines' routed experts (router_replay R3)

    def steps(self) -> range:
        return range(self.start + 1, self.last_step + 1)

    def close(self, failed: bool = False) -> None:
        """Release everything in reverse order of building. After a failure a rank may hang in a collective,
        so role ranks are killed instead of asked to shut down; the devices must not stay taken."""
        _close(self.closers, failed)


def _close(closers: list, failed: bool) -> None:
    errors = []
    for on_success, on_failure in reversed(closers):
        close = on_failure if failed else on_success
        try:
            if close is not None:
                close()
        except Exception as e:  # the rest must still be released
            errors.append(e)
    if errors and not failed:
        raise errors[0]


def build_run(cfg: RunConfig, mode: str = "full", replay_dir: str | None = None, use_ray: bool = True) -> Run:
    """Start what ``mode`` needs (see the module docstring) and resume from the latest checkpoint."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'full', 'rollout' or 'train', got {mode!r}")
    cfg = resolve(cfg)  # load_config did; a config built or edited in code is decided here (the same values)
    closers: list = []
    try:
        return _build(cfg, mode, replay_dir, use_ray, closers)
    except BaseException:
        _close(closers, failed=True)
        raise


def _build(cfg: RunConfig, mode: str, replay_dir: str | None, use_ray: bool, closers: list) -> Run:
    from rlsys.rewards.manager import RewardManager
    from rlsys.telemetry.metrics import MetricsLogger
    from rlsys.telemetry.progress import ProgressReporter

    build_plan(cfg, model_arch(cfg.model))  # every check rlsys plan makes, memory fit included, before any start
    check_machine(cfg, use_ray, mode)  # a writable output directory, and CUDA devices where the run needs them here
    if cfg.model.path:
        HFCheckpoint(cfg.model.path).check()  # a damaged download fails now, not inside a rank or an engine
    out_dir = cfg.trainer.output_dir
    replay = Replay(replay_dir or rollout_dir(out_dir)) if mode == "train" else None
    env = cfg.rollout.multi_turn
    tools = env_tools(env.env, env.env_kwargs) if env.env else None  # a bad environment fails here
    prompts = PromptSource(cfg.data, cfg.model, seed=cfg.trainer.seed, tools=tools)
    rewards = RewardManager(cfg.reward) if replay is None else None  # a bad reward fails before anything starts
    if rewards is not None:
        closers.append((rewards.close, rewards.close))
    if cfg.rollout.urls and replay is None:
        EnginePool.attach(cfg.rollout.urls, api_key=cfg.rollout.api_key).close()  # refused or foreign: fail now
    os.makedirs(out_dir, exist_ok=True)  # only now: bad data, model, reward or engine input writes nothing
    write_resolved(cfg, out_dir)
    model_dir = prepare_model_dir(cfg.model, out_dir, prompts.tokenizer, cfg.trainer.seed)
    placement = None
    if use_ray:  # one placement group: every rank and engine on its device (rlsys.controller.placement)
        start_ray(cfg.cluster)
        placement = Placement.create(cfg)
        closers.append((placement.close, placement.close))

    engines, source, roles = None, replay, {}
    offloaded = {role for role in enabled_roles(cfg) if mode != "rollout" and getattr(cfg, role).offload}
    turns = Turns(offloaded)

    def start_engines():
        nonlocal engines, source
        if replay is None:
            engines, source = _engine_source(cfg, mode, model_dir, placement, prompts, rewards, closers)
            turns.set_engines(engines, cfg.rollout.release_memory and mode != "rollout")

    # colocated: the engines give their memory back before any role is built (rlsys.plan.phases)
    with turns.phase("start-up", start=start_engines):
        roles = _start_roles(cfg, mode, model_dir, use_ray, placement, closers, turns.built)
        actor, critic = roles.get("actor"), roles.get("critic")
        keep = source.keep_pending
        checkpoints = Checkpoints(cfg.trainer, actor, critic, keep) if actor is not None else NoCheckpoints()
        state, ckpt = None, checkpoints.to_resume()
        if ckpt is not None:
            with turns.on_device(actor, critic):
                state = checkpoints.resume(ckpt)
    write_placement(out_dir, cfg, roles, engines)
    syncing = actor is not None and engines is not None
    start = _take_up(state, prompts, kl := _kl_controller(cfg), source)
    t = cfg.trainer
    every = t.fully_async.sync_every if t.async_mode == "fully_async" else 1
    fate = shared_fate(transports := sync_transports(cfg), cfg.rollout.sync.backend)  # restarted together (NCCL)
    weights = EngineSync(actor, engines, turns, start + 1, every, t.steps, t.eval_every, fate) if syncing else NoSync()
    if syncing:
        actor.setup_sync(
            engines.urls,
            [cfg.rollout.tp] * len(engines.urls),
            cfg.rollout.sync,  # resolved (rlsys.config.resolve): no auto reaches the ranks
            cfg.rollout.weight_dtype,
            engines.api_key,
            transports,
            cfg.rollout.engine,
        )
    with turns.phase("sync"):  # the engines start from the HF files (or lag a resumed checkpoint)
        weights.start()

    last_step = min(cfg.trainer.steps, len(replay.files)) if replay is not None else cfg.trainer.steps
    logger = MetricsLogger(out_dir, cfg.logging, run_config=config_to_dict(cfg))
    closers.append((logger.close, logger.close))
    if start:
        logger.resume(start)
    progress = ProgressReporter(last_step, out_dir, cfg.logging, start_step=start)
    closers.append((progress.close, progress.close))
    arch = read_arch(model_dir) if cfg.algorithm.router_replay == "R3" else None
    return Run(
        cfg, prompts, source, roles, turns, weights, checkpoints, kl, logger, progress, start, last_step,
        closers, moe_shape=(arch.num_layers, arch.moe_top_k) if arch else None,
    )  # fmt: skip


def write_resolved(cfg: RunConfig, out_dir: str) -> None:
    """``out_dir/resolved.yaml``: the config as this run uses it, every auto decided (``rlsys.config.resolve``);
    ``rlsys train out_dir/resolved.yaml`` runs the same. Written whole or not at all."""
    path = os.path.join(out_dir, "resolved.yaml")
    with open(path + ".tmp", "w") as f:
        f.write(dump_yaml(cfg))
    os.replace(path + ".tmp", path)


def write_placement(out_dir: str, cfg: RunConfig, roles: dict, engines) -> None:
    """``out_dir/placement.json``: where every process of the run sits, each role's ranks and the engines by
    node address, under the pool each runs on (``rlsys.config.pools``)."""
    where = {
        name: {"pool": getattr(cfg, name).pool, "nodes": [info["node"] for info in group.infos]}
        for name, group in roles.items()
    }
    if engines is not None:
        hosts = [urllib.parse.urlsplit(u).hostname for u in engines.urls]
        where["rollout"] = {"pool": cfg.rollout.pool if not cfg.rollout.urls else None, "nodes": hosts}
    path = os.path.join(out_dir, "placement.json")
    with open(path + ".tmp", "w") as f:
        json.dump(where, f, indent=1)
    os.replace(path + ".tmp", path)


def _take_up(state: dict | None, prompts, kl: KLController, source: BatchSource) -> int:
    """A resumed checkpoint's prompt stream, KL coefficient and kept batches; the step it was saved after."""
    if state is None:
        return 0
    start = state["step"]
    prompts.load_state_dict(state["extra"]["prompts"])
    kl.beta = state["extra"].get("kl_coef", kl.beta)
    source.resume(start)
    return start


def _engine_source(cfg: RunConfig, mode: str, model_dir: str, placement, prompts, rewards, closers: list) -> tuple:
    """The engines and where batches come from with them: ``EngineRollout`` (multi-turn with an environment),
    generated one step ahead in ``one_step_off``, streamed in ``fully_async``."""
    out_dir = cfg.trainer.output_dir
    engines = start_engines(
        cfg.rollout,
        model_dir,
        cfg.model.dtype,
        cfg.trainer.seed,
        f"{out_dir}/logs",
        places=placement.engine_places() if placement is not None else None,
        device=cfg.cluster.device,
        memory_saver=cfg.rollout.release_memory,
        routed_experts=cfg.algorithm.router_replay == "R3",
        overlap=mode == "full" and cfg.trainer.async_mode != "sync",
    )
    closers.append((engines.close, engines.close))
    driver, turns = None, cfg.rollout.multi_turn
    if turns.env:
        driver = MultiTurnDriver(engines, prompts.tokenizer, turns, cfg.data.chat_template == "tokenizer")
    elif turns.agent:
        s = cfg.rollout.sampling
        fixed = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "max_new_tokens": s.max_new_tokens}
        fixed.update({"min_new_tokens": s.min_new_tokens} if s.min_new_tokens else {})
        server = ChatServer(engines, prompts.tokenizer, fmt=turns.tool_format, sampling=fixed)
        driver = AgentDriver(server, agent_function(turns.agent), turns)
    if driver is not None:
        closers.append((driver.close, driver.close))
    source = EngineRollout(
        engines, prompts, rewards, cfg.rollout.sampling, cfg.algorithm.filters, cfg.trainer.seed, driver
    )
    if cfg.trainer.async_mode == "one_step_off" and mode == "full":
        source = AheadRollout(source, cfg.trainer.steps, pending_dir(out_dir))
        closers.append((source.close, functools.partial(source.close, wait=False)))
    elif cfg.trainer.async_mode == "fully_async" and mode == "full":
        queue = os.path.join(pending_dir(out_dir), "queue")
        ds = cfg.algorithm.filters.dynamic_sampling
        source = StreamRollout(source, cfg.trainer.fully_async, ds, queue, cfg.trainer.keep_last, cfg.trainer.steps)
        closers.append((source.close, functools.partial(source.close, wait=False)))
    return engines, source


def _start_roles(cfg: RunConfig, mode: str, model_dir: str, use_ray: bool, placement, closers: list, built) -> dict:
    """Each enabled role, one after the other; ``built(name, group)`` as each is up (``Turns.built``: an offload
    role leaves its devices before the next one is built)."""
    if mode == "rollout":
        return {}
    s = cfg.algorithm.schedule
    total_steps = cfg.trainer.steps * s.ppo_epochs * s.mini_batches_per_step  # optimizer steps, for the lr schedule
    roles = {}
    for role in enabled_roles(cfg):
        spec = role_spec(cfg, role, model_dir, total_steps)
        roles[role] = RoleGroup(spec, use_ray=use_ray, placement=placement)
        closers.append((roles[role].shutdown, roles[role].kill))
        built(role, roles[role])
    return roles


def _kl_controller(cfg: RunConfig):
    kl = cfg.algorithm.kl
    return AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.target else FixedKLController(kl.coef)
