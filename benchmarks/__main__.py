"""``python -m benchmarks``: every sync strategy head-to-head on real vLLM engines.

In-process engines for most rows, two ``vllm serve`` processes for the out-of-process ones.

    bash .ci/env python -m benchmarks                       # 0.5B shape + its untied twin, all rows
    bash .ci/env python -m benchmarks --model tiny          # a fast look
    bash .ci/env python -m benchmarks --model ~/my-model    # your own HF model folder
    bash .ci/env python -m benchmarks --rows full_dense,adapter_r16,vllm_reload --repeats 3
    bash .ci/env python -m benchmarks --no-server           # without the vllm serve rows

Writes results.json, results.md and results.png into --out (default benchmarks/results/<model>/)
and prints the table. See docs/benchmarks.md for how to read it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from .console import quiet_vllm

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
quiet_vllm()

SECOND_SIZE = {"tiny": "tiny4", "0.5b": "1.5b"}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from .models import UNTIED
    from .rows import ROW_KEYS, ROWS, SERVER_ROWS

    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default="0.5b",
        help="shape (tiny, tiny4, 0.5b, 1.5b, 3b) or a folder with config.json + *.safetensors",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per row, after one warm-up")
    p.add_argument("--out", type=Path, default=None, help="output folder")
    p.add_argument("--rows", default="all", help=f"comma-separated subset of: {','.join(ROW_KEYS)}")
    p.add_argument("--drift-cycles", type=int, default=1000, help="0 skips the drift figure")
    p.add_argument("--drift-model", default="tiny", help="model the drift loop runs on")
    p.add_argument(
        "--memory-model",
        default=None,
        help="second size for the peak-memory check (default: 1.5b for 0.5b, tiny4 for "
        "tiny, none otherwise); 'none' skips it",
    )
    p.add_argument(
        "--no-profile", action="store_true", help="skip the where-do-the-seconds-go profile"
    )
    p.add_argument(
        "--untied-model",
        default=None,
        help="untied twin for the like-for-like rows (default: <model>-untied for the built-in "
        "shapes tiny and 0.5b, none otherwise); 'none' skips those rows",
    )
    p.add_argument(
        "--no-server",
        action="store_true",
        help="skip the out-of-process rows (they start two vllm serve processes: ~1-2 min)",
    )
    args = p.parse_args(argv)
    chosen = args.rows != "all"
    args.rows = (
        ROW_KEYS if args.rows == "all" else [r.strip() for r in args.rows.split(",") if r.strip()]
    )
    unknown = [r for r in args.rows if r not in ROW_KEYS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {ROW_KEYS}")
    if args.memory_model is None:
        args.memory_model = SECOND_SIZE.get(args.model, "none")
    if args.untied_model is None:
        args.untied_model = f"{args.model}-untied" if f"{args.model}-untied" in UNTIED else "none"
    untied_rows = [r.key for r in ROWS if r.spec == "untied"]
    if args.untied_model == "none":
        if chosen and set(args.rows) & set(untied_rows):
            p.error(f"rows {untied_rows} need --untied-model")
        args.rows = [r for r in args.rows if r not in untied_rows]
    if args.no_server:
        args.rows = [r for r in args.rows if r not in SERVER_ROWS]
    return args


def run(
    args: argparse.Namespace, *, command: str | None = None, quiet: bool = False
) -> dict[str, Any]:
    """Run the benchmark described by ``args``; returns the result and writes it to ``args.out``."""
    import torch
    import vllm
    from tqdm import tqdm

    from weightsync.trainer.tensors import DEFAULT_BUCKET_BYTES

    from . import profiling, report
    from .drift import drift
    from .memory import memory_bound, memory_check
    from .models import resolve
    from .rows import ROWS
    from .suite import Bench

    log = (lambda *a: None) if quiet else (lambda msg: tqdm.write(msg))
    spec = resolve(args.model, log=log)
    untied = None if args.untied_model == "none" else resolve(args.untied_model, log=log)
    out = args.out or Path(__file__).parent / "results" / spec.name
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in ROWS if r.key in args.rows]
    drift_cycles = args.drift_cycles
    mem_model = None if args.memory_model == "none" else args.memory_model
    total = (
        len(rows) * (args.repeats + 1) + 2 * drift_cycles + (args.repeats + 1 if mem_model else 0)
    )
    bar = tqdm(total=total, unit="run", disable=quiet, dynamic_ncols=True)

    result: dict[str, Any] = {
        "meta": {
            "command": command
            or "python -m benchmarks " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "date": dt.date.today().isoformat(),
            "model": spec.name,
            "checkpoint": spec.checkpoint,
            "untied_model": untied.name if untied else None,
            "untied_checkpoint": untied.checkpoint if untied else None,
            "untied_params": untied.params if untied else None,
            "params": spec.params,
            "dtype": spec.dtype_name,
            "model_bytes": spec.params * torch.empty((), dtype=spec.dtype).element_size(),
            "built_here": spec.built_here,
            "repeats": args.repeats,
            "warmup": 1,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
            f"{__import__('psutil').virtual_memory().total / 2**30:.0f} GiB RAM, no GPU",
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "bucket_bytes": DEFAULT_BUCKET_BYTES,
            "weightsync": _weightsync_version(),
        },
        "rows": [],
    }

    bench = Bench(spec, workdir=out, log=log, untied=untied)
    try:
        for i, row in enumerate(rows):
            bar.set_description(row.label[:40])
            result["rows"].append(bench.run_row(row, args.repeats, tick=bar.update))
            bench.trainers.release(rows[i + 1 :])
    finally:
        bench.servers.stop()  # the server rows come last; nothing of theirs outlives them
    report.add_ratios(result["rows"])

    if not args.no_profile and any(r.engine == "plain" for r in rows):
        bar.set_description("profile")
        result["profile"] = profiling.full_sync(bench.engine("plain"), bench.trainers.dense)
    if not args.no_profile and any(r.engine == "untied" for r in rows):
        bar.set_description("profile (untied)")
        result["profile_untied"] = profiling.full_sync(
            bench.engine("untied"), bench.trainers.dense_untied
        )
    if not args.no_profile and any(r.key == "adapter_r16" for r in rows):
        bar.set_description("profile AdapterSync r16")
        result["profile_adapter"] = profiling.adapter_sync(
            bench.engine("lora"), bench.trainers.peft
        )

    if drift_cycles:
        # The drift loop reuses the plain engine when it runs on the same bf16 model.
        bar.set_description(f"drift x{drift_cycles}")
        same = (
            args.drift_model == spec.name
            and spec.dtype == torch.bfloat16
            and bench.inprocess.started("plain")
        )
        result["drift"] = drift(
            drift_cycles,
            shape=args.drift_model,
            log=log,
            tick=bar.update,
            engine=bench.engine("plain") if same else None,
        )

    merged = next((r for r in result["rows"] if r["key"] == "full_lora_merge"), None)
    memory = []
    if merged:
        bound = memory_bound(bench.trainers.peft, bench.engine("plain"))
        memory.append(
            {
                "model": spec.name,
                "params": spec.params,
                **bound,
                "seconds": merged["seconds"],
                "peak_extra_bytes": merged["peak_extra_bytes"],
            }
        )
    bench.close()
    del bench
    if mem_model:
        bar.set_description(f"memory check on {mem_model}")
        memory.append(memory_check(mem_model, args.repeats, log=log, tick=bar.update))
    result["memory"] = memory

    bar.close()

    result["targets"] = report.targets(result)
    # The exit status speaks for weightsync (and the vLLM/floor references). An anchor imitates
    # another framework's approach; that it serves wrong weights is a finding, reported in the
    # table, not a failure of this run.
    result["correct"] = all(r["correct"]["passed"] for r in result["rows"] if r["kind"] != "anchor")
    paths = report.write(result, out)
    result["paths"] = {k: str(v) for k, v in paths.items()}
    if not quiet:
        print(report.markdown(result))
        print("\n".join(f"[bench] wrote {p}" for p in paths.values()))
    return result


def _weightsync_version() -> str:
    """weightsync's version, with the git commit (and '+dirty') of the tree it was imported from."""
    import subprocess

    import weightsync

    root = Path(weightsync.__file__).resolve().parents[1]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "weightsync"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return f"{weightsync.__version__} ({root}, git {rev}{'+dirty' if dirty else ''})"
    except (OSError, subprocess.CalledProcessError):
        return f"{weightsync.__version__} ({root})"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
