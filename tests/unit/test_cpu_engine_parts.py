"""rlsys's CPU engine taking TP parts (``rlsys.sync.parts``) the way a per-tensor broadcast lands them: row parts
straight into the parameter, column parts and deltas through one kept scratch buffer, then copied."""

import torch

from rlsys.rollout.cpu.weights import HFWeights
from rlsys.sync.delta import DeltaEncoder
from rlsys.sync.parts import part_name


def _model(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def test_parts_land_in_place_or_in_the_scratch_buffer_and_end_in_the_parameters(tiny_checkpoints):
    weights = HFWeights(_model(tiny_checkpoints["qwen2"]))
    q, down = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"
    new_q, new_down = torch.randn_like(weights.read(q)), torch.randn_like(weights.read(down))
    rows, cols = new_q.shape[0] // 2, new_down.shape[1] // 2
    sent = [
        (part_name(q, 0, rows, rows, 2 * rows), new_q[rows:]),  # rows: contiguous in the parameter
        (part_name(down, 1, 0, cols, 2 * cols), new_down[:, :cols].contiguous()),  # columns: copied after
        (part_name(down, 1, cols, cols, 2 * cols), new_down[:, cols:].contiguous()),
    ]
    buffers = []

    def scratch(nbytes):
        buffers.append(torch.empty(nbytes, dtype=torch.uint8))
        return buffers[-1]

    into, copies, skipped = weights.receive_plan([(n, t.dtype, list(t.shape)) for n, t in sent], scratch)
    assert skipped == [] and len(copies) == 2 and len(buffers) == 1
    assert into[0].data_ptr() == weights.read(q)[rows:].data_ptr()  # no copy: the broadcast writes the rows
    base = buffers[0].data_ptr()
    assert all(base <= t.data_ptr() < base + buffers[0].numel() for t in into[1:])
    for target, (_, value) in zip(into, sent):  # what the broadcasts deliver
        target.copy_(value)
    weights.write(copies)
    assert torch.equal(weights.read(q)[rows:], new_q[rows:]) and not torch.equal(weights.read(q), new_q)
    assert torch.equal(weights.read(down), new_down)

    # a delta of a column part applies to those columns only
    encoder, part = DeltaEncoder(), sent[2][0]
    list(encoder.encode(part, new_down[:, cols:].contiguous()))
    changed = new_down[:, cols:].contiguous()
    changed[0, 0] += 1.0
    ((delta_name, blob),) = encoder.encode(part, changed)
    into, copies, _ = weights.receive_plan([(delta_name, blob.dtype, list(blob.shape))], scratch)
    into[0].copy_(blob)
    weights.write(copies)
    assert torch.equal(weights.read(down)[:, cols:], changed) and torch.equal(
        weights.read(down)[:, :cols], new_down[:, :cols]
    )
