"""The adapter's base, proven: an adapter is sent alone only onto the exact base it was trained
against.

An engine serving LoRA adds the adapter to whatever base it holds. After a merged sync (the
adapter already inside the weights), a base written by someone else, another trainer's base,
or a base rewritten on the trainer's side since it was sent, an adapter-only sync serves wrong
tokens without a word (the adapter counted twice, or applied to the wrong base). So `AdapterSync`
requires proof, and `weightsync.Syncer` plans a base restore when there is none:

- **the engine's side** (`Engine.held_base`): the base the engine holds, recorded by *content*
  when weightsync wrote it -- per checkpoint name, the key of the unmerged trainer tensor sent
  (`base_key`; a merged or trainable weight has none) -- and still there: the engine attests no
  harm to its base since that write (no level-2 sleep, no write by anyone, no restart; a level-1
  sleep keeps it). When weightsync has written nothing into the engine, the base is the
  engine's own checkpoint, if the engine attests no weight write since weightsync first watched
  it (a write made before that is not seen; see docs/failure-modes.md).
- **the trainer's side**: the trainer's frozen base now, by the same keys, equals the record
  (every name the adapter sync does not send itself). Against the engine's checkpoint, the
  check `ReloadWeights` makes: no base-rewriting initialisation, no trainable base parameter,
  and the first rows of up to 32 base tensors equal to the checkpoint's (a sample); once it
  passes, the trainer's keys become the record.

What a key costs, and what it sees: the key of a plain CPU tensor is the xxh3-128 digest of
its bytes, computed once and kept (`digest_of`) while the tensor's *fingerprint* is unchanged:
its storage address, version counter, dtype, shape and strides, and the digest of a strided
sample of `SAMPLED_ELEMENTS` of its elements. The version counter sees every in-place write
made through the tensor itself (an optimizer, ``copy_`` under ``no_grad``, ``load_state_dict``)
and the address sees a replaced tensor (``p.data = ...``); writes through ``.data``
(``p.data.add_``, PEFT's in-place ``merge_adapter`` / ``unmerge_adapter``) bump no counter,
and are seen by the sample when they change any sampled element -- a whole-tensor update does,
with near certainty; a write to a few unsampled elements alone does not. Rehashing the whole
base at every adapter sync would cost several times the sync itself (docs/failure-modes.md,
row 42); a `FullSync` with ``skip_unchanged`` rehashes every frozen tensor it may skip, every
sync, and refreshes what is kept. Where each base tensor lives is found once per model
(`unmerged_base`), not by walking the model at every sync; and the keys one proof found are
kept with what shows a write to any of those tensors since (`_Proven`: the same checks, made
for the whole base at once: identities, addresses, version counters, and the sampled
elements read through kept views in one gather), so an unwritten base costs no key at all.
A tensor on a GPU, or sharded, is
keyed by identity and version counter alone (hashing it would need a device copy or a
gather): there a ``.data`` write is not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ..engines.base import CHECKPOINT, Attestation, Engine
from ..errors import NoCheckpointError, UnsupportedModelError
from ..plan import Weight, digest
from ..trainer import peft_support
from ..trainer.tensors import base_tensors, trained_copies, uncompiled

#: Elements of a tensor whose digest is part of its fingerprint (spread evenly over it).
SAMPLED_ELEMENTS = 64

#: How many base tensors the checkpoint comparison samples (first row of each, spread evenly).
SAMPLED_TENSORS = 32

# id(tensor) -> (weak reference, fingerprint, digest): the digests `digest_of` keeps.
_DIGESTS: dict[int, tuple[weakref.ref, tuple, tuple]] = {}


def _fingerprint(x: torch.Tensor) -> tuple:
    import xxhash

    size = x.element_size()
    elements = x.detach().reshape(-1).view(torch.uint8).numpy().reshape(-1, size)
    sample = elements[:: max(1, len(elements) // SAMPLED_ELEMENTS)]
    return (
        x.data_ptr(),
        x._version,
        x.dtype,
        x.shape,
        x.stride(),
        x.storage_offset(),
        xxhash.xxh3_64_intdigest(sample.tobytes()),
    )


def digest_of(x: torch.Tensor, *, fresh: bool = False) -> tuple:
    """`weightsync.plan.digest` of the plain CPU tensor ``x``, computed again only when its
    fingerprint changed since it was last computed (see the module docstring), or ``fresh``."""
    key = id(x)
    fingerprint = _fingerprint(x)
    kept = _DIGESTS.get(key)
    if not fresh and kept is not None and kept[0]() is x and kept[1] == fingerprint:
        return kept[2]
    value = digest(x)

    def drop(ref: weakref.ref, key: int = key) -> None:
        if _DIGESTS.get(key, (None,))[0] is ref:
            del _DIGESTS[key]

    _DIGESTS[key] = (weakref.ref(x, drop), fingerprint, value)
    return value


def base_key(t: Weight, *, fresh: bool = False) -> tuple | None:
    """What identifies the unmerged trainer tensor ``t`` as the base the engine would hold, or
    None when ``t`` is no frozen base tensor sent as it is (a merged weight, a computed one,
    a trainable one: the adapter's base cannot be proven from it)."""
    if t.merged or len(t.inputs) != 1 or not isinstance(t.inputs[0], torch.Tensor):
        return None
    return tensor_key(t.inputs[0], fresh=fresh)


def tensor_key(x: torch.Tensor, *, fresh: bool = False) -> tuple | None:
    """`base_key` of a tensor sent as it is: its content digest (`digest_of`) for a plain CPU
    tensor, its identity and version counter for a device or sharded one, None if trainable."""
    if x.requires_grad:
        return None
    if x.device.type == "cpu" and not hasattr(x, "full_tensor"):
        return ("content", digest_of(x, fresh=fresh))
    return ("identity", id(x), x.data_ptr(), x._version, str(x.dtype), tuple(x.shape))


def base_keys(tensors: Iterable[Weight], *, fresh: bool = False) -> dict[str, tuple]:
    """name -> `base_key` of every tensor that has one."""
    keys = {t.name: base_key(t, fresh=fresh) for t in tensors}
    return {name: key for name, key in keys.items() if key is not None}


def adapter_base(
    model: nn.Module, engine: Engine, sent: Iterable[str], now: Attestation | None = None
) -> tuple[dict[str, tuple] | None, str]:
    """The proof that ``engine`` holds the trainer's frozen base, for an adapter sync that also
    sends the weights named ``sent`` (its ``modules_to_save`` copies): ``(keys, "")`` with the
    record the engine holds once the sync completed, or ``(None, why not)``. ``now``: what the
    engine attested as the plan began (`Engine.held_base`)."""
    held, source, why = engine.held_base(now)
    if held is None:
        return None, why
    base = unmerged_base(model, engine, set(sent))
    if held == CHECKPOINT:
        try:
            why_not = checkpoint_differs(model, engine)
        except NoCheckpointError as err:  # a dummy engine: random weights, nothing to compare
            why_not = str(err)
        if why_not:
            return None, (
                "weightsync has written no base into the engine, and its own checkpoint is "
                f"not the trainer's base: {why_not}"
            )
    found = _kept_keys(model, base, held)
    unkeyed = [name for name, key in found.items() if key is None]
    if unkeyed:
        return None, f"the trainer's base is not frozen at {_few(unkeyed)}"
    keys = {name: key for name, key in found.items() if key is not None}
    if held == CHECKPOINT:
        return keys, ""
    assert isinstance(held, Mapping)
    differ = [name for name, key in keys.items() if held.get(name) != key]
    if differ:
        merged = any(name not in held for name in differ)
        return None, (
            f"the engine's base was last written by {source}, and {len(differ)} of its "
            f"weights are not the trainer's frozen base now ({_few(differ)}): "
            + (
                "an adapter merged into them, or trained base weights"
                if merged
                else "the trainer's frozen base changed since it was sent"
            )
        )
    return keys, ""


class _Proven:
    """The keys of the base one proof found (`_kept_keys`), and what shows a write to it since:
    per tensor its identity, storage address, version counter, dtype, shape, strides and
    whether it is trainable, and the bytes of `SAMPLED_ELEMENTS` elements of each
    content-keyed tensor, read through views kept from that proof and gathered in one ``cat``
    per dtype (what each tensor's fingerprint samples apart, for a fraction of its cost; a
    strided tensor is fingerprinted apart). The views keep the storage they look at alive:
    storage the trainer swaps out (``p.data = ...``) is let go at the next proof, which finds
    its address moved."""

    def __init__(self, base: list[tuple[str, torch.Tensor | None]], keys: dict) -> None:
        self.base = base
        self.keys = keys
        self.state = _states(base)
        self.views: dict[torch.dtype, list[torch.Tensor]] = {}
        self.strided: list[torch.Tensor] = []
        for name, x in base:
            key = keys.get(name)
            if x is None or key is None or key[0] != "content" or not x.numel():
                continue
            if not x.is_contiguous():
                self.strided.append(x)
                continue
            flat = x.detach().reshape(-1)
            flat = flat.view(torch.uint8) if flat.element_size() == 1 else flat
            step = max(1, len(flat) // SAMPLED_ELEMENTS)
            self.views.setdefault(flat.dtype, []).append(flat[::step][:SAMPLED_ELEMENTS])
        self.sample = self._sample()

    def _sample(self) -> list:
        gathered = [
            torch.cat(views).view(torch.uint8).numpy().tobytes() for views in self.views.values()
        ]
        return gathered + [_fingerprint(x) for x in self.strided]

    def still(self, base: list[tuple[str, torch.Tensor | None]]) -> bool:
        """Whether ``base`` is the base these keys were found for, unwritten since."""
        return (
            len(base) == len(self.base)
            and all(
                name == kept and x is was
                for (name, x), (kept, was) in zip(base, self.base, strict=True)
            )
            and _states(base) == self.state
            and self._sample() == self.sample
        )


def _states(base: list[tuple[str, torch.Tensor | None]]) -> list[tuple | None]:
    return [
        None
        if x is None
        else (x.data_ptr(), x._version, x.requires_grad, x.dtype, x.shape, x.stride())
        for _, x in base
    ]


# model -> the keys of its base the last proof found, and what shows a write since (`_Proven`)
_PROVEN: weakref.WeakKeyDictionary[nn.Module, _Proven] = weakref.WeakKeyDictionary()


def _kept_keys(
    model: nn.Module, base: list[tuple[str, torch.Tensor | None]], held: Mapping | str
) -> dict[str, tuple | None]:
    """name -> `tensor_key` of each tensor of ``base`` (None: none sent as it is): as the
    last proof of ``model`` found them, while nothing shows a write to any since (`_Proven`)
    and they prove ``held`` (the engine's record, or its checkpoint); else found again
    (`digest_of` rehashes only a tensor whose own fingerprint moved). So what is kept only
    ever accepts a base again: a refusal is always decided on keys found anew."""
    kept = _PROVEN.get(model)
    if (
        kept is not None
        and kept.still(base)
        and (
            not isinstance(held, Mapping)  # the checkpoint: checked apart, each proof
            or all(key is not None and held.get(name) == key for name, key in kept.keys.items())
        )
    ):
        return kept.keys
    keys = {name: tensor_key(x) if x is not None else None for name, x in base}
    _PROVEN[model] = _Proven(base, keys)
    return keys


# model -> (what the paths were found for, [(checkpoint name, parameter path or "")]): the
# walk of the base (`base_tensors`) costs more than the rest of an adapter sync's proof, so
# where each base tensor lives is found once; the tensors are read where they are now.
_BASE_PATHS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, list[tuple[str, str]]]] = (
    weakref.WeakKeyDictionary()
)


def unmerged_base(
    model: nn.Module, engine: Engine, sent: set[str]
) -> list[tuple[str, torch.Tensor | None]]:
    """(checkpoint name, the trainer tensor the engine holds under it unmerged; None: none
    sent as it is) for every base weight of ``model`` but ``sent``, as
    ``base_tensors(model, merge_lora=False)`` finds them.

    Where each lives (a parameter or buffer path) is kept per model and engine contract; a path
    that no longer holds a tensor of its own (a layer PEFT wrapped since) finds them all again.
    """
    model = uncompiled(model)
    expected = engine.expected_weights
    signature = (id(expected), len(expected))
    kept = _BASE_PATHS.get(model)
    if kept is not None and kept[0] == signature:
        found = _resolved(model, kept[1], sent)
        if found is not None:
            return found
    paths = {
        id(p): name
        for named in (model.named_parameters, model.named_buffers)
        for name, p in named(remove_duplicate=False)
    }
    entries = []
    for t in base_tensors(model, merge_lora=False, expected=expected):
        x = t.inputs[0] if len(t.inputs) == 1 and not t.merged else None
        entries.append((t.name, paths.get(id(x), "") if isinstance(x, torch.Tensor) else ""))
    _BASE_PATHS[model] = (signature, entries)
    found = _resolved(model, entries, sent)
    assert found is not None  # just found
    return found


def _resolved(
    model: nn.Module, entries: list[tuple[str, str]], sent: set[str]
) -> list[tuple[str, torch.Tensor | None]] | None:
    modules: dict[str, nn.Module] = {"": model}

    def module(path: str) -> nn.Module | None:
        if path not in modules:
            parent, _, atom = path.rpartition(".")
            above = module(parent)
            child = above._modules.get(atom) if above is not None else None
            if child is None:
                return None
            modules[path] = child
        return modules[path]

    out: list[tuple[str, torch.Tensor | None]] = []
    for name, path in entries:
        if name in sent:
            continue
        if not path:
            out.append((name, None))
            continue
        owner, _, attr = path.rpartition(".")
        holder = module(owner)
        p: torch.Tensor | None = None
        if holder is not None:  # a parameter, or a persistent buffer the engine loads
            p = holder._parameters.get(attr)
            p = holder._buffers.get(attr) if p is None else p
        if p is None:
            return None
        out.append((name, p))
    return out


def checkpoint_differs(model: nn.Module, engine: Engine) -> str:
    """Why the trainer's base is not the checkpoint ``engine`` loaded ("" when it is, as far as
    can be checked): a PEFT initialisation that rewrote the base, a trainable base parameter,
    or sampled rows that differ from the checkpoint's (an engine that cannot read its
    checkpoint gives none: the check then rests on the rest). The trained ``modules_to_save``
    copies are not compared: every sync that rests on the checkpoint (an adapter alone, a
    checkpoint reload) sends them after it.

    Raises:
        NoCheckpointError: the engine was started without weight files (a dummy load).
    """
    from .base import in_engine_format

    setup = peft_support.check(model, "serve")
    why = []
    if setup.rewrites_base:
        why.append(setup.notes[0])
    trainable = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and ".lora_" not in n and ".modules_to_save." not in n
    ]
    if trainable:
        why.append(f"base parameters are trainable ({_few(trainable, 3)})")
    if not why:
        # quantized weights are computed (no `held` dtype): the sample skips them
        sent = {t.name for t in trained_copies(model)}
        base = [
            t
            for t in base_tensors(model, merge_lora=False, expected=engine.expected_weights)
            if t.name not in sent
        ]
        why += _sampled_differences(in_engine_format(base, engine), engine)
    return "; ".join(why)


def require_untouched_base(model: nn.Module, engine: Engine) -> None:
    """Refuse unless the trainer's base is still the checkpoint the engine would reload."""
    why = checkpoint_differs(model, engine)
    if why:
        raise UnsupportedModelError(
            "ReloadWeights from the engine's own checkpoint would restore a base the trainer no "
            f"longer has: {why}. Use FullSync (base + adapter) or ReloadWeights(snapshot_dir=...)."
        )


def _sampled_differences(tensors: list[Weight], engine: Engine) -> list[str]:
    """Compare the first row of up to `SAMPLED_TENSORS` base tensors with the checkpoint.

    Exact, in the less precise of the two dtypes (a bf16 trainer loaded from a float32
    checkpoint holds the checkpoint rounded once). Tensors the trainer holds in another dtype are
    skipped rather than copied; an engine that cannot read its checkpoint returns nothing.
    """
    # a sharded tensor is not gathered for a sample (only one rank plans with the engine)
    held = [
        t
        for t in tensors
        if t.held is not None and not any(hasattr(x, "full_tensor") for x in t.inputs)
    ]
    step = max(1, len(held) // SAMPLED_TENSORS)
    sample = held[::step][:SAMPLED_TENSORS]
    heads = engine.checkpoint_head([t.name for t in sample])
    differ = []
    for t in sample:
        if t.name not in heads:
            continue
        assert t.held is not None  # filtered above
        ours = t.produce(t.held)
        ours = ours[0] if ours.dim() > 1 else ours[: heads[t.name].numel()]
        theirs = heads[t.name]
        low = max((ours.dtype, theirs.dtype), key=lambda d: torch.finfo(d).eps)
        if not torch.equal(ours.to(low), theirs.to(low)):
            differ.append(t.name)
    return (
        [f"the trainer's base differs from the checkpoint at {', '.join(differ[:3])}"]
        if differ
        else []
    )


def _few(items: list[str], limit: int = 3) -> str:
    return ", ".join(items[:limit]) + (
        f", ... (+{len(items) - limit} more)" if len(items) > limit else ""
    )
