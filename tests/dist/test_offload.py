"""Offload/onload gives back the engine's exact state, and training continues as if it never happened.

Each layout runs in spawned gloo ranks: two identical actors take a step, one goes through
offload/onload, both take a second step, and weights, optimizer state and metrics must agree
bit for bit. The byte reports are checked against the layout's known buffers (DDP param/grad
buffers, masters, moments), so a storage collected twice or missed shows up.
"""

import pytest
import torch

from rlsys.local_ranks import run_on_ranks

pytestmark = pytest.mark.dist


def _batch(vocab: int, seed: int):
    from rlsys.worker.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(6, 20, (1,), generator=g)) for _ in range(6)]
    prompts = [int(torch.randint(2, 5, (1,), generator=g)) for _ in lengths]
    batch = TrainBatch([torch.randint(0, vocab, (n,), generator=g) for n in lengths], prompts)
    batch.set("advantages", [torch.randn(n - p, generator=g) for n, p in zip(lengths, prompts)])
    return batch


def _worker(hf: str, topo, dtype: str, distopt: bool, trainable: bool = True):
    from rlsys.config import KLConfig, PolicyObjective, RoleConfig
    from rlsys.worker.actor import build_policy_worker

    cfg = RoleConfig()
    cfg.optimizer.lr = 1e-3
    cfg.optimizer.use_distributed_optimizer = distopt
    objective = PolicyObjective("grpo", kl=KLConfig(coef=0.0))
    return build_policy_worker(hf, topo, cfg, objective, dtype=dtype, trainable=trainable)


def _optimizer_tensors(engine) -> dict[str, torch.Tensor]:
    from rlsys.worker.offload import torch_optimizers

    out = {}
    for i, opt in enumerate(torch_optimizers(engine.optimizer)):
        for j, group in enumerate(opt.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"opt{i}.{j}.{k}"] = p
                out.update({f"opt{i}.{j}.{k}.{n}": v for n, v in opt.state.get(p, {}).items()})
    return out


def _snapshot(engine) -> dict[str, torch.Tensor]:
    tensors = {f"{i}.{n}": p for i, chunk in enumerate(engine.chunks) for n, p in chunk.named_parameters()}
    tensors.update(_optimizer_tensors(engine))
    return {k: v.detach().clone() for k, v in tensors.items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:4]}"


def _ddp_buffers(engine):
    return [buf for ddp in engine.model for buf in ddp.buffers + ddp.expert_parallel_buffers]


def _expected_bytes(engine, distopt: bool) -> dict[str, int]:
    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    weights = {p.untyped_storage().data_ptr() for p in params}
    opt = _optimizer_tensors(engine)
    state = [v for k, v in opt.items() if k.count(".") == 3]
    # fp32 weights (all of them in fp32 runs, the norms in bf16 runs) are their own masters
    masters = [v for k, v in opt.items() if k.count(".") == 2 and v.untyped_storage().data_ptr() not in weights]
    return {
        # distributed optimizer: parameters are views into DDP's param buffers; else one storage each
        "params": sum(b.param_data.nbytes for b in _ddp_buffers(engine)) if distopt else sum(p.nbytes for p in params),
        "grads": sum(b.grad_data.nbytes for b in _ddp_buffers(engine)),
        "optimizer": sum(v.untyped_storage().nbytes() for v in state) + sum(m.nbytes for m in masters),
    }


def _main_grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.clone() for chunk in engine.chunks for n, p in chunk.named_parameters()}


def _check_actor(hf: str, topo, dtype: str, distopt: bool) -> None:
    from rlsys.worker.offload import StateOffloader

    a, b = _worker(hf, topo, dtype, distopt), _worker(hf, topo, dtype, distopt)
    first, second = _batch(a.vocab_size, 0), _batch(a.vocab_size, 1)
    first.set("old_logp", a.compute_logprobs(first)["logp"])
    assert a.update(first) == b.update(first)
    off = StateOffloader(a.engine)
    assert sum(off.onload().values()) == 0, "onload without offload must be a no-op"
    before, grads = _snapshot(a.engine), _main_grads(a.engine)
    params = [p for chunk in a.engine.chunks for p in chunk.parameters()]
    expected = _expected_bytes(a.engine, distopt)
    assert any(g.any() for g in grads.values()), "the step's gradients are still in the buffers"

    # the optimizer alone: weights stay (even where fp32 masters are the weights themselves)
    assert off.offload({"optimizer"}) == {"optimizer": expected["optimizer"]}
    assert all(p.untyped_storage().size() > 0 for p in params)
    assert all(t.untyped_storage().size() == 0 for k, t in _optimizer_tensors(a.engine).items() if k.count(".") == 3)
    off.onload({"optimizer"})
    # gradients survive when asked to
    off.offload({"grads"}, keep_grads=True)
    off.onload()
    _assert_same(grads, _main_grads(a.engine))

    assert off.offload() == expected
    assert off.offloaded == set(expected)
    assert sum(off.offload().values()) == 0, "a second offload must be a no-op"
    assert all(p.untyped_storage().size() == 0 for p in params)
    assert all(b.grad_data.untyped_storage().size() == 0 for b in _ddp_buffers(a.engine))
    assert all(t.untyped_storage().size() == 0 for t in _optimizer_tensors(a.engine).values())
    assert off.onload() == expected
    assert sum(off.onload().values()) == 0 and not off.offloaded
    _assert_same(before, _snapshot(a.engine))
    assert all(not g.any() for g in _main_grads(a.engine).values()), "dropped gradients come back zeroed"

    logp = a.compute_logprobs(second)["logp"]
    assert all(torch.equal(x, y) for x, y in zip(logp, b.compute_logprobs(second)["logp"]))
    second.set("old_logp", logp)
    assert a.update(second) == b.update(second)
    _assert_same(_snapshot(a.engine), _snapshot(b.engine))

    # host buffers kept across offloads (the CUDA default, where they are pinned): the next offload reuses them
    kept = StateOffloader(a.engine, keep_host_buffers=True)
    kept.offload(keep_grads=True)
    kept.onload()
    buffers = [t.data_ptr() for held in kept._hosts.values() for t in held]
    third = _batch(a.vocab_size, 2)
    third.set("old_logp", a.compute_logprobs(third)["logp"])
    a.update(third)  # new weights and moments: a reused buffer must carry them, not the last offload's
    after, after_grads = _snapshot(a.engine), _main_grads(a.engine)
    kept.offload(keep_grads=True)
    assert buffers and [t.data_ptr() for held in kept._hosts.values() for t in held] == buffers
    kept.onload()
    _assert_same(after, _snapshot(a.engine))
    _assert_same(after_grads, _main_grads(a.engine))


def _check_reference(hf: str, topo) -> None:
    from rlsys.worker.offload import StateOffloader

    ref = _worker(hf, topo, "bf16", distopt=False, trainable=False)
    batch = _batch(ref.vocab_size, 2)
    logp = ref.compute_logprobs(batch)["logp"]
    params = [p for chunk in ref.engine.chunks for p in chunk.parameters()]
    before = _snapshot(ref.engine)
    off = StateOffloader(ref.engine)
    assert off.offload() == {"params": sum(p.nbytes for p in params), "grads": 0, "optimizer": 0}
    assert all(p.untyped_storage().size() == 0 for p in params)
    off.onload()
    _assert_same(before, _snapshot(ref.engine))
    assert all(torch.equal(x, y) for x, y in zip(logp, ref.compute_logprobs(batch)["logp"]))


def _rank(hf: str) -> None:
    from rlsys.config import ParallelConfig
    from rlsys.megatron.topology import build_topology, destroy_topology

    # DP=2 with the distributed optimizer (separate bf16 -> fp32 masters), plus a reference model
    topo = build_topology(ParallelConfig(), device="cpu")
    _check_actor(hf, topo, "bf16", distopt=True)
    _check_reference(hf, topo)
    destroy_topology()
    # TP=2 with the plain fp32 optimizer: the masters are the parameters
    _check_actor(hf, build_topology(ParallelConfig(tp=2), device="cpu"), "fp32", distopt=False)
    destroy_topology()


def test_offload_roundtrip_preserves_training(make_checkpoint):
    run_on_ranks(_rank, 2, "cpu", make_checkpoint("qwen3"))
