"""The critic: the policy's GPTModel trunk with a scalar value head instead of the vocabulary projection.

The value of the state before response token ``t`` is read at the position whose logits would
predict ``t`` (the same positions the actor's log-probs come from, as in verl). The head is one
``hidden -> 1`` linear layer replicated over TP: every TP rank sees the full hidden state after
the final norm, so their gradients agree without an all-reduce.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from rlsys.algorithms.value_loss import value_loss
from rlsys.config import RoleConfig, ValueObjective
from rlsys.megatron.model import TORCH_DTYPES
from rlsys.worker.batch import TrainBatch, unpad_rows
from rlsys.worker.engine import MegatronEngine
from rlsys.worker.microbatch import ModelInput, response_fields

CRITIC_METRICS = {
    "critic/vf_loss": "sum",
    "critic/vf_clipfrac": "mean",
    "critic/vpred_mean": "mean",
    "critic/tokens": "sum",
}


class ValueHead(torch.nn.Module):
    """Stands in for ``GPTModel.output_layer``: same call signature, ``[s, b, 1]`` values out."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool, tp_group, seed: int = 0):
        super().__init__()
        # Same init on every TP rank (replicated weights); small, as OpenRLHF's value head.
        g = torch.Generator().manual_seed(seed)
        std = 1.0 / math.sqrt(hidden_size + 1)
        self.weight = torch.nn.Parameter((torch.randn(1, hidden_size, generator=g) * std).to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            # every rank computes the values of the whole sequence, so backward only splits
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return F.linear(hidden_states, self.weight, self.bias), None


class CriticWorker:
    def __init__(self, engine: MegatronEngine, objective: ValueObjective):
        self.engine, self.objective, self.topo = engine, objective, engine.topo

    def compute_values(self, batch: TrainBatch) -> dict[str, list[torch.Tensor]] | None:
        """``{"values": [...]}`` per sample (one value per response token), on the last stage, else ``None``."""
        groups, fixed = self.engine.plan_microbatches(batch, "critic.batch.max_tokens_per_microbatch")

        def collect(output, inp: ModelInput):
            return inp.indices, inp.responses(inp.full_row(output[..., 0].float())).cpu()

        results = self.engine.run(self.engine.inputs(batch, groups, fixed), collect_fn=collect)
        if not self.topo.is_last_stage:
            return None
        values: list = [None] * len(batch)
        lengths = batch.response_lengths
        for indices, rows in results:
            for i, v in zip(indices, unpad_rows(rows, [lengths[i] for i in indices])):
                values[i] = v
        return {"values": values}

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """Clipped value regression onto ``returns``; needs fields ``values`` (old) and ``returns``."""
        s = self.objective.schedule
        return self.engine.train(batch, s.mini_batches_per_step, s.ppo_epochs, self._loss_fn, CRITIC_METRICS, "critic")

    def _loss_fn(self, mini: TrainBatch, denominators: dict):
        clip = self.objective.loss.clip

        def loss_fn(output, inp: ModelInput):
            f = response_fields(mini, inp, ["values", "returns"], output.device)
            values = inp.responses(inp.full_row(output[..., 0]))
            loss, m = value_loss(values, f["values"], f["returns"], f["mask"], clip, **denominators)
            n = float(f["mask"].sum())
            entry = {"critic/vf_loss": (float(loss), 1.0), "critic/tokens": (n, 1.0)}
            entry.update({f"critic/{k}": (float(m[k]) * n, n) for k in ("vf_clipfrac", "vpred_mean")})
            return loss, entry

        return loss_fn


def build_critic_worker(
    hf_dir: str,
    topo,
    role_cfg: RoleConfig,
    objective: ValueObjective,
    dtype: str = "fp32",
    total_steps: int = 1,
    vocab_divisible_by: int = 128,
) -> CriticWorker:
    """A critic whose trunk comes from an HF checkpoint (the actor's, or a reward model's) and a fresh value head."""
    from rlsys.architectures.hf_config import read_arch
    from rlsys.megatron.load import load_hf_weights

    # untied: the head replaces the output layer, the input embedding must stay
    arch = dataclasses.replace(read_arch(hf_dir), tie_word_embeddings=False)
    torch_dtype = TORCH_DTYPES[dtype]

    def add_head(chunks):
        last = chunks[-1]
        if last.post_process:
            last.output_layer = ValueHead(arch.hidden_size, torch_dtype, topo.sequence_parallel, topo.pg.tp).to(
                topo.device
            )

    engine = MegatronEngine(
        arch,
        topo,
        role_cfg,
        dtype=dtype,
        vocab_divisible_by=vocab_divisible_by,
        total_steps=total_steps,
        hf_dir=hf_dir,
        customize=add_head,
        load=lambda chunks: load_hf_weights(
            chunks, arch, topo, hf_dir, only=lambda name: not name.startswith("output_layer"), check_complete=False
        ),
    )
    return CriticWorker(engine, objective)
