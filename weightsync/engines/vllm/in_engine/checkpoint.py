"""The weights a vLLM engine loads, read the way vLLM's own loader reads them.

The contract a sync is checked against is what the engine actually loads. Its names come from
the model the engine's config builds (transformers, on the meta device: no memory), in
checkpoint layout (`weightsync.wire.checkpoint_names.checkpoint_shapes`): a checkpoint entry
that is not a parameter or persistent buffer of that model is not a weight the engine loads
(vLLM's loaders skip ``rotary_emb.inv_freq`` buffers of older exports), and an engine that read
no files at all (``load_format="dummy"``: random weights, the first sync fills them) has a
contract all the same.
When the engine did load files, the names are also those the files hold, with their shapes: the
files are chosen by vLLM's loader (its allow patterns, the safetensors index that excludes a
duplicate consolidated file), not by a glob; a model given as a hub id is read from the local
snapshot vLLM downloaded. Only headers are read.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ....errors import UnsupportedModelError
from ....wire import format as fmt
from ....wire.checkpoint_names import checkpoint_shapes

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # untyped for mypy (transformers is skipped): Any


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


def loads_files(load_config: Any) -> bool:
    """Whether the engine's weights were read from its checkpoint's files: True for vLLM's
    default loader, False for its dummy loader (random weights); any other loader (tensorizer,
    sharded state, bitsandbytes, ...) is refused, naming the load format."""
    from vllm.model_executor.model_loader import (
        DefaultModelLoader,
        DummyModelLoader,
        get_model_loader,
    )

    loader = get_model_loader(load_config)
    if isinstance(loader, DummyModelLoader):
        return False
    if isinstance(loader, DefaultModelLoader):
        return True
    raise ValueError(
        f"the engine was started with load_format={load_config.load_format!r} "
        f"({type(loader).__name__}); weightsync knows what vLLM's default loader reads "
        "(safetensors checkpoints: load_format 'auto', 'safetensors', ...) and 'dummy' (random "
        "weights), not that loader. Start the engine with one of those."
    )


def weight_files(folder: str, load_config: Any) -> list[str]:
    """The safetensors files vLLM's default loader reads from ``folder``.

    An engine whose loader reads no files (``load_format="dummy"``) gets the files the default
    loader would read there -- what a reload of ``folder`` reads -- or ``[]`` when the folder
    holds no safetensors files (a config-only folder: nothing to reload)."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if not loads_files(load_config):
        if not glob.glob(os.path.join(glob.escape(folder), "*.safetensors")):
            return []
        load_config = LoadConfig(ignore_patterns=load_config.ignore_patterns)
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


def config_model(config: Any, trust_remote_code: bool, vllm_config: Any = None) -> PreTrainedModel:
    """The transformers causal LM ``config`` builds, on the meta device (no memory, no weights).

    ``config`` is copied first: building a model writes into its config (attention
    implementation, ...) and the caller's may be vLLM's own.

    ``vllm_config``: the engine's vLLM config, when this runs in the engine's process. vLLM's
    Transformers modeling backend (the architectures vLLM serves through transformers' own
    classes: GPT-NeoX, OLMo-2, Starcoder2, ... in vLLM 0.32) decorates transformers' decoder
    class *in place* for its compiler, process-wide, and the decorated ``__init__`` needs a
    current vLLM config ("Current vLLM config is not set" otherwise). The model is built with
    the engine's config made current, its compilation off (a copy with mode NONE), so the
    decoration only marks the meta model as not compiled: its names and shapes are
    transformers' own.

    Raises:
        UnsupportedModelError: transformers cannot build the model (any error on the way),
            naming the architecture.
    """
    from transformers import AutoModelForCausalLM

    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    try:
        with torch.device("meta"), _current(vllm_config):
            return AutoModelForCausalLM.from_config(
                copy.deepcopy(config), trust_remote_code=trust_remote_code
            )
    except Exception as err:
        raise UnsupportedModelError(
            f"weightsync cannot read what a {architecture} engine loads: transformers could not "
            f"build that model from the engine's config here ({type(err).__name__}: {err}). "
            "weightsync learns the names and shapes an engine loads from the transformers model "
            "its config builds, and streams a transformers model's weights; nothing was written."
        ) from err


@contextlib.contextmanager
def _current(vllm_config: Any) -> Iterator[None]:
    """``vllm_config`` made vLLM's current config, with its compilation off (see
    `config_model`); nothing when None."""
    if vllm_config is None:
        yield
        return
    from vllm.config import CompilationMode, set_current_vllm_config

    eager = copy.copy(vllm_config)
    eager.compilation_config = copy.copy(vllm_config.compilation_config)
    eager.compilation_config.mode = CompilationMode.NONE
    with set_current_vllm_config(eager):
        yield


def loaded_shapes(model: nn.Module, files: list[str] | None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight an engine of ``model`` (see `config_model`) loads.

    ``files``: the checkpoint files the engine read (`weight_files`), or None when it read none
    (``load_format="dummy"``). With files, the weights are the entries of the files that are
    also weights of ``model`` in checkpoint layout, with the files' shapes: an entry the model
    does not have (a non-persistent buffer such as ``rotary_emb.inv_freq``) is skipped by vLLM's
    loader too, and a tied name the files lack (``lm_head`` stored once) is added by the caller
    from the names the engine registers (``model_ops.fold_tied``). Without files, the weights
    are the model's checkpoint layout itself.
    """
    layout = checkpoint_shapes(model)
    if files is None:
        return layout
    return {name: shape for name, shape in fmt.shapes(files).items() if name in layout}
