"""Train-inference mismatch weights checked against hand-computed numbers and a plain-Python loop."""

import math

import pytest
import torch

from rlsys.algorithms.mismatch import mismatch_metrics, mismatch_weights

T = torch.tensor
LN2 = math.log(2.0)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def ref_weights(trainer, rollout, mask, mode, cap, level, lower=None):
    """Weights and keep mask row by row, straight from the definitions, in float64 Python."""
    weights, keep = [], []
    for tr, ro, ma in zip(trainer, rollout, mask):
        deltas = [a - b for a, b, m in zip(tr, ro, ma) if m]
        if level == "sequence":
            seq_rho = math.exp(sum(deltas))
        elif level == "geometric":
            seq_rho = math.exp(sum(deltas) / len(deltas)) if deltas else 1.0
        w_row, k_row = [], []
        for a, b, m in zip(tr, ro, ma):
            rho = math.exp(a - b) if level == "token" else seq_rho
            if not m:
                w_row.append(0.0)
                k_row.append(0)
            elif mode == "tis":
                w_row.append(min(rho, cap))
                k_row.append(1)
            else:
                ok = rho <= cap and (lower is None or rho >= lower)
                w_row.append(rho if ok else 0.0)
                k_row.append(int(ok))
        weights.append(w_row)
        keep.append(k_row)
    return weights, keep


# Row 0: deltas ln2, ln0.5, 0, (pad). Row 1: deltas ln3, ln2, (pad), (pad).
ROLLOUT = T([[-1.0, -2.0, -0.5, -9.0], [-0.3, -1.1, -7.0, -7.0]])
DELTAS = T([[LN2, math.log(0.5), 0.0, 123.0], [math.log(3.0), LN2, -50.0, 0.0]])
TRAINER = ROLLOUT + DELTAS
MASK = T([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)


def test_tis_token_hand_computed():
    w, keep, metrics = mismatch_weights(TRAINER, ROLLOUT, MASK, "tis", cap=1.5)
    # rho = 2, 0.5, 1 | 3, 2 -> truncated at 1.5
    close(w, [[1.5, 0.5, 1.0, 0.0], [1.5, 1.5, 0.0, 0.0]], atol=1e-5)
    assert keep is MASK
    close(metrics["mismatch/clipped_fraction"], 3 / 5)
    close(metrics["mismatch/masked_fraction"], 0.0)
    close(metrics["mismatch/weight_mean"], (1.5 + 0.5 + 1.0 + 1.5 + 1.5) / 5, atol=1e-5)


def test_mis_token_hand_computed_with_lower():
    w, keep, metrics = mismatch_weights(TRAINER, ROLLOUT, MASK.float(), "mis", cap=2.5, lower=0.6)
    # rho = 2 (kept), 0.5 (< lower), 1 (kept) | 3 (> cap), 2 (kept)
    close(w, [[2.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]], atol=1e-5)
    close(keep, [[1, 0, 1, 0], [0, 1, 0, 0]])
    assert keep.dtype == torch.float32
    close(metrics["mismatch/masked_fraction"], 2 / 5)
    close(metrics["mismatch/clipped_fraction"], 0.0)
    close(metrics["mismatch/weight_mean"], (2.0 + 1.0 + 2.0) / 3, atol=1e-5)


def test_sequence_and_geometric_levels_hand_computed():
    # Row 0: sum = ln2 + ln0.5 + 0 = 0 -> rho 1, geometric 1. Row 1: sum = ln6 -> rho 6, geometric sqrt(6).
    w, _, m = mismatch_weights(TRAINER, ROLLOUT, MASK, "tis", cap=2.0, level="sequence")
    close(w, [[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]], atol=1e-5)
    close(m["mismatch/clipped_fraction"], 2 / 5)  # counted per valid token

    w, keep, m = mismatch_weights(TRAINER, ROLLOUT, MASK, "mis", cap=2.0, level="sequence")
    close(w, [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], atol=1e-5)
    assert keep.dtype == torch.bool and keep.tolist() == [[True, True, True, False], [False] * 4]
    close(m["mismatch/masked_fraction"], 2 / 5)

    w, keep, _ = mismatch_weights(TRAINER, ROLLOUT, MASK, "mis", cap=2.5, level="geometric")
    close(w, [[1.0, 1.0, 1.0, 0.0], [math.sqrt(6), math.sqrt(6), 0.0, 0.0]], atol=1e-5)
    assert keep.tolist() == MASK.tolist()


@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_matches_python_loop_on_random_inputs(mode, level):
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    trainer = rollout + torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[2] = False  # a row with no valid token
    lower = 0.8 if mode == "mis" else None
    w, keep, _ = mismatch_weights(trainer, rollout, mask, mode, cap=1.2, level=level, lower=lower)
    ref_w, ref_keep = ref_weights(trainer.tolist(), rollout.tolist(), mask.tolist(), mode, 1.2, level, lower)
    close(w, ref_w, atol=1e-5)
    assert keep.int().tolist() == ref_keep


@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_identical_logps_give_unit_weights_and_zero_metrics(mode, level):
    logp = T([[-0.5, -1.5, -3.0], [-2.0, -0.1, -0.2]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w, keep, metrics = mismatch_weights(logp, logp.clone(), mask, mode, level=level)
    close(w, mask)
    close(keep, mask)
    for name in ["logp_diff_mean", "logp_diff_max", "k1_kl", "k3_kl", "masked_fraction", "clipped_fraction"]:
        close(metrics[f"mismatch/{name}"], 0.0)
    close(metrics["mismatch/weight_mean"], 1.0)


def test_metrics_hand_computed_and_ignore_padding():
    metrics = mismatch_metrics(TRAINER, ROLLOUT, MASK)
    # valid deltas: ln2, -ln2, 0, ln3, ln2 (the 123 and -50 on padding must not count)
    close(metrics["mismatch/logp_diff_mean"], (3 * LN2 + math.log(3)) / 5, atol=1e-5)
    close(metrics["mismatch/logp_diff_max"], math.log(3), atol=1e-5)
    close(metrics["mismatch/k1_kl"], -(LN2 + math.log(3)) / 5, atol=1e-5)
    # k3 = rho - 1 - ln rho per token: (2-1-ln2) + (0.5-1+ln2) + 0 + (3-1-ln3) + (2-1-ln2)
    k3 = (1 - LN2) + (-0.5 + LN2) + (2 - math.log(3)) + (1 - LN2)
    close(metrics["mismatch/k3_kl"], k3 / 5, atol=1e-5)
    assert all(v.dim() == 0 and v.dtype == torch.float32 for v in metrics.values())


def test_huge_mismatch_is_finite_and_padding_garbage_ignored():
    rollout = T([[-1.0, -1.0, 0.0], [-100.0, -100.0, 0.0]])
    trainer = T([[-1.0, -1.0, float("-inf")], [-1.0, -1.0, float("nan")]])
    mask = T([[1, 1, 0], [1, 1, 0]])
    for mode, level in [("tis", "token"), ("mis", "sequence"), ("mis", "geometric")]:
        w, keep, metrics = mismatch_weights(trainer, rollout, mask, mode, cap=2.0, level=level)
        assert torch.isfinite(w).all() and all(torch.isfinite(v) for v in metrics.values())
        assert w[:, 2].tolist() == [0.0, 0.0]
    # row 1: log-ratio 99 per token, clamped to 20 inside exp -> k3 finite and large
    assert metrics["mismatch/k3_kl"] > 1e7
    assert keep.tolist() == [[1, 1, 0], [0, 0, 0]]


def test_weights_are_detached():
    trainer = TRAINER.clone().requires_grad_(True)
    w, _, metrics = mismatch_weights(trainer, ROLLOUT, MASK, "tis")
    assert not w.requires_grad and not any(v.requires_grad for v in metrics.values())


def test_validation_errors():
    with pytest.raises(ValueError, match=r"mode must be one of \('tis', 'mis'\), got 'ppo'"):
        mismatch_weights(TRAINER, ROLLOUT, MASK, "ppo")
    with pytest.raises(ValueError, match=r"level must be one of \('token', 'sequence', 'geometric'\)"):
        mismatch_weights(TRAINER, ROLLOUT, MASK, "tis", level="seq")
    with pytest.raises(ValueError, match="cap must be positive"):
        mismatch_weights(TRAINER, ROLLOUT, MASK, "tis", cap=0.0)
    with pytest.raises(ValueError, match="only applies to mode='mis'"):
        mismatch_weights(TRAINER, ROLLOUT, MASK, "tis", lower=0.5)
    with pytest.raises(ValueError, match="0 < lower < cap"):
        mismatch_weights(TRAINER, ROLLOUT, MASK, "mis", cap=2.0, lower=3.0)
    with pytest.raises(ValueError, match=r"rollout_logp \(2, 3\).*same \[batch, seq\] shape"):
        mismatch_weights(TRAINER, ROLLOUT[:, :3], MASK, "tis")
    with pytest.raises(ValueError, match="same"):
        mismatch_metrics(TRAINER[0], ROLLOUT[0], MASK[0])
