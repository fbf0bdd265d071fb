"""The weights a vLLM engine loads, read the way vLLM's own loader reads them.

The contract a sync is checked against is what the engine actually loads, so the files are
chosen by vLLM's loader (its allow patterns, the safetensors index that excludes a duplicate
consolidated file), not by a glob; a model given as a hub id is read from the local snapshot vLLM
downloaded. Only headers are read to learn names and shapes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def local_folder(model: str, revision: str | None = None) -> str:
    """The local folder of ``model``: itself when it is a folder, else the hub snapshot vLLM
    downloaded (no network: an id that was never downloaded is an error)."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception as err:
        raise ValueError(
            f"the engine's model {model!r} is neither a folder nor a downloaded hub snapshot "
            f"({err}); pass checkpoint=<folder of the model's safetensors> to the engine adapter"
        ) from err


def weight_files(folder: str, load_config: Any) -> list[str]:
    """The safetensors files vLLM's default loader reads from ``folder``."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    _, files, use_safetensors, _ = DefaultModelLoader(load_config)._prepare_weights(
        folder, None, None, True, None
    )
    if not use_safetensors:
        raise ValueError(
            f"{folder!r} holds no safetensors weights ({[os.path.basename(f) for f in files][:3]}); "
            "weightsync reads the checkpoint's safetensors headers to know what the engine "
            "loads. Convert the checkpoint with save_pretrained(safe_serialization=True)."
        )
    return sorted(files)


def shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in ``files`` (headers only)."""
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for key in h.keys():  # noqa: SIM118 -- a safetensors handle, not a dict
                out[key] = tuple(h.get_slice(key).get_shape())
    return out


def heads(files: list[str], names: list[str]) -> dict[str, torch.Tensor]:
    """The first row (first elements of a 1-D tensor) of each named tensor found in ``files``."""
    from safetensors import safe_open

    wanted, out = set(names), {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for key in wanted.intersection(h.keys()):
                out[key] = (
                    h.get_slice(key)[0]
                    if len(h.get_slice(key).get_shape()) > 1
                    else h.get_slice(key)[:]
                )
    return out


def read_with_twins(
    files: list[str], twins: Mapping[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files``, a tied tensor also under each of its twins' names."""
    from safetensors import safe_open

    for f in files:
        with safe_open(f, framework="pt") as h:
            for key in h.keys():  # noqa: SIM118 -- a safetensors handle, not a dict
                tensor = h.get_tensor(key)
                yield key, tensor
                for twin in twins.get(key, ()):
                    yield twin, tensor
