"""What the multi-node e2e tests share: a short verified run's keys, and what every step of it must show."""

SHORT_VERIFIED = [
    "trainer.steps=3",
    "trainer.eval_every=0",
    "trainer.export_hf=false",
    "logging.tensorboard=false",
    "rollout.sync.verify=true",
    "logging.progress=off",
]


def check_synced_steps(history: list[dict], steps: int) -> None:
    """Every step sampled from the weights synced for it, every engine tensor compared with the trainer's."""
    assert [m["step"] for m in history] == list(range(1, steps + 1))
    for m in history:
        assert m["rollout/weight_version"] == m["step"]
        assert m["sync/verified_tensors"] > 0 and m["rollout/logprob_diff_max"] < 1e-4
