"""When the run saves, resumes and exports: the actor (and critic) checkpoints under ``trainer.output_dir``.

A rollout-only run trains nothing, so it has ``NoCheckpoints``: it starts at step 0 and saves nothing.
"""

from __future__ import annotations

import logging
import os

from rlsys.config import TrainerConfig
from rlsys.errors import CheckpointError
from rlsys.worker.checkpoint import latest_checkpoint

logger = logging.getLogger(__name__)


class Checkpoints:
    """``checkpoints/`` holds the actor's, ``critic_checkpoints/`` the critic's, under the same step names."""

    def __init__(self, cfg: TrainerConfig, actor, critic, before_save=None):
        """``before_save(step)``: what else a checkpoint keeps, written first (the batch generated ahead).
        Loading and saving need the roles' state on their devices: the caller's phase puts it there
        (``rlsys.controller.colocation``)."""
        self.cfg, self.actor, self.critic = cfg, actor, critic
        self.before_save = before_save
        self.actor_dir = os.path.join(cfg.output_dir, "checkpoints")
        self.critic_dir = os.path.join(cfg.output_dir, "critic_checkpoints")

    def to_resume(self) -> str | None:
        """The checkpoint ``trainer.resume`` finds (the latest), or None."""
        return latest_checkpoint(self.actor_dir) if self.cfg.resume else None

    def resume(self, ckpt: str) -> dict:
        """Load checkpoint ``ckpt`` (actor, and critic if any): ``{"step", "extra"}``."""
        state = self.actor.load(ckpt, self.cfg.load_optimizer)
        if self.critic is not None:
            self.critic.load(os.path.join(self.critic_dir, os.path.basename(ckpt)), self.cfg.load_optimizer)
        return state

    def due(self, step: int, last_step: int) -> bool:
        """Whether step ``step`` saves: every ``save_every`` steps and the last."""
        every = self.cfg.save_every
        return bool(every and step % every == 0) or step == last_step

    def save(self, step: int, last_step: int, extra: dict) -> None:
        try:
            if self.before_save is not None:
                self.before_save(step)
            if self.critic is not None:  # first, so an actor checkpoint always has its critic
                self.critic.save(self.critic_dir, step, extra, self.cfg.keep_last)
            self.actor.save(self.actor_dir, step, extra, self.cfg.keep_last)
        except OSError as e:  # a full disk or a quota; under Ray the rank's error is an OSError too
            latest = latest_checkpoint(self.actor_dir)
            what = f"saving step {step} failed ({e}); the latest complete checkpoint is {latest or 'none'}"
            if self.cfg.on_save_error == "continue" and step != last_step:
                logger.error("%s; training goes on (trainer.on_save_error: continue)", what)
                return
            raise CheckpointError(
                f"{what}. Free space under {self.cfg.output_dir}, then resume (trainer.resume=true); or set "
                "trainer.on_save_error: continue to train on past failed saves (the final one still stops the run)"
            ) from None

    def export(self) -> None:
        """The final actor in HF format (``output_dir/hf_export``), when ``trainer.export_hf``."""
        if not self.cfg.export_hf:
            return
        from rlsys.convert.cli import main as convert

        ckpt = latest_checkpoint(self.actor_dir)
        out = os.path.join(self.cfg.output_dir, "hf_export")
        convert(["mcore-to-hf", "--mcore", ckpt, "--out", out, "--overwrite"])


class NoCheckpoints:
    def to_resume(self) -> None:
        return None

    def resume(self, ckpt: str) -> dict:
        raise RuntimeError("a run without trained roles has no checkpoint to resume")

    def due(self, step: int, last_step: int) -> bool:
        return False

    def save(self, step: int, last_step: int, extra: dict) -> None:
        pass

    def export(self) -> None:
        pass
