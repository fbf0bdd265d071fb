"""Which PEFT set-ups weightsync reproduces exactly, and what it refuses: an allowlist.

A PEFT option weightsync does not know could change what the trainer computes in a way the
engine would not reproduce, silently. So every ``LoraConfig`` option and every PEFT module type
is listed here with how it is handled, and a set-up is checked against the list before a plan is
made:

- an option at its default value is fine whatever it is;
- an option listed as ``inert`` does not change what a trained model computes (metadata, training
  only, or which modules were wrapped, which the walk reads from the modules themselves);
- ``exact`` options are reproduced exactly in both modes (merged into the weights by weightsync,
  or served by the engine);
- ``merge`` options are reproduced when weightsync merges, refused when the engine serves the
  adapter (the engine cannot apply them);
- ``init`` options only decide the adapter's initial values; the base-rewriting ones (PiSSA,
  OLoRA, CorDA, LoftQ, LoRA-GA) also rewrite the base weights, which is exact for every sync
  that sends the trainer's base but rules out reloading the engine's original checkpoint;
- anything else at a non-default value, including options this table has never heard of (a newer
  peft), is refused, naming the option and what to do instead.

``docs/peft-support.md`` is this table in prose, with the test behind each row;
``tests/test_peft_support.py`` keeps the two in step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from torch import nn

from ..errors import UnsupportedModelError

if TYPE_CHECKING:
    from peft import PeftModel  # untyped for mypy (peft is skipped): Any

Mode = Literal["merge", "serve"]
Handling = Literal["inert", "exact", "merge", "init", "refused"]

#: LoraConfig option, how weightsync handles it, and why. An option not in the table is refused
#: when set. ``inert``: does not change what the engine must hold; ``exact``: reproduced exactly in
#: both modes; ``merge``: reproduced when merged, refused when served; ``init``: initial values
#: only (a base-rewriting initialisation is checked apart); ``refused``: not reproduced.
_TABLE = """
# Bookkeeping: what the config says about itself.
task_type               inert    metadata
peft_type               inert    checked apart: only LORA adapters are synced
auto_mapping            inert    metadata
peft_version            inert    metadata
base_model_name_or_path inert    metadata
revision                inert    metadata
inference_mode          inert    freezes the adapter; does not change its output
runtime_config          inert    placement of tensors during training
lora_dropout            inert    dropout is off when the trainer generates (eval mode)
# Which modules are wrapped: the walk reads the wrapped modules themselves.
target_modules          inert    the wrapped modules are read from the model
exclude_modules         inert    the wrapped modules are read from the model
layers_to_transform     inert    the wrapped modules are read from the model
layers_pattern          inert    the wrapped modules are read from the model
# The LoRA math.
r                       exact    rank; the engine must allow it (max_lora_rank)
lora_alpha              exact    part of the scale, read from each layer
use_rslora              exact    part of the scale, read from each layer
rank_pattern            exact    per-module rank, read from each layer
alpha_pattern           exact    per-module alpha, read from each layer
modules_to_save         exact    trained full copies, sent as base weights in both modes
fan_in_fan_out          merge    transposed (Conv1D) layouts are merged; serving them is untested
bias                    merge    trained base biases are full weights: sent by a full sync, not by an adapter
lora_bias               merge    a bias on lora_B is merged into the base bias; vLLM cannot serve it
# Initialisation only.
init_lora_weights       init     initial values; PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA/Astra rewrite the base
loftq_config            init     LoftQ initialisation settings
eva_config              init     EVA initialisation settings
corda_config            init     CorDA initialisation settings
lora_ga_config          init     LoRA-GA initialisation settings
# Everything below changes the forward pass in ways weightsync does not reproduce.
use_dora                refused  DoRA rescales each weight by a learned magnitude; not merged, not served by vLLM
layer_replication       refused  replicated layers change the architecture the engine runs
trainable_token_indices refused  trainable token rows are a separate PEFT layer type
target_parameters       merge    LoRA on raw parameters (MoE experts) is merged per expert; no engine serves it
megatron_config         refused  Megatron-parallel LoRA layers are not walked
use_qalora              refused  quantization-aware LoRA needs the quantized base
alora_invocation_tokens refused  activated LoRA depends on the prompt, not only the weights
velora_config           refused  VeLoRA changes the layer
monteclora_config       refused  MonteCLoRA samples its adapter
arrow_config            refused  Arrow routes between adapters per token
kasa_config             refused  KaSA changes the layer
use_bdlora              refused  block-diagonal LoRA is a different layer
ensure_weight_tying     refused  tied trainable copies are untested
astra_config            refused  Astra (peft 0.22) rewrites the base to a residual from its activations: untested
# Only read when their option above is set.
megatron_core           inert    only read with megatron_config
qalora_group_size       inert    only read with use_qalora
"""

#: LoraConfig option -> (handling, why), from `_TABLE`.
OPTIONS: dict[str, tuple[Handling, str]] = {
    name: (cast("Handling", handling), why)
    for name, handling, why in (
        line.split(None, 2) for line in _TABLE.splitlines() if line and not line.startswith("#")
    )
}

#: init_lora_weights values that overwrite the base weights when the adapter is created.
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "astra")


def _default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def rewrites_base(config: object) -> bool:
    """Whether the adapter's initialisation overwrote the base weights it wraps."""
    init = getattr(config, "init_lora_weights", True)
    return isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS)


def config_problems(config: object, mode: Mode) -> list[str]:
    """Every option of one ``LoraConfig`` that ``mode`` cannot reproduce, each saying why."""
    problems = []
    if str(getattr(getattr(config, "peft_type", None), "value", "")) != "LORA":
        return [f"peft_type={getattr(config, 'peft_type', None)}: only LoRA adapters are synced"]
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        if _same(value, _default(field)):
            continue
        handling, why = OPTIONS.get(field.name, ("refused", "an option weightsync does not know"))
        if handling == "refused" or (handling == "merge" and mode == "serve"):
            advice = (
                "merge the adapter (an engine without LoRA)"
                if handling == "merge"
                else "train without it"
            )
            problems.append(f"{field.name}={value!r}: {why}; {advice}")
    return problems


def _empty(value: object) -> bool:
    return value is None or (
        isinstance(value, (str, list, tuple, set, frozenset, dict)) and not value
    )


def _same(value: object, default: object) -> bool:
    """``value`` is the option's default (``None`` and any empty container count as one: peft
    turns some ``None`` defaults into an empty set)."""
    if _empty(value) and _empty(default):
        return True
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 -- a value that does not compare (a tensor) counts as set
        return False


# --- module types -------------------------------------------------------------------------------


def _module_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(LoRA layer types walked exactly, PEFT wrapper types walked exactly)."""
    from peft.tuners.lora import layer as lora
    from peft.utils import ModulesToSaveWrapper

    return (lora.Linear, lora.Embedding, lora.ParamWrapper), (ModulesToSaveWrapper,)


def modules_of_type(
    root: nn.Module, kind: type | tuple[type, ...], *, inside: bool = False
) -> Iterator[tuple[str, Any]]:
    """``(name, module)`` for each module of type ``kind`` below ``root``, in
    ``named_modules()`` order and under its first name; ``inside``: also below a match (else a
    match's children are skipped).

    A PEFT tuner layer's own adapter containers -- the children it names in
    ``adapter_layer_names`` and ``other_param_names`` (``lora_A``, ``lora_B``, ``lora_dropout``,
    ...: one small module per adapter) -- are not walked: PEFT declares them as holding that
    layer's adapters, never a tuner layer or a wrapper of the model's own; what the layer wraps
    (``base_layer``, where a nested tuner layer sits) is walked. They are five in six modules of a
    LoRA model. An explicit stack instead of ``named_modules()``, whose recursive generators pass
    every module up through each level. Both because the walks of an adapter sync (the
    allowlist check, the ``modules_to_save`` copies) run every step, and the whole sync's budget
    is small (docs/benchmarks.md)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", root)]
    # type -> (a match, a tuner layer): a model holds a few dozen module types, and
    # ``isinstance`` of an abstract base class (BaseTunerLayer) costs an ABC check each time.
    types: dict[type, tuple[bool, bool]] = {}
    while stack:
        prefix, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        cls = type(module)
        found = types.get(cls)
        if found is None:
            found = types[cls] = (issubclass(cls, kind), issubclass(cls, BaseTunerLayer))
        match, tuner = found
        if match:
            yield prefix, module
            if not inside:
                continue
        children = module._modules
        if not children:
            continue
        own: tuple[str, ...] = ()
        if tuner:
            layer: BaseTunerLayer = module
            own = (*layer.adapter_layer_names, *layer.other_param_names)
        stack.extend(
            (f"{prefix}.{name}" if prefix else name, child)
            for name, child in reversed(children.items())
            if child is not None and name not in own
        )


def module_problems(model: nn.Module, mode: Mode) -> list[str]:
    """PEFT modules in ``model`` whose type or state weightsync cannot reproduce, one line per
    kind of problem with the modules it concerns."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    layers, wrappers = _module_types()
    found: dict[str, list[str]] = {}
    walk = modules_of_type(model, (BaseTunerLayer, AuxiliaryTrainingWrapper), inside=True)
    for name, module in walk:
        if isinstance(module, BaseTunerLayer):
            if type(module) not in layers or (
                mode == "serve" and type(module).__name__ == "ParamWrapper"
            ):
                kind = f"{type(module).__module__}.{type(module).__name__}"
                found.setdefault(f"PEFT layer type {kind} is not synced", []).append(name)
                continue
            variants = {
                type(v).__name__
                for a, v in module.lora_variant.items()
                if a in module.active_adapters
            }
            if variants:
                found.setdefault(f"LoRA variant {sorted(variants)} is not synced", []).append(name)
            bias_adapters = [a for a in module.active_adapters if module.lora_bias.get(a)]
            if bias_adapters and getattr(module.get_base_layer(), "bias", None) is None:
                found.setdefault(
                    "lora_bias=True on a layer without a bias: the checkpoint has no bias to merge "
                    "it into, so no engine can hold it",
                    [],
                ).append(name)
            if module.merged and mode == "serve":
                found.setdefault(
                    "the adapter is merged into the base in place (merge_adapter()); an engine "
                    "serving the adapter would apply it twice. Call unmerge_adapter() before syncing",
                    [],
                ).append(name)
            if module.merged and module.disable_adapters:
                found.setdefault(
                    "adapters disabled while merged; call unmerge_adapter() first", []
                ).append(name)
        elif isinstance(module, AuxiliaryTrainingWrapper) and type(module) not in wrappers:
            found.setdefault(f"PEFT wrapper {type(module).__name__} is not synced", []).append(name)
    return [f"{problem} ({_few(names)})" for problem, names in found.items()]


def _few(names: list[str], limit: int = 3) -> str:
    more = f", ... {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


@dataclass(frozen=True)
class Setup:
    """What the trainer's PEFT model runs, once checked against the allowlist.

    Attributes:
        adapters: names of the active adapters (their sum is what the trainer computes).
        rewrites_base: an active adapter's initialisation overwrote base weights.
        notes: translations a reader of the plan should see.
    """

    adapters: tuple[str, ...]
    rewrites_base: bool
    notes: tuple[str, ...] = ()


def check(model: PeftModel, mode: Mode) -> Setup:
    """Check a ``peft.PeftModel`` against the allowlist for ``mode``; raise on anything else.

    Args:
        mode: ``"merge"`` (weightsync merges LoRA into the weights) or ``"serve"`` (the engine
            serves the adapter).

    Raises:
        UnsupportedModelError: naming every option and module that cannot be reproduced.
    """
    adapters = tuple(_active_adapters(model))
    problems = []
    for name in adapters:
        problems += [
            f"adapter {name!r}: {p}" for p in config_problems(model.peft_config[name], mode)
        ]
    if mode == "serve" and len(adapters) != 1:
        problems.append(
            f"{len(adapters)} active adapters {list(adapters)}: an engine serves one adapter per "
            "request. Merge them (an engine without LoRA), or combine them into one with "
            "add_weighted_adapter and activate that"
        )
    problems += module_problems(model, mode)
    if problems:
        raise UnsupportedModelError(
            f"the trainer's PEFT set-up cannot be synced exactly ({'served adapter' if mode == 'serve' else 'merged'}), "
            "nothing was written:\n  - " + "\n  - ".join(problems)
        )
    notes = []
    rewritten = [a for a in adapters if rewrites_base(model.peft_config[a])]
    if rewritten:
        notes.append(
            f"adapter(s) {rewritten} initialised with "
            f"{sorted({str(model.peft_config[a].init_lora_weights) for a in rewritten})}, which "
            "rewrote the base: the trainer's base is sent, the original checkpoint cannot be reloaded"
        )
    if len(adapters) > 1:
        notes.append(f"{len(adapters)} active adapters {list(adapters)} merged together")
    return Setup(adapters=adapters, rewrites_base=bool(rewritten), notes=tuple(notes))


def _active_adapters(model: PeftModel) -> list[str]:
    active = (
        model.base_model.active_adapters if hasattr(model, "base_model") else model.active_adapters
    )
    return [active] if isinstance(active, str) else list(active)


def served_config(config: object) -> dict:
    """The ``adapter_config.json`` an engine serving the adapter needs.

    Initialisation does not matter once the adapter is trained, and vLLM refuses base-rewriting
    init values; the trainer's rewritten base is what the engine holds (it is sent), so the
    served config says ``init_lora_weights=True``. ``modules_to_save`` copies travel as base
    weights, so the engine must not see them in the adapter.
    """
    out = config.to_dict()  # type: ignore[attr-defined]
    out["init_lora_weights"] = True
    out["modules_to_save"] = None
    for key, value in out.items():
        if isinstance(value, set):
            out[key] = sorted(value)
    return out


#: The test that proves each row of the table in ``docs/peft-support.md``.
TESTED_BY: dict[str, str] = {
    "inert": "every LoRA test",
    "r": "tests/test_core_vllm.py, tests/test_errors_vllm.py (rank above max_lora_rank)",
    "lora_alpha": "tests/test_core_vllm.py",
    "use_rslora": "tests/test_exact_or_refused_vllm.py::test_scale_options_served_exactly",
    "rank_pattern": "tests/test_exact_or_refused_vllm.py::test_scale_options_served_exactly",
    "alpha_pattern": "tests/test_exact_or_refused_vllm.py::test_scale_options_served_exactly",
    "modules_to_save": "tests/test_reliability.py::test_untied_head_as_modules_to_save_reaches_a_lora_engine",
    "fan_in_fan_out": "tests/test_tensors.py::test_gpt2_conv1d_fan_in_fan_out (merge, trainer side)",
    "bias": "tests/test_tensors.py::test_merged_equals_peft_merge_and_trainer_untouched[bias=all+alpha_pattern]",
    "lora_bias": "tests/test_tensors.py (lora_bias, merged); tests/test_exact_or_refused_vllm.py::test_lora_bias_on_layers_without_a_bias_is_refused",
    "init_lora_weights": "tests/test_exact_or_refused_vllm.py::test_base_rewriting_init_through_all_three_lora_paths (pissa, olora)",
    "use_dora": "tests/test_exact_or_refused_vllm.py::test_dora_refused_with_zero_writes",
    "target_parameters": "tests/test_moe_vllm.py (LoRA on the experts, merged)",
    "(unknown option)": "tests/test_exact_or_refused_vllm.py::test_an_option_weightsync_does_not_know_is_refused",
}

_SAYS = {
    "inert": "synced exactly (does not change the trained model's output)",
    "exact": "synced exactly, merged or served",
    "merge": "synced exactly when merged; refused when served",
    "init": "synced exactly (the trainer's base and adapter are sent as they are)",
    "refused": "refused",
}


def options_table() -> str:
    """The markdown table of ``docs/peft-support.md``: one row per LoraConfig option."""
    rows = ["| option | weightsync | why | tested by |", "|---|---|---|---|"]
    for name, (handling, why) in OPTIONS.items():
        test = TESTED_BY.get(name) or TESTED_BY.get(handling if handling == "inert" else "", "")
        rows.append(
            f"| `{name}` | {_SAYS[handling]} | {why} | {test or 'refused when set: not run'} |"
        )
    rows.append(
        "| any other option | refused when set | an option weightsync does not know | "
        f"{TESTED_BY['(unknown option)']} |"
    )
    return "\n".join(rows)
