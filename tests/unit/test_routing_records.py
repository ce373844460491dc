"""MoE routing records: the engine's wire format, the trainer's per-sample and per-micro-batch layouts."""

import base64

import numpy as np
import pytest
import torch

from rlsys.errors import UserError
from rlsys.rollout.cpu.routing import SampleRoutes
from rlsys.rollout.multi_turn import Trajectory
from rlsys.rollout.protocol import Sample, parse_generate_response
from rlsys.worker.batch import TrainBatch
from rlsys.worker.microbatch import build_input
from rlsys.worker.router_replay import Routing, engine_routing, from_engine, lay_out


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(a.tobytes()).decode()


def test_sglang_routed_experts_decode_and_bad_payloads():
    ids = np.arange(2 * 3 * 2, dtype=np.int32)
    body = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}, "routed_experts": _b64(ids)}}
    (s,) = parse_generate_response(body, prompt_ids=[[1]])
    assert s.routed_experts.dtype == np.int32 and s.routed_experts.tolist() == ids.tolist()
    assert s.routed_expert_weights is None  # SGLang sends ids only
    body["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(ValueError, match="routed_experts is not base64 of int32"):
        parse_generate_response(body)
    body["meta_info"]["routed_experts"] = base64.b64encode(b"abc").decode()  # 3 bytes: not int32s
    with pytest.raises(ValueError, match="routed_experts"):
        parse_generate_response(body)


def _sample(prompt, out, layers=2, k=2, weights=True, seed=0):
    g = np.random.default_rng(seed)
    n = len(prompt) + len(out) - 1  # SGLang: no forward saw the last token
    ids = g.integers(0, 4, (n, layers, k)).astype(np.int32)
    w = g.random((n, layers, k)).astype(np.float32) if weights else None
    return Sample(0, prompt, out, None, "stop", routed_experts=ids.ravel(), routed_expert_weights=None if w is None
                  else w.ravel())  # fmt: skip


def test_engine_routing_covers_the_sequence_and_names_the_fix():
    s = _sample([1, 2, 3], [4, 5])
    (r,) = engine_routing([s], num_layers=2, top_k=2)
    assert r.ids.shape == (5, 2, 2) and r.weights.shape == (5, 2, 2)
    assert r.ids.dtype == torch.int8  # 4 experts: ids and -1 fit a byte
    assert r.ids[:4].flatten().tolist() == s.routed_experts.tolist()
    assert (r.ids[4] == -1).all()  # the last token routes itself
    assert torch.equal(r.weights[:4].flatten(), torch.from_numpy(s.routed_expert_weights))
    (r,) = engine_routing([_sample([1, 2], [3], weights=False)], 2, 2)
    assert r.weights is None
    with pytest.raises(ValueError, match="not a multiple of num_layers x top_k = 3 x 2"):
        engine_routing([s], num_layers=3, top_k=2)
    s.routed_experts = None
    with pytest.raises(UserError, match="--enable-return-routed-experts"):
        engine_routing([s], 2, 2)
    with pytest.raises(ValueError, match="routing for 9 positions of a 5-token sequence"):
        from_engine(torch.zeros(9, 2, 2, dtype=torch.int32), None, 5)


def test_batch_checks_routing_shapes_and_keeps_it_through_select():
    seqs = [torch.arange(5), torch.arange(3)]
    batch = TrainBatch(seqs, [2, 1])
    good = [Routing(torch.zeros(5, 2, 2, dtype=torch.int32)), Routing(torch.ones(3, 2, 2, dtype=torch.int32))]
    with pytest.raises(ValueError, match=r"sample 1: routing ids have shape \(4, 2, 2\), expected \(3, 2, 2\)"):
        batch.set_routing([good[0], Routing(torch.zeros(4, 2, 2, dtype=torch.int32))])
    with pytest.raises(ValueError, match="1 routing records for 2 samples"):
        batch.set_routing(good[:1])
    batch.set_routing(good)
    assert batch.select([1]).routing[0] is good[1]


@pytest.mark.parametrize("packed", [True, False])
def test_micro_batch_layout_puts_each_token_s_route_at_its_position(packed):
    seqs = [torch.arange(5), torch.arange(10, 13), torch.arange(20, 24)]
    routing = [Routing(s.view(-1, 1, 1).repeat(1, 2, 2).int(), s.view(-1, 1, 1).repeat(1, 2, 2).float()) for s in seqs]
    batch = TrainBatch(seqs, [2, 1, 1], routing=routing)
    inp = build_input(batch, [2, 0], packed=packed, device=torch.device("cpu"), pad_to_multiple=4, with_routing=True)
    # a model that does not replay (the reference, the critic) gets no record
    assert build_input(batch, [2, 0], packed=packed, device=torch.device("cpu")).routing is None
    ids, weights, base = inp.routing
    assert ids.shape[:2] == inp.tokens.shape and base is None
    # every real token carries its own id (the test's routes equal the token ids); padding is -1
    real = ids[..., 0, 0] >= 0
    assert torch.equal(ids[..., 0, 0][real], inp.tokens[real].int())
    assert int(real.sum()) == 4 + 5
    assert torch.equal(weights[..., 1, 1][real], inp.tokens[real].float())


def test_ids_take_the_smallest_type_that_holds_them():
    from rlsys.worker.router_replay import compact

    assert compact(torch.tensor([-1, 127])).dtype == torch.int8
    assert compact(torch.tensor([-1, 255])).dtype == torch.int16  # DeepSeek-V3's 256 experts
    assert compact(torch.tensor([-1, 40000])).tolist() == [-1, 40000]


def test_lay_out_without_weights_when_any_sample_lacks_them():
    r = [Routing(torch.zeros(2, 1, 1, dtype=torch.int32), torch.ones(2, 1, 1)), Routing(torch.zeros(3, 1, 1).int())]
    ids, weights, base = lay_out(r, [(0, 0, 2), (1, 0, 3)], rows=2, width=3)
    assert weights is None and base is None and ids[0, 2, 0, 0] == -1 and ids[1, 2, 0, 0] == 0


def test_engine_keeps_the_first_route_of_a_position_after_a_retract():
    routes = SampleRoutes()
    routes.add(0, torch.zeros(3, 1, 1, dtype=torch.int32), torch.zeros(3, 1, 1))  # prefill of 3 positions
    routes.add(3, torch.ones(1, 1, 1, dtype=torch.int32), torch.ones(1, 1, 1))  # a decode step
    routes.add(0, torch.full((5, 1, 1), 7, dtype=torch.int32), torch.full((5, 1, 1), 7.0))  # retract: prefill again
    assert [int(i) for i in routes.ids] == [0, 0, 0, 1, 7]
    meta = routes.meta(seq_len=6)
    got = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    assert got.tolist() == [0, 0, 0, 1, 7]
    start = np.frombuffer(base64.b64decode(routes.meta(seq_len=6, start=2)["routed_experts"]), dtype=np.int32)
    assert start.tolist() == [0, 1, 7]
    with pytest.raises(RuntimeError, match="position 9 recorded before 5"):
        routes.add(9, torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1))


def test_multi_turn_trajectory_keeps_each_turn_s_routes():
    t = Trajectory(0, [1, 2], env=None)
    first = Sample(0, [1, 2], [3, 4], [0.0, 0.0], "stop", routed_experts=np.array([10, 11, 12], dtype=np.int32))
    t.add_turn(first)
    t.add_glue([8])
    # the second turn's request holds the whole context: 1 2 3 4 8 -> 5, routes of positions 0..4
    second = Sample(0, [1, 2, 3, 4, 8], [5], [0.0], "stop", routed_experts=np.array([20, 21, 22, 23, 24], np.int32))
    t.add_turn(second)
    s = t.sample()
    assert s.routed_experts.tolist() == [10, 11, 12, 23, 24]
    (r,) = engine_routing([s], num_layers=1, top_k=1)
    assert r.ids.shape == (6, 1, 1)


def test_update_routing_pairs_the_engine_s_record_with_the_old_pass_s_own_weights():
    from rlsys.worker.router_replay import update_routing

    ids = torch.zeros(3, 1, 2, dtype=torch.int8)
    engine, own = Routing(ids, torch.full((3, 1, 2), 0.5)), Routing(ids, torch.full((3, 1, 2), 0.4))
    (r3,) = update_routing([engine], [own])
    assert r3.ids is ids and r3.weights is engine.weights and r3.base is own.weights
    (ids_only,) = update_routing([Routing(ids)], [own])  # SGLang: ids only, the router's own weights
    assert ids_only.weights is None and ids_only.base is None
    assert update_routing(None, [own]) == [own]  # R2: the old pass's own record


class _Router:
    """What _LayerReplay touches of megatron's TopKRouter."""

    training = True

    class config:
        recompute_granularity = None

    def __init__(self, probs):
        self.probs = probs

    def routing(self, logits, padding_mask=None):
        return self.probs(logits), None


@pytest.mark.parametrize("with_base", [False, True])
def test_replayed_weights_are_the_record_forward_and_the_router_s_backward(with_base):
    from rlsys.worker.router_replay import _LayerReplay

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], requires_grad=True)

    def megatron_probs(x):  # megatron's dense probs: the softmax at the chosen experts, 0 elsewhere
        return torch.zeros_like(x).scatter(1, layer._ids, x.softmax(-1).gather(1, layer._ids))

    layer = _LayerReplay(_Router(megatron_probs))
    layer.mode, layer.target_ids = "replay", torch.tensor([[3, 0]])
    layer.target_weights = torch.tensor([[0.25, 0.75]])
    own = logits.detach().softmax(-1)[0, [3, 0]]
    layer.target_base = own.clone().view(1, 2) if with_base else None
    # megatron's top-k call, then its routing
    layer.get_replay_topk(logits, 2, default_compute_topk=lambda scores, k, **_: torch.topk(scores, k))
    probs, _ = layer.router.routing(logits)
    assert probs[0, 3] == 0.25 and probs[0, 0] == 0.75 and probs[0, 1] == 0  # exactly the record
    probs[0, 3].backward()
    want = torch.autograd.grad(logits.softmax(-1)[0, 3], logits)[0]
    torch.testing.assert_close(logits.grad, want)  # the router's own gradient
