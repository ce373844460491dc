"""One rank's Megatron model for a role: build, load, run micro-batches through the pipeline schedule, step.

The engine knows nothing about RL: the actor, critic and reference workers give it a loss
(or an output collector) per micro-batch. What it owns is the Megatron plumbing:

* the model chunks (one per virtual pipeline stage), wrapped in megatron's
  ``DistributedDataParallel`` and driven by ``get_megatron_optimizer`` and
  ``OptimizerParamScheduler`` when the role trains;
* micro-batch layout (packed or padded) and the same micro-batch count on every DP rank
  (MoE token dispatch is a collective over EP ranks, which are different DP ranks);
* loss scaling: worker losses arrive already normalized by *global* token/sequence counts
  (``rlsys.algorithms.aggregate``), so their sum over micro-batches and DP ranks is the batch
  loss. Megatron's schedule divides a returned loss by the micro-batch count (times CP) and
  DDP averages gradients over DP x CP; the engine multiplies by ``num_microbatches * dp`` to
  turn both back into plain sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from rlsys.algorithms.aggregate import valid_counts
from rlsys.architectures.hf_config import ModelArch
from rlsys.config import RoleConfig
from rlsys.megatron.model import TORCH_DTYPES, build_model, have_transformer_engine
from rlsys.megatron.topology import Topology
from rlsys.worker.batch import TrainBatch
from rlsys.worker.context_parallel import pad_for_cp
from rlsys.worker.metrics import reduce_metrics
from rlsys.worker.microbatch import ModelInput, build_input
from rlsys.worker.offload import StateOffloader
from rlsys.worker.packing import balance_partitions, pack_microbatches
from rlsys.worker.router_replay import RouterReplay

# loss_fn(output [b, T, V/tp], model_input) -> (loss scalar, {metric: (value, weight)})
LossFn = Callable[[torch.Tensor, ModelInput], tuple[torch.Tensor, dict]]
# collect_fn(output, model_input) -> anything; called on the last pipeline stage in forward-only runs
CollectFn = Callable[[torch.Tensor, ModelInput], object]


def _recompute_kwargs(recompute: str) -> dict:
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


class MegatronEngine:
    def __init__(
        self,
        arch: ModelArch,
        topo: Topology,
        cfg: RoleConfig,
        dtype: str = "fp32",
        vocab_divisible_by: int = 128,
        trainable: bool = True,
        total_steps: int = 1,
        load: Callable[[list], None] | None = None,
        customize: Callable[[list], None] | None = None,
        hf_dir: str | None = None,
        router_replay: bool = False,
    ):
        """``load(chunks)`` fills the weights before the optimizer copies them into its master
        params; ``customize(chunks)`` may swap modules (the critic's value head) before that.
        ``hf_dir`` is the HF checkpoint the weights came from (checkpoints copy its config and tokenizer).
        ``router_replay``: the MoE routers can record and replay routing (``rlsys.worker.router_replay``)."""
        self.arch, self.topo, self.cfg, self.dtype, self.hf_dir = arch, topo, cfg, dtype, hf_dir
        p = cfg.parallel
        self.chunks, self.config = build_model(
            arch,
            topo,
            dtype=dtype,
            vocab_divisible_by=vocab_divisible_by,
            first_stage_layers=p.first_stage_layers,
            last_stage_layers=p.last_stage_layers,
            **_recompute_kwargs(cfg.recompute),
        )
        if customize is not None:
            customize(self.chunks)
        if load is not None:
            load(self.chunks)
        self.replay = RouterReplay(self.chunks, topo, arch.num_layers) if router_replay else None
        self.use_thd = topo.device.type == "cuda" and have_transformer_engine()
        self.trainable = trainable
        self.model = self.chunks
        self.optimizer = self.scheduler = None
        if trainable:
            self._build_optimizer(total_steps)
        self.offloader = StateOffloader(self)

    def offload(self, **kwargs) -> dict[str, int]:
        """Free this rank's device memory (weights, grads, optimizer state) into host copies; see ``offload.py``."""
        return self.offloader.offload(**kwargs)

    def onload(self, **kwargs) -> dict[str, int]:
        return self.offloader.onload(**kwargs)

    # -- construction -------------------------------------------------------------------------

    def _build_optimizer(self, total_steps: int) -> None:
        o = self.cfg.optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=o.use_distributed_optimizer,
        )
        self.model = [
            DistributedDataParallel(self.config, ddp_config, chunk, disable_bucketing=i > 0, pg_collection=self.topo.pg)
            for i, chunk in enumerate(self.chunks)
        ]
        self.config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=self.topo.pg)
        opt_config = MegatronOptimizerConfig(
            optimizer=o.name,
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=self.dtype == "bf16",
            fp16=self.dtype == "fp16",
            params_dtype=TORCH_DTYPES[self.dtype],
            use_distributed_optimizer=o.use_distributed_optimizer,
        )
        # On CPU the model-parallel groups are gloo already; megatron's extra gloo groups are for NCCL runs.
        self.optimizer = get_megatron_optimizer(
            opt_config, self.model, use_gloo_process_groups=self.topo.device.type != "cpu"
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if o.lr_warmup_steps else o.lr,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps,
            lr_decay_steps=max(total_steps, o.lr_warmup_steps + 1),
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant",
            # on resume the config's LR settings win over the checkpoint's; the step count is restored
            override_opt_param_scheduler=True,
            use_checkpoint_opt_param_scheduler=False,
        )

    # -- micro-batches ------------------------------------------------------------------------

    def plan_microbatches(self, batch: TrainBatch, config_key: str) -> tuple[list[list[int]], int | None]:
        """Split this rank's samples into micro-batches; every DP rank gets the same count.

        The interleaved pipeline schedule also needs the count to be a multiple of PP. Returns
        the index lists and, where shapes must agree, the fixed row length every rank pads to.
        """
        b = self.cfg.batch
        lengths = batch.lengths
        if b.use_packing:
            budget = b.max_tokens_per_microbatch or max(lengths)
            groups = pack_microbatches(lengths, budget, config_key=config_key)
        else:
            size = b.micro_batch_size
            groups = [list(range(i, min(i + size, len(batch)))) for i in range(0, len(batch), size)]
        count = torch.tensor([len(groups)], dtype=torch.long, device=self.topo.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.topo.pg.dp_cp)
        multiple = self.topo.pp if self.topo.vpp else 1
        want = -(-int(count.item()) // multiple) * multiple
        if want > len(groups):
            if want > len(batch):
                raise ValueError(
                    f"{want} micro-batches are needed (to match other data-parallel ranks, or a multiple of "
                    f"pp={self.topo.pp} for the interleaved schedule) but this rank holds {len(batch)} samples; "
                    "use more samples per step or fewer micro-batches"
                )
            if b.use_packing:
                groups = pack_microbatches(lengths, budget, min_microbatches=want, config_key=config_key)
            else:
                groups = [sorted(g) for g in balance_partitions(lengths, want)]
        fixed = None
        if not self.config.variable_seq_lengths or self.topo.vpp:
            # One row shape on every rank: megatron's allgather MoE dispatcher (CPU) gathers
            # equal-sized tensors, and the interleaved schedule's p2p does not exchange shapes.
            packed = pad_for_cp(lengths, self.topo.cp) if self.topo.cp > 1 else lengths  # CP pads every sample
            rows = [sum(packed[i] for i in g) if b.use_packing else max(lengths[i] for i in g) for g in groups]
            width = torch.tensor([max(rows)], dtype=torch.long, device=self.topo.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            fixed = -(-int(width.item()) // self._pad_multiple()) * self._pad_multiple()
        return groups, fixed

    def _pad_multiple(self) -> int:
        multiple = self.topo.tp if self.topo.sequence_parallel else 1
        return multiple * (2 * self.topo.cp if self.topo.cp > 1 else 1)

    def inputs(self, batch: TrainBatch, groups: Sequence[Sequence[int]], fixed: int | None) -> list[ModelInput]:
        return [
            build_input(
                batch,
                g,
                packed=self.cfg.batch.use_packing,
                device=self.topo.device,
                pad_to_multiple=self._pad_multiple(),
                pad_to_length=fixed,
                use_thd=self.use_thd and self.cfg.batch.use_packing,
                cp=(self.topo.cp, self.topo.cp_rank, self.topo.pg.cp) if self.topo.cp > 1 else None,
                with_routing=self.replay is not None,
            )
            for g in groups
        ]

    # -- running ------------------------------------------------------------------------------

    def _forward(self, model, inp: ModelInput) -> torch.Tensor:
        if self.replay is not None:
            self.replay.before_forward(model, inp)
        return model(
            inp.tokens,
            inp.position_ids,
            inp.attention_mask,
            packed_seq_params=inp.packed_seq_params,
        )

    def run(
        self,
        inputs: list[ModelInput],
        loss_fn: LossFn | None = None,
        collect_fn: CollectFn | None = None,
        record_routing: bool = False,
    ) -> list:
        """Run every micro-batch; with ``loss_fn`` also backward (gradients accumulate in the DDP buffers).

        Returns, on the last pipeline stage, the per-micro-batch metric dicts (training) or the
        ``collect_fn`` results (forward-only); an empty list elsewhere. Inputs that carry a routing record
        replay it; ``record_routing`` keeps the routing this run used, replayed or not (``self.replay.collect``).
        """
        replaying = bool(inputs) and inputs[0].routing is not None
        if record_routing and self.replay is None:
            raise RuntimeError("recording the routing needs an engine built with router_replay=True")
        if self.replay is not None:
            self.replay.start("replay" if replaying else None, record=record_routing)
        forward_only = loss_fn is None
        n = len(inputs)
        results: list = []
        scale = n * self.topo.dp

        def forward_step(data_iterator, model):
            inp = next(data_iterator)
            output = self._forward(model, inp)

            def finish(output_tensor):
                if forward_only:
                    with torch.no_grad():
                        results.append(collect_fn(output_tensor, inp))
                    return output_tensor.new_zeros(()), {}
                loss, metrics = loss_fn(output_tensor, inp)
                results.append(metrics)
                return loss * scale, {}

            return output, finish

        for m in self.model:
            m.train(not forward_only)
        schedule = get_forward_backward_func(pp_size=self.topo.pp, vp_size=self.topo.vpp)
        extra = (
            {"p2p_communicator": P2PCommunicator(pp_group=self.topo.pg.pp, config=self.config)}
            if self.topo.pp > 1
            else {}
        )
        data = [iter(inputs) for _ in self.model] if len(self.model) > 1 else iter(inputs)
        context = torch.no_grad() if forward_only else torch.enable_grad()
        with context:
            schedule(
                forward_step_func=forward_step,
                data_iterator=data,
                model=self.model,
                num_microbatches=n,
                # the full row: the schedule divides by CP itself for pipeline buffer shapes
                seq_length=max(int(i.tokens.shape[1]) for i in inputs) * self.topo.cp,
                micro_batch_size=max(int(i.tokens.shape[0]) for i in inputs),
                forward_only=forward_only,
                pg_collection=self.topo.pg,
                **extra,
            )
        if self.replay is not None:
            self.replay.finish()
        return results if self.topo.is_last_stage else []

    def train(
        self,
        batch: TrainBatch,
        mini_batches: int,
        epochs: int,
        make_loss: Callable[[TrainBatch, dict], LossFn],
        spec: dict[str, str],
        prefix: str,
        agg: str = "token-mean",
        norm_const: float | None = None,
    ) -> dict[str, float]:
        """``epochs`` passes over this rank's share, one optimizer step per mini-batch.

        ``make_loss(mini, denominators)`` returns the micro-batch loss function; ``denominators``
        holds the mini-batch's global token and sequence counts (and the Dr.GRPO constant).
        Returns the metrics averaged over steps, with ``{prefix}/grad_norm`` and ``{prefix}/lr``.
        """
        if len(batch) < mini_batches:
            raise ValueError(
                f"this data-parallel rank holds {len(batch)} samples, fewer than "
                f"algorithm.schedule.mini_batches_per_step={mini_batches}"
            )
        bounds = [round(i * len(batch) / mini_batches) for i in range(mini_batches + 1)]
        steps = []
        for _ in range(epochs):
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                mini = batch.select(range(lo, hi))
                denominators = self._denominators(mini, agg, norm_const)
                groups, fixed = self.plan_microbatches(mini, f"{prefix}.batch.max_tokens_per_microbatch")
                self.zero_grad()
                entries = self.run(self.inputs(mini, groups, fixed), loss_fn=make_loss(mini, denominators))
                grad_norm, lr, skipped = self.step()
                metrics = reduce_metrics(entries, spec, self.topo)
                metrics.update({f"{prefix}/grad_norm": grad_norm, f"{prefix}/lr": lr})
                metrics[f"{prefix}/skipped_updates"] = float(skipped)
                steps.append(metrics)
        good = [s for s in steps if not s[f"{prefix}/skipped_updates"]] or steps
        out = {name: sum(s[name] for s in good) / len(good) for name in steps[0]}
        out[f"{prefix}/skipped_updates"] = sum(s[f"{prefix}/skipped_updates"] for s in steps)
        out[f"{prefix}/lr"] = steps[-1][f"{prefix}/lr"]
        return out

    def _denominators(self, mini: TrainBatch, agg: str, norm_const: float | None) -> dict:
        """Global counts over the DP (x CP) group, so shard losses add up to the mini-batch loss."""
        tokens, seqs = valid_counts(mini.response_mask())
        longest = max(mini.response_lengths)
        counts = torch.tensor([tokens, seqs], dtype=torch.float64, device=self.topo.device)
        # over DP only: the ranks of a CP group hold the same samples
        dist.all_reduce(counts, group=self.topo.pg.dp)
        out = {"num_tokens": counts[0].item(), "num_seqs": counts[1].item()}
        if agg == "seq-mean-token-sum-norm":
            if norm_const is None:
                # Dr.GRPO's normalizer must be one constant for the whole step, on every rank
                peak = torch.tensor([longest], dtype=torch.float64, device=self.topo.device)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.topo.pg.dp)
                norm_const = peak.item()
            out["norm_const"] = norm_const
        return out

    def zero_grad(self) -> None:
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[float, float, bool]:
        """Clip, step and advance the LR schedule; returns ``(grad_norm, lr, skipped)`` (same on every rank).

        Non-finite gradients on any rank skip the step on all of them: no parameter, optimizer state or LR
        schedule changes (``skipped``; grad_norm NaN). Megatron checks only under fp16's loss scaler; in fp32
        and bf16 its clipping would spread one NaN into every weight."""
        if not self._grads_finite():
            return float("nan"), float(self.optimizer.param_groups[0]["lr"]), True
        if self.topo.device.type == "cpu":
            _fuse_cpu_adam(self.optimizer)  # each step: loading a checkpoint restores the saved param groups
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # fp16: the loss scaler found an overflow and lowered its scale
            return float("nan"), float(self.optimizer.param_groups[0]["lr"]), True
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        return float(grad_norm if grad_norm is not None else 0.0), float(lr), False

    def _grads_finite(self) -> bool:
        # One norm per gradient (a NaN or Inf element makes it non-finite; so does a norm that overflows, which
        # megatron's clipping could not use either), then one reduction and one host read: an isfinite pass per
        # parameter took a quarter of the optimizer step on CPU.
        grads = [p.main_grad for m in self.model for p in m.parameters() if getattr(p, "main_grad", None) is not None]
        finite = torch.stack(torch._foreach_norm(grads)).isfinite().all() if grads else torch.tensor(True)
        bad = (~finite).float().reshape(1).to(self.topo.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # the role's world: every TP/PP/DP/CP/EP rank decides alike
        return bad.item() == 0


def _fuse_cpu_adam(optimizer) -> None:
    """Megatron falls back to torch's AdamW without apex/TE, and on CPU that runs one op per parameter and
    moment; its fused CPU kernel does the same update in one pass (4.4M parameters: 20 ms -> 5 ms a step).
    Only for fp32/bf16 parameters, which that kernel takes."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            if not group.get("fused") and all(p.dtype in (torch.float32, torch.bfloat16) for p in group["params"]):
                group["fused"], group["foreach"] = True, False
