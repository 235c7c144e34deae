"""``kvo-plan``: how much KV cache a deployment keeps on the device and in host memory.

Prints, per rank, the KV-cache memory without offload, with layerwise prefill offload and with
sparse decode offload, the layer buffer plan and the per-step decode transfer bound, for a
built-in model preset or a Hugging Face ``config.json``. Bad input ends with one line on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

from kvo_core.errors import ConfigError, KvoError
from kvo_core.models import ModelDescription, model_from_hf_config, preset, preset_names
from kvo_core.planner import Memory, PlannerInputs, PlanReport, estimate

PROG = "kvo-plan"
DEFAULT_MODEL = "deepseek-v3.2"
USAGE_ERROR = 2


class _UsageError(Exception):
    """Raised instead of argparse's exit so main() prints exactly one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def parse_independent_layers(text: str) -> tuple[int, ...] | Literal["all"]:
    """``"all"``, ``"none"``/empty, or a comma list of layer indices such as ``"0,-1"``."""
    cleaned = text.strip().lower()
    if cleaned == "all":
        return "all"
    if cleaned in ("", "none"):
        return ()
    try:
        return tuple(int(part) for part in cleaned.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'all', 'none' or a comma list of layer indices such as 0,-1; "
            f"got {text!r}") from None


def load_model(name_or_path: str) -> ModelDescription:
    """A preset by name, else a Hugging Face ``config.json`` (or a directory holding one)."""
    if name_or_path.strip().lower() in preset_names():
        return preset(name_or_path)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        presets = ", ".join(preset_names())
        raise ConfigError(f"--model {name_or_path!r} is neither a preset ({presets}) nor an "
                          f"existing config.json file or model directory")
    try:
        with path.open(encoding="utf-8") as handle:
            config = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"--model {str(path)!r} is not a JSON config.json: {error}") from None
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return model_from_hf_config(config, name=name or str(path))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Estimate per-rank KV-cache memory and decode transfer for kvo's layerwise "
                    "prefill offload and sparse decode offload.",
        epilog="Assumptions: MLA latent KV and indexer keys are replicated on every TP rank "
               "(not sharded); dense GQA KV heads are sharded by TP (replicated once TP exceeds "
               "the KV heads). Every request holds --seq-len tokens in whole blocks; the prefill "
               "rank holds all --concurrency requests. The decode host pool (full main KV) is "
               "shared by the TP ranks of one decode DP rank. Main KV is bf16. Give negative "
               "independent layers as --independent-layers=-1.")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"preset ({', '.join(preset_names())}) or path to a Hugging Face "
                             f"config.json / model directory (default {DEFAULT_MODEL})")
    parser.add_argument("--seq-len", type=_positive_int, default=131072,
                        help="tokens per request (default 131072)")
    parser.add_argument("--concurrency", type=_positive_int, default=16,
                        help="concurrent requests = decode rows (default 16)")
    parser.add_argument("--prefill-tp", type=_positive_int, default=1,
                        help="prefill tensor-parallel size (default 1)")
    parser.add_argument("--decode-tp", type=_positive_int, default=1,
                        help="decode tensor-parallel size; prefill TP must be a multiple "
                             "(default 1)")
    parser.add_argument("--shared-buffers", type=_positive_int, default=2,
                        help="shared physical layer buffers for layerwise prefill (default 2)")
    parser.add_argument("--independent-layers", type=parse_independent_layers, default=(0,),
                        help="layers with a buffer of their own: comma list (negative counts "
                             "from the end), 'none' or 'all' (default 0)")
    parser.add_argument("--hot-capacity", type=_positive_int, default=8192,
                        help="hot-buffer tokens per decode row and layer (default 8192)")
    parser.add_argument("--top-k", type=_positive_int, default=None,
                        help="tokens the indexer selects per row (default: the model's, or 2048)")
    parser.add_argument("--block-size", type=_positive_int, default=None,
                        help="cache block size in tokens (default: the model's, 128)")
    parser.add_argument("--miss-rate", type=_fraction, default=0.15,
                        help="assumed share of top-k entries that miss the hot buffer per step "
                             "(default 0.15)")
    parser.add_argument("--indexer-dtype", choices=("bfloat16", "int8"), default="bfloat16",
                        help="indexer key cache dtype; int8 adds an fp16 scale per token (C8)")
    parser.add_argument("--no-mtp", action="store_true",
                        help="leave out the model's MTP (next-token prediction) layers")
    parser.add_argument("--json", action="store_true",
                        help="print machine-readable JSON instead of the table")
    return parser


def human_bytes(count: float) -> str:
    """Binary units with two decimals: 1536 -> '1.50 KiB'."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "n/a"


def format_table(report: PlanReport) -> str:
    """The human-readable report."""
    inputs = report.inputs
    tp = report.tp
    lines = [
        f"model     {inputs.model.describe()}",
        f"workload  {inputs.concurrency} requests x {inputs.seq_len} tokens, block "
        f"{report.block_size}; prefill TP {tp.prefill_tp} -> decode TP {tp.decode_tp} "
        f"(ratio {tp.ratio})",
        "",
    ]
    rows: list[tuple[str, Memory | None, str]] = [
        (f"no offload, prefill rank (TP {tp.prefill_tp})", report.no_offload_prefill, ""),
        (f"no offload, decode rank (TP {tp.decode_tp})", report.no_offload_decode, ""),
        ("layerwise prefill offload (prefill rank)", report.layerwise.memory, ""),
    ]
    if report.sparse_decode is not None:
        rows.append(("sparse decode offload (decode rank)", report.sparse_decode.memory,
                     " (host shared per DP rank)"))
    else:
        rows.append(("sparse decode offload (decode rank)", None, ""))
    width = max(len(label) for label, _, _ in rows)
    lines.append(f"{'KV cache per rank':<{width}}  {'device':>12}  {'host':>12}")
    for label, memory, suffix in rows:
        if memory is None:
            lines.append(f"{label:<{width}}  not applicable (no sparse-attention indexer)")
        else:
            lines.append(f"{label:<{width}}  {human_bytes(memory.device_bytes):>12}  "
                         f"{human_bytes(memory.host_bytes):>12}{suffix}")

    layerwise = report.layerwise
    independent = (", ".join(map(str, layerwise.independent)) or "none")
    lines += [
        "",
        f"layerwise plan: {layerwise.physical_buffers} physical buffers for "
        f"{layerwise.num_layers} layers (independent: {independent}; shared buffers "
        f"{inputs.shared_buffers})",
        f"                main-KV footprint ratio {layerwise.footprint_ratio:.4f}",
    ]
    sparse = report.sparse_decode
    if sparse is not None:
        transfer = sparse.transfer
        full = transfer.full_reload_bytes
        steps = [
            ("worst case (every top-k entry misses)", transfer.worst_case_bytes, True),
            (f"assumed {transfer.miss_rate:.0%} miss rate", transfer.expected_bytes, True),
            ("full-layer reload (no sparse offload)", full, False),
            ("new-token append (device -> host)", transfer.append_bytes, False),
        ]
        label_width = max(len(label) for label, _, _ in steps)
        lines += [
            f"sparse decode device: indexer {human_bytes(sparse.indexer_device_bytes)} + hot "
            f"buffers {human_bytes(sparse.hot_buffer_device_bytes)} ({transfer.rows} rows x "
            f"{sparse.hot_capacity} tokens x {transfer.layers} layers)",
            f"                      device KV ratio offload/none {report.decode_device_ratio:.4f}"
            f" (main KV alone {report.decode_main_kv_ratio:.4f})",
            "",
            f"decode transfer per step (decode rank, {transfer.rows} rows x {transfer.layers} "
            f"layers, {transfer.row_bytes} B per main-KV row, top-k {transfer.top_k}):",
        ]
        for label, count, compare in steps:
            share = f"  {_percent(count, full):>8} of full reload" if compare else ""
            lines.append(f"  {label:<{label_width}}  {human_bytes(count):>12}{share}")
    if report.notes:
        lines.append("")
        for note in report.notes:
            lines += textwrap.wrap(note, width=100, initial_indent="note: ",
                                   subsequent_indent="      ")
    lines += ["", "assumptions:"]
    for text in report.assumptions:
        lines += textwrap.wrap(text, width=100, initial_indent="  - ", subsequent_indent="    ")
    return "\n".join(lines)


def _inputs_from_args(args: argparse.Namespace) -> PlannerInputs:
    return PlannerInputs(
        model=load_model(args.model), seq_len=args.seq_len, concurrency=args.concurrency,
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
        shared_buffers=args.shared_buffers, independent_layers=args.independent_layers,
        hot_capacity=args.hot_capacity, top_k=args.top_k, block_size=args.block_size,
        miss_rate=args.miss_rate, indexer_kv_dtype=args.indexer_dtype,
        include_mtp=not args.no_mtp)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvo-plan`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        report = estimate(_inputs_from_args(args))
        output: Any = (json.dumps(report.to_json(), indent=2) if args.json
                       else format_table(report))
    except (_UsageError, KvoError, ValueError, OSError) as error:
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return USAGE_ERROR
    try:
        print(output)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: not an error of ours, and no traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
