"""Turn one run's measurements into the JSON, the markdown table, the targets and the plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .rows import FLOOR_ROW, NATIVE_OF, NATIVE_ROW

FLOOR_OF = {"main": FLOOR_ROW, "untied": "memcpy_untied"}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's median time over the vLLM-native row's and over the memcpy floor's, both of
    the row's own model (the untied rows against the untied references)."""
    by = {r["key"]: r for r in rows}
    for r in rows:
        med = r["seconds"]["median"]
        spec = r.get("spec", "main")
        for col, ref in (
            ("ratio_to_vllm_native", NATIVE_OF[spec]),
            ("ratio_to_memcpy", FLOOR_OF[spec]),
        ):
            r[col] = med / by[ref]["seconds"]["median"] if ref in by else None


def _params(n: int) -> str:
    return f"{n / 1e6:.0f} M" if n >= 1e7 else f"{n / 1e6:.2f} M"


def _mb(b: float | None) -> str:
    return "" if b is None else f"{b / 2**20:,.0f}"


def _x(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}x"


def _bytes(b: int) -> str:
    if b >= 1e9:
        return f"{b / 1e9:.2f} GB"
    if b >= 1e6:
        return f"{b / 1e6:.1f} MB"
    return f"{b / 1e3:.1f} kB"


def _pause(phases: dict[str, float] | None) -> str:
    """The median pause window of a row whose engine a sync pauses; "-" for the others."""
    pause = (phases or {}).get("pause")
    return f"{pause:.4f}" if pause else "-"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| row | s median | pause s | s min | s max | bytes sent | GB/s | engine calls "
        "| peak extra MiB | x vLLM reload | x memcpy | correct |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        s = r["seconds"]
        c = r["correct"]
        if r.get("error"):
            lines.append(f"| {r['label']} | error: {r['error'][:80]!s} |" + " |" * 10 + " **NO** |")
            continue
        ok = "yes" if c["passed"] else "**NO**"
        if c.get("diagnosis", {}).get("stale_tied_lm_head"):
            ok += " stale tied lm_head, see Known issues;"
        elif r["kind"] == "anchor" and c.get("tied_head_is_own_copy") is False:
            ok += " (this engine's tied head reads the embedding: it cannot go stale here);"
        if "mean_logprob_diff" in c:
            ok += (
                f" (dlp mean {c['mean_logprob_diff']:.3f}, max {c['max_logprob_diff']:.2f}; "
                f"wrong model {c['control_mean_logprob_diff']:.1f})"
            )
        if "own_load" in c:
            own = c["own_load"]
            ok += (
                f" as vLLM's own load of the trainer's checkpoint: dlp mean "
                f"{own['mean_logprob_diff']:.1e}, max {own['max_logprob_diff']:.1e};"
            )
        lines.append(
            f"| {r['label']} | {s['median']:.4f} | {_pause(r.get('phases'))} | {s['min']:.4f} "
            f"| {s['max']:.4f} | {_bytes(r['bytes'])} "
            f"| {r['gbps']:.2f} | {r['engine_calls']} | {_mb(r['peak_extra_bytes']['max'])} "
            f"| {_x(r.get('ratio_to_vllm_native'))} | {_x(r.get('ratio_to_memcpy'))} | {ok} |"
        )
    return "\n".join(lines)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' targets, each with the measured figure and the margin (>1 = met by that factor)."""
    by = {r["key"]: r for r in result["rows"]}
    med = {k: r["seconds"]["median"] for k, r in by.items()}
    out = []
    if "full_dense" in med and NATIVE_ROW in med:
        out.append(
            {
                "target": "FullSync dense <= vLLM's own reload from page-cached checkpoint",
                "measured": f"{med['full_dense']:.3f} s vs {med[NATIVE_ROW]:.3f} s",
                "margin": med[NATIVE_ROW] / med["full_dense"],
                "met": med["full_dense"] <= med[NATIVE_ROW],
            }
        )
    if "full_dense_untied" in med and "vllm_reload_untied" in med:
        ours, theirs = med["full_dense_untied"], med["vllm_reload_untied"]
        out.append(
            {
                "target": "FullSync dense <= vLLM's own page-cached reload, untied model "
                f"({by['full_dense_untied'].get('model')}: the same tensors)",
                "measured": f"{ours:.3f} s vs {theirs:.3f} s",
                "margin": theirs / ours,
                "met": ours <= theirs,
            }
        )
    frozen = by.get("full_frozen_embed")
    if frozen and "full_dense" in med and frozen.get("frozen_bytes"):
        full = by["full_dense"]
        share = frozen["frozen_bytes"] / full["bytes"]
        bytes_ok = frozen["bytes"] <= full["bytes"] - frozen["frozen_bytes"]
        time_bound = med["full_dense"] * (1 - share)
        out.append(
            {
                "target": "frozen embeddings: bytes and time down by at least the embedding's "
                f"share ({share:.0%} of FullSync dense's bytes)",
                "measured": f"{_bytes(frozen['bytes'])} vs {_bytes(full['bytes'])}; "
                f"{med['full_frozen_embed']:.3f} s vs {med['full_dense']:.3f} s "
                f"(bound {time_bound:.3f} s)",
                "margin": time_bound / med["full_frozen_embed"],
                "met": bytes_ok and med["full_frozen_embed"] <= time_bound,
            }
        )
    if "server_tmpfs" in med and "full_dense" in med:
        ratio = med["server_tmpfs"] / med["full_dense"]
        gloo = "".join(
            f"; {label} {med[key]:.3f} s ({med[key] / med['full_dense']:.2f}x)"
            for key, label in (
                ("server_tmpfs_fresh", "tmpfs, fresh files"),
                ("server_gloo", "gloo"),
                ("server_wt_files", "weight-transfer files"),
            )
            if key in med
        )
        out.append(
            {
                "target": "FullSync dense to a vllm serve over tmpfs within 1.5x of in-process",
                "measured": f"{med['server_tmpfs']:.3f} s vs {med['full_dense']:.3f} s "
                f"({ratio:.2f}x){gloo}",
                "margin": 1.5 / ratio,
                "met": ratio <= 1.5,
            }
        )
    if "replicas_2" in med and "replicas_1" in med:
        ratio = med["replicas_2"] / med["replicas_1"]
        out.append(
            {
                "target": "fan-out to 2 replicas under 2x one (Replicas, tmpfs)",
                "measured": f"{med['replicas_2']:.3f} s vs {med['replicas_1']:.3f} s ({ratio:.2f}x)",
                "margin": 2 / ratio,
                "met": ratio < 2,
            }
        )
    for adapter, full in (
        ("adapter_r16", "full_lora_separate"),
        ("adapter_r16", "full_dense"),
        ("adapter_r16_rank16", "full_lora_separate_rank16"),
    ):
        if adapter in med and full in med:
            speedup = med[full] / med[adapter]
            out.append(
                {
                    "target": f"{by[adapter]['label']} >= 20x faster than {by[full]['label']}",
                    "measured": f"{speedup:.1f}x ({med[adapter]:.4f} s vs {med[full]:.3f} s)",
                    "margin": speedup / 20,
                    "met": speedup >= 20,
                }
            )
            if full.startswith("full_lora_separate"):
                # issue 32: as much faster as it sends fewer bytes, with the base proof in place
                ratio = by[full]["bytes"] / by[adapter]["bytes"]
                out.append(
                    {
                        "target": f"{by[adapter]['label']} faster than {by[full]['label']} by "
                        f"their byte ratio ({ratio:.1f}x)",
                        "measured": f"{speedup:.1f}x",
                        "margin": speedup / ratio,
                        "met": speedup >= ratio,
                    }
                )
    for m in result.get("memory", []):
        out.append(
            {
                "target": f"FullSync merged peak extra <= bucket + largest tensor + 10% ({m['model']})",
                "measured": f"{_mb(m['peak_extra_bytes']['max'])} MiB vs bound {_mb(m['bound_bytes'])} MiB "
                f"(model {_mb(m['model_bytes'])} MiB)",
                "margin": m["bound_bytes"] / max(m["peak_extra_bytes"]["max"], 1),
                "met": m["peak_extra_bytes"]["max"] <= m["bound_bytes"],
            }
        )
    d = result.get("drift")
    if d:
        out.append(
            {
                "target": f"zero trainer drift after {d['cycles']} merged-LoRA syncs (bf16, {d['model']})",
                "measured": f"weightsync {d['weightsync']['max_abs_diff']:.3g}; "
                f"in-place merge/unmerge anchor {d['anchor_inplace_merge']['max_abs_diff']:.3g}",
                "margin": None,
                "met": d["weightsync"]["max_abs_diff"] == 0.0,
            }
        )
    return out


def targets_table(ts: list[dict[str, Any]]) -> str:
    lines = ["| target | measured | margin | met |", "|---|---|---|---|"]
    for t in ts:
        margin = "" if t["margin"] is None else f"{t['margin']:.2f}x"
        lines.append(
            f"| {t['target']} | {t['measured']} | {margin} | {'yes' if t['met'] else '**no**'} |"
        )
    return "\n".join(lines)


def profile_table(p: dict[str, Any]) -> str:
    lines = [
        "| part (median of 3, no profiler) | seconds |",
        "|---|---|",
        f"| trainer side only: plan + check + materialise buckets | {p['trainer_stream_only']:.4f} |",
        f"| vLLM only: reload_weights of an in-memory list | {p['vllm_reload_weights_in_memory_list']:.4f} |",
        f"| FullSync dense, whole | {p['full_dense']:.4f} |",
        f"| vLLM reload_weights from page-cached checkpoint | {p['vllm_reload_from_checkpoint']:.4f} |",
        f"| weightsync's KV-cache clear alone (inside every completed FullSync above; vLLM's own reload makes none) | {p.get('clear_kv_cache', float('nan')):.4f} |",
        "",
        "| cProfile cumulative seconds | FullSync dense | vLLM reload from checkpoint |",
        "|---|---|---|",
    ]
    f, r = p["functions"]["full_dense"], p["functions"]["vllm_reload_from_checkpoint"]
    labels = list(dict.fromkeys([*f["cumulative_seconds"], *r["cumulative_seconds"]]))
    lines.append(
        f"| total profiled | {f['total_profiled_seconds']:.3f} | {r['total_profiled_seconds']:.3f} |"
    )
    for lab in labels:
        a, b = f["cumulative_seconds"].get(lab), r["cumulative_seconds"].get(lab)
        lines.append(
            f"| {lab} | {'' if a is None else f'{a:.3f}'} | {'' if b is None else f'{b:.3f}'} |"
        )
    return "\n".join(lines)


def phases_table(rows: list[dict[str, Any]]) -> str:
    """Per row, the medians of its parts (benchmarks/phases.py); they add up to the total."""
    lines = [
        "| row | s total | weightsync (plan + produce) | of which plan | serialization "
        "| engine | engine share | pause window (inside engine) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.get("phases") or {}
        if not p:
            continue
        share = p["engine"] / p["total"] if p["total"] else 0.0
        lines.append(
            f"| {r['label']} | {p['total']:.4f} | {p['weightsync']:.4f} | {p['plan']:.4f} "
            f"| {p['serialize']:.4f} | {p['engine']:.4f} | {share:.0%} | {_pause(p)} |"
        )
    return "\n".join(lines)


def adapter_profile_table(p: dict[str, Any]) -> str:
    lines = [
        f"AdapterSync r16, {p['syncs']} syncs: median {p['median_seconds_unprofiled'] * 1e3:.1f} ms "
        "per sync without the profiler.",
        "",
        "| cProfile, ms per sync (cumulative; the profiler inflates Python-heavy parts) | ms |",
        "|---|---|",
        f"| total profiled | {p['total_profiled_seconds'] * 1e3:.1f} |",
    ]
    for label, seconds in p["cumulative_seconds"].items():
        pad = len(label) - len(label.lstrip())
        lines.append(f"| {'· ' * (pad // 2)}{label.strip()} | {seconds * 1e3:.1f} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    m = result["meta"]
    parts = [
        f"# weightsync benchmark: {m['model']} ({_params(m['params'])} params, {m['dtype']}, "
        f"{m['model_bytes'] / 1e9:.2f} GB)",
        "",
        f"`{m['command']}` -- {m['date']} -- {m['machine']}; {m['repeats']} timed runs per row after "
        f"{m['warmup']} warm-up; vLLM {m['vllm']}, torch {m['torch']}",
        "",
        table(result["rows"]),
        "",
        "## Where the seconds go, per row (median of the timed runs; timers, no profiler)",
        "",
        phases_table(result["rows"]),
        "",
        "## Targets (issues 3, 8, 10, 32)",
        "",
        targets_table(result["targets"]),
    ]
    if result.get("drift"):
        d = result["drift"]
        parts += [
            "",
            f"## Drift ({d['model']}, bf16, LoRA r16, max |W - W_start| over the base weights)",
            "",
            "| cycles | " + " | ".join(map(str, d["marks"])) + " |",
            "|---|" + "---|" * len(d["marks"]),
            "| weightsync FullSync(lora=merge) | "
            + " | ".join(f"{v:.3g}" for v in d["weightsync"]["curve"])
            + " |",
            "| in-place merge/unmerge | "
            + " | ".join(f"{v:.3g}" for v in d["anchor_inplace_merge"]["curve"])
            + " |",
        ]
    if result.get("memory"):
        parts += [
            "",
            "## Peak extra memory of FullSync(lora=merge) by model size",
            "",
            "| model | params | model MiB | peak extra MiB (max) | median | bound MiB (bucket + largest + 10%) |",
            "|---|---|---|---|---|---|",
        ]
        for x in result["memory"]:
            parts.append(
                f"| {x['model']} | {_params(x['params'])} | {_mb(x['model_bytes'])} | "
                f"{_mb(x['peak_extra_bytes']['max'])} | {_mb(x['peak_extra_bytes']['median'])} | {_mb(x['bound_bytes'])} |"
            )
    if result.get("profile"):
        parts += ["", "## Where the seconds go", "", profile_table(result["profile"])]
    if result.get("profile_untied"):
        parts += [
            "",
            f"## Where the seconds go, untied model ({m.get('untied_model')}: like for like)",
            "",
            profile_table(result["profile_untied"]),
        ]
    if result.get("profile_adapter"):
        parts += [
            "",
            "## Where the seconds of AdapterSync r16 go",
            "",
            adapter_profile_table(result["profile_adapter"]),
        ]
    return "\n".join(parts) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    rows = [r for r in result["rows"] if not r.get("error")]
    labels = [r["label"] for r in rows]
    colors = {
        "weightsync": "tab:blue",
        "anchor": "tab:orange",
        "vllm-native": "tab:green",
        "floor": "tab:gray",
    }
    c = [colors[r["kind"]] for r in rows]
    med = [r["seconds"]["median"] for r in rows]
    lo = [r["seconds"]["median"] - r["seconds"]["min"] for r in rows]
    hi = [r["seconds"]["max"] - r["seconds"]["median"] for r in rows]
    mem = [r["peak_extra_bytes"]["max"] / 2**20 for r in rows]
    n = 3 if result.get("drift") else 2
    fig, axes = plt.subplots(1, n, figsize=(6 * n + 2, 0.45 * len(rows) + 2.5))
    y = range(len(rows))
    ax = axes[0]
    ax.barh(y, med, xerr=[lo, hi], color=c, capsize=3)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per sync (median, min-max bars; log scale)")
    ax.set_title("time")
    ax = axes[1]
    ax.barh(y, mem, color=c)
    ax.set_yticks(list(y), [""] * len(rows))
    ax.invert_yaxis()
    ax.set_xlabel("peak extra resident memory, MiB (max over runs)")
    ax.set_title("peak extra memory")
    if n == 3:
        d = result["drift"]
        ax = axes[2]
        for who, lab, col in (
            ("anchor_inplace_merge", "in-place merge/unmerge", "tab:orange"),
            ("weightsync", "weightsync FullSync(lora=merge)", "tab:blue"),
        ):
            ax.plot(d["marks"], d[who]["curve"], marker="o", label=lab, color=col)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sync cycles")
        ax.set_ylabel("max |W - W_start|")
        ax.set_title(f"trainer weight drift ({d['model']}, bf16)")
        ax.legend()
    m = result["meta"]
    fig.suptitle(
        f"weightsync benchmark -- {m['model']} ({_params(m['params'])} params, {m['dtype']}), {m['date']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict[str, Any], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "results.json",
        "markdown": out / "results.md",
        "plot": out / "results.png",
    }
    paths["json"].write_text(json.dumps(result, indent=2, default=str))
    paths["markdown"].write_text(markdown(result))
    plot(result, paths["plot"])
    return paths
