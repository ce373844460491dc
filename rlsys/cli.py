"""The ``rlsys`` command line.

User mistakes (``UserError``: bad config, bad checkpoint, impossible layout)
print one ``error:`` line and exit with code 2; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from rlsys.errors import UserError


def _cmd_plan(args) -> int:
    from rlsys.config import dump_yaml, load_config
    from rlsys.plan import build_plan, model_arch, render_plan, validate_layout

    cfg = load_config(args.config, args.overrides)
    arch = model_arch(cfg.model)
    validate_layout(cfg, arch)
    if not args.quiet:
        print("# resolved config")
        print(dump_yaml(cfg))
    print(render_plan(build_plan(cfg, arch)))
    return 0


def _cmd_train(args) -> int:
    from rlsys.config import load_config
    from rlsys.controller.loop import train

    cfg = load_config(args.config, args.overrides)  # train checks the plan before it starts anything
    mode = "rollout" if args.rollout_only else "train" if args.train_only is not None else "full"
    history = train(cfg, use_ray=not args.no_ray, mode=mode, replay_dir=args.train_only or None)
    if history:
        last = history[-1]
        print(f"done: {len(history)} steps, reward/mean {last['reward/mean']:.3f}, output in {cfg.trainer.output_dir}")
    return 0


def _cmd_plot(args) -> int:
    from rlsys.telemetry.plot import plot_run

    print(plot_run(args.output_dir))
    return 0


def _cmd_check_parity(args) -> int:
    from rlsys.architectures.hf_checkpoint import HFCheckpoint
    from rlsys.architectures.hf_config import read_arch
    from rlsys.config import ParallelConfig
    from rlsys.local_ranks import launched_by_torchrun
    from rlsys.parity import Tolerances, check_parity, check_parity_in_group, parity_world_size
    from rlsys.plan import check_layout_flags

    arch = read_arch(args.hf)
    HFCheckpoint(args.hf)  # fail fast on a broken index before starting ranks
    layout = ParallelConfig(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        vpp=args.vpp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
    )
    world = parity_world_size(layout, args.dp)
    check_layout_flags(layout, world, arch)
    run = dict(seq_len=args.seq_len, batch=args.batch, device=args.device, dp=args.dp)
    given = dict(rtol=args.rtol, max_kl=args.max_kl, min_top1=args.min_top1, atol=args.tol)
    tol = Tolerances(**{k: v for k, v in given.items() if v is not None})
    if launched_by_torchrun():
        report = check_parity_in_group(args.hf, layout, **run)
        if report is None:  # not rank 0: rank 0 reports
            return 0
    else:
        print(
            f"check-parity: {arch.model_type} from {args.hf} at TP={layout.tp} PP={layout.pp} EP={layout.ep}"
            f"{f' VPP={layout.vpp}' if layout.vpp else ''} on {world} {args.device} rank(s), "
            f"batch {args.batch} x {args.seq_len} tokens, fp32",
            flush=True,
        )
        report = check_parity(args.hf, layout, **run)
    print(report.summary())
    failures = report.failures(tol)
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    print("parity: FAIL" if failures else "parity: pass")
    return 1 if failures else 0


def _cmd_convert(args) -> int:
    from rlsys.convert.cli import main as convert_main

    return convert_main(args.rest, prog="rlsys convert")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlsys", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="validate a config and print the resolved config and the parallel plan")
    plan.add_argument("config", help="experiment YAML (configs/*.yaml)")
    plan.add_argument("overrides", nargs="*", help="key.path=value overrides, type-checked")
    plan.add_argument("-q", "--quiet", action="store_true", help="print only the plan")
    plan.set_defaults(func=_cmd_plan)

    par = sub.add_parser("check-parity", help="compare Megatron logits at a TP/PP/EP layout with HF transformers")
    par.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    par.add_argument("--tp", type=int, default=1)
    par.add_argument("--pp", type=int, default=1)
    par.add_argument("--ep", type=int, default=1)
    par.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: tp)")
    par.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    par.add_argument("--dp", type=int, default=1, help="data-parallel replicas on top of the model grid")
    par.add_argument("--first-stage-layers", type=int, default=None, help="uneven pipeline: layers on stage 0")
    par.add_argument("--last-stage-layers", type=int, default=None, help="uneven pipeline: layers on the last stage")
    par.add_argument("--seq-len", type=int, default=32)
    par.add_argument("--batch", type=int, default=2)
    # defaults: rlsys.parity.Tolerances
    par.add_argument("--rtol", type=float, default=None, help="max |logit diff| / std of HF's logits (1e-3)")
    par.add_argument("--max-kl", type=float, default=None, help="mean KL(HF || Megatron) in nats (1e-4)")
    par.add_argument("--min-top1", type=float, default=None, help="share of agreeing argmaxes (1.0)")
    par.add_argument("--tol", type=float, default=None, help="also bound max |logit diff| absolutely")
    par.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    par.set_defaults(func=_cmd_check_parity)

    tr = sub.add_parser("train", help="run an RL job: rlsys train CONFIG [key=value ...]")
    tr.add_argument("config")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=10")
    tr.add_argument("--no-ray", action="store_true", help="run one-rank roles in this process (for a debugger)")
    only = tr.add_mutually_exclusive_group()
    only.add_argument(
        "--rollout-only", action="store_true", help="generate and score only; save each step's batch to OUTPUT/rollouts"
    )
    only.add_argument(
        "--train-only",
        nargs="?",
        const="",
        metavar="DIR",
        help="no engines: train on saved batches (default OUTPUT/rollouts, from --rollout-only)",
    )
    tr.set_defaults(func=_cmd_train)

    pl = sub.add_parser("plot", help="draw reward, length, KL and step-time curves of a run as a PNG")
    pl.add_argument("output_dir")
    pl.set_defaults(func=_cmd_plot)

    conv = sub.add_parser(
        "convert", help="HF <-> Megatron checkpoints (same as python -m tools.convert)", add_help=False
    )
    conv.add_argument("rest", nargs=argparse.REMAINDER)
    conv.set_defaults(func=_cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rlsys.telemetry.noise import quiet_libraries

    args = build_parser().parse_args(argv)
    quiet_libraries()  # RLSYS_VERBOSE=1 shows every library warning
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
