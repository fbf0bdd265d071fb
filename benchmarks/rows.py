"""The rows of the benchmark: what each one syncs, into which engine, and which trainer model the
engine must match afterwards.

The in-process engines a row names (`benchmarks.inprocess`):

- ``plain``: vLLM without LoRA. Rows that push a dense model or merged LoRA, the snapshot
  reload, the anchors.
- ``lora``: vLLM with ``enable_lora=True`` (max rank 64). Rows that push base + adapter, the
  adapter-only rows, the reload of the original checkpoint.
- ``lora16``: the same at vLLM's default max rank, 16, which TRL's async trainers also pick
  for an r16 adapter (the smallest rank vLLM accepts at or above the adapter's). vLLM zeroes an
  adapter slot of the max rank before each install, so an r16 install costs more on ``lora``.
- ``untied``: vLLM without LoRA on the untied twin of the model.

The out-of-process rows name their own engine, the row's key (`benchmarks.servers`). The
trainer models are described in `benchmarks.trainers`.
"""

from __future__ import annotations

from dataclasses import dataclass

RANKS = [8, 16, 64]


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    kind: str  # "weightsync" | "anchor" | "vllm-native" | "floor"
    engine: str | None  # "plain" | "lora" | "lora16" | "untied", a server row's key, or None
    model: str  # trainer model the engine must match afterwards: "dense" | "peft" | "checkpoint"
    note: str
    spec: str = "main"  # "main": the --model; "untied": its untied twin (models.UNTIED)


ROWS: list[Row] = [
    Row(
        "full_dense",
        "FullSync dense",
        "weightsync",
        "plain",
        "dense",
        "every weight from trainer memory, one reload_weights call, 512 MiB buckets",
    ),
    Row(
        "full_frozen_embed",
        "FullSync dense, embeddings frozen",
        "weightsync",
        "plain",
        "dense",
        "embed_tokens (and its tied lm_head) requires_grad=False, every other weight updated in "
        "place between syncs (outside the timer); FullSync() skips what the engine holds",
    ),
    Row(
        "full_lora_merge",
        "FullSync LoRA merged",
        "weightsync",
        "plain",
        "peft",
        "W + s*B@A computed out of place in fp32, cast once; trainer untouched",
    ),
    Row(
        "full_lora_separate",
        "FullSync base+adapter",
        "weightsync",
        "lora",
        "peft",
        "base unmerged + adapter loaded in place; engine serves LoRA",
    ),
    *[
        Row(
            f"adapter_r{r}",
            f"AdapterSync r{r}",
            "weightsync",
            "lora",
            "peft",
            f"rank-{r} adapter only, written to tmpfs and loaded in place",
        )
        for r in RANKS
    ],
    Row(
        "full_lora_separate_rank16",
        "FullSync base+adapter (max rank 16)",
        "weightsync",
        "lora16",
        "peft",
        "as FullSync base+adapter, on an engine at vLLM's default max_lora_rank (16)",
    ),
    Row(
        "adapter_r16_rank16",
        "AdapterSync r16 (max rank 16)",
        "weightsync",
        "lora16",
        "peft",
        "as AdapterSync r16, on an engine at vLLM's default max_lora_rank (16)",
    ),
    Row(
        "reload_checkpoint",
        "ReloadWeights(checkpoint)",
        "weightsync",
        "lora",
        "peft",
        "engine re-reads its original checkpoint (page cache) + adapter",
    ),
    Row(
        "reload_snapshot",
        "ReloadWeights(snapshot)",
        "weightsync",
        "plain",
        "dense",
        "trainer writes a safetensors snapshot to disk, engine reloads it",
    ),
    Row(
        "anchor_per_module_rpc",
        "anchor: per-tensor RPC (TRL/OpenRLHF)",
        "anchor",
        "plain",
        "dense",
        "one reload_weights call per vLLM parameter group (q/k/v together, gate/up together)",
    ),
    Row(
        "anchor_inplace_merge",
        "anchor: in-place merge+unmerge (ms-swift/TRL)",
        "anchor",
        "plain",
        "peft",
        "peft merge_adapter, push base in one call, unmerge_adapter",
    ),
    Row(
        "vllm_reload",
        "vLLM reload_weights from checkpoint",
        "vllm-native",
        "plain",
        "checkpoint",
        "collective_rpc('reload_weights') of the page-cached original checkpoint (the engine's "
        "tied head set to the checkpoint's first, untimed)",
    ),
    Row(
        "memcpy",
        "memcpy floor",
        "floor",
        None,
        "dense",
        "copy_ of the same bytes into preallocated tensors",
    ),
    # Like for like: on an untied model FullSync and vLLM's reload move the same tensors.
    Row(
        "full_dense_untied",
        "FullSync dense (untied model)",
        "weightsync",
        "untied",
        "dense",
        "as FullSync dense, on the untied Llama-style twin of the model",
        "untied",
    ),
    Row(
        "vllm_reload_untied",
        "vLLM reload_weights from checkpoint (untied model)",
        "vllm-native",
        "untied",
        "checkpoint",
        "as vLLM reload_weights, on the untied twin: every tensor it reads is one FullSync sends",
        "untied",
    ),
    Row(
        "memcpy_untied",
        "memcpy floor (untied model)",
        "floor",
        None,
        "dense",
        "copy_ of the untied twin's bytes into preallocated tensors",
        "untied",
    ),
    # Out of process (issue 8): vllm serve processes started by the benchmark (--no-server skips).
    Row(
        "server_tmpfs",
        "FullSync dense -> vllm serve (tmpfs)",
        "weightsync",
        "server_tmpfs",
        "dense",
        "VLLMServerEngine(transport='tmpfs'): safetensors buckets in sealed memory files, kept "
        "and rewritten in place, both sides keeping them mapped; checked by the workers while "
        "the server serves, loaded in the pause",
    ),
    Row(
        "server_tmpfs_untagged",
        "FullSync dense -> vllm serve (tmpfs, tags off)",
        "weightsync",
        "server_tmpfs_untagged",
        "dense",
        "TmpfsTransport(tagged=False): the tmpfs row without the keyed tag of each file "
        "(the token still sent): what the tags cost",
    ),
    Row(
        "server_tmpfs_fresh",
        "FullSync dense -> vllm serve (tmpfs, fresh files)",
        "weightsync",
        "server_tmpfs_fresh",
        "dense",
        "TmpfsTransport(keep=False): new sealed memory files per sync, mapped, checked, "
        "loaded and let go",
    ),
    Row(
        "server_gloo",
        "FullSync dense -> vllm serve (gloo)",
        "weightsync",
        "server_gloo",
        "dense",
        "VLLMServerEngine(transport='gloo'): buckets broadcast over a gloo process group",
    ),
    Row(
        "server_gloo_untagged",
        "FullSync dense -> vllm serve (gloo, tags off)",
        "weightsync",
        "server_gloo_untagged",
        "dense",
        "GlooTransport(tagged=False): the gloo row without the keyed tag of each bucket "
        "(the token still sent): what the tags cost",
    ),
    Row(
        "server_wt_files",
        "FullSync dense -> vllm serve (weight-transfer API, files)",
        "weightsync",
        "server_wt_files",
        "dense",
        "WeightTransferFiles(client): vLLM's weight-transfer routes to weightsync's "
        "backend, every file written and tagged while the server serves, then one update "
        "in the pause checks and loads them",
    ),
    Row(
        "replicas_1",
        "FullSync dense -> Replicas(1 server, tmpfs)",
        "weightsync",
        "replicas_1",
        "dense",
        "Replicas([server A]): the fan-out machinery with one replica",
    ),
    Row(
        "replicas_2",
        "FullSync dense -> Replicas(2 servers, tmpfs)",
        "weightsync",
        "replicas_2",
        "dense",
        "Replicas([server A, server B]): each bucket produced once, written to both",
    ),
]
ROW_KEYS = [r.key for r in ROWS]
NATIVE_ROW = "vllm_reload"
FLOOR_ROW = "memcpy"
FLOOR_ROWS = ("memcpy", "memcpy_untied")
SERVER_ROWS = (
    "server_tmpfs",
    "server_tmpfs_untagged",
    "server_tmpfs_fresh",
    "server_gloo",
    "server_gloo_untagged",
    "server_wt_files",
    "replicas_1",
    "replicas_2",
)
# Each row's time is also given over the vLLM-native row of its own model.
NATIVE_OF = {"main": NATIVE_ROW, "untied": "vllm_reload_untied"}


def adapter_of(key: str) -> str:
    """The trainer's adapter a row with LoRA syncs: ``adapter_r<rank>[_...]`` its rank's, any
    other r16."""
    if key.startswith("adapter_r"):
        return "r" + key.removeprefix("adapter_r").split("_")[0]
    return "r16"
