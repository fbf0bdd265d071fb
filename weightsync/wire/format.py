"""A bucket of named tensors as safetensors bytes: the one writer and the one reader.

Every byte weightsync moves to an engine is in this format, whatever carries it (a file in a RAM
folder, a gloo broadcast, a snapshot folder, an adapter folder): a safetensors file's bytes, so
any safetensors reader (vLLM's loaders included) reads what weightsync writes.

One rule for tied names: safetensors refuses two names on one storage, so a tensor sent under
several names (tied embeddings) is stored once, under its first name, and the file's metadata
lists the other names under ``ALIASES_KEY`` (`read` and `views` yield it under each). A reader
that does not know the key (vLLM's own ``reload_weights``) needs ``aliases=False``: a copy under
every name.

The header is built here, not by ``safetensors.torch.save_file``, so that a writer can place the
bytes where it wants them (a kept mapped file, a broadcast buffer) without an extra copy: widest
elements first, as safetensors lays them out, so every tensor's offset is a multiple of its
element size and a reader can view the bytes in place.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .scratch import owner_only

#: A bucket: (checkpoint name, tensor) pairs travelling together.
Pairs = Iterable[tuple[str, torch.Tensor]]

#: safetensors metadata key under which a file lists the names a tensor is also sent under.
ALIASES_KEY = "weightsync.aliases"

#: safetensors dtype names of the dtypes weightsync writes and reads itself.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

#: Where each tensor's bytes go in a file's data section: (tensor, offset, byte count).
Places = list[tuple[torch.Tensor, int, int]]


def unique(bucket: Pairs, *, aliases: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """One tensor per storage, and the other names each is sent under.

    Names share a storage when their tensors have the same data pointer, shape and dtype (a
    tied tensor produced without a copy). ``aliases=False``: a clone under every name instead
    (for readers that do not know `ALIASES_KEY`)."""
    out: dict[str, torch.Tensor] = {}
    others: dict[str, list[str]] = {}
    first: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}
    for name, tensor in bucket:
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key not in first:
            first[key] = name
            out[name] = tensor
        elif aliases:
            others.setdefault(first[key], []).append(name)
        else:
            out[name] = tensor.clone()
    return out, others


def layout(bucket: Pairs, *, aliases: bool = True) -> tuple[bytes, Places]:
    """The safetensors header of ``bucket`` (length prefix included) and where each tensor's
    bytes go after it.

    Raises:
        TypeError: a dtype this format does not write (named), before anything is written.
    """
    tensors, others = unique(bucket, aliases=aliases)
    entries: dict[str, Any] = {"__metadata__": {ALIASES_KEY: json.dumps(others)}}
    places: Places = []
    offset = 0
    for name, tensor in sorted(tensors.items(), key=lambda kv: -kv[1].element_size()):
        if tensor.dtype not in _NAMES:
            raise TypeError(f"{name}: dtype {tensor.dtype} cannot be written to a bucket file")
        n = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + n],
        }
        places.append((tensor, offset, n))
        offset += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text, places


def size(header: bytes, places: Places) -> int:
    """Bytes of the whole file: header and data."""
    return len(header) + sum(n for _, _, n in places)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor: a view of a contiguous CPU tensor."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).cpu()


def copy_into(data: np.ndarray, places: Places) -> None:
    """Copy each tensor's bytes to its offset in ``data`` (a file's data section).

    A single-threaded copy that releases the GIL (numpy's), not torch's multithreaded one: a
    vLLM worker on the same cores busy-polls its message queue for a while after each RPC, and
    a multithreaded copy then waits on the thread sharing its core (docs/benchmarks.md);
    replicas copy from parallel threads, so it must not hold the GIL either."""
    for tensor, offset, n in places:
        data[offset : offset + n] = _raw(tensor).numpy()


def pack(bucket: Pairs) -> torch.Tensor:
    """``bucket`` as one byte tensor holding a safetensors file (for a broadcast)."""
    header, places = layout(bucket)
    payload = torch.empty(size(header, places), dtype=torch.uint8)
    data = payload.numpy()
    data[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    copy_into(data[len(header) :], places)
    return payload


def pieces(bucket: Pairs) -> list[np.ndarray]:
    """``bucket`` as the pieces of a safetensors file, nothing copied: its header, then each
    stored tensor's own bytes (a uint8 view; a tensor that is not a contiguous CPU tensor is
    made one first), in file order. Their concatenation is `pack`'s bytes; for a carrier that
    copies the pieces itself (Ray's put writes each straight into its store), so that its copy
    is the only one. `pieces_views` reads them back.

    Raises:
        TypeError: as `layout`.
    """
    header, places = layout(bucket)
    return [np.frombuffer(header, dtype=np.uint8)] + [_raw(t).numpy() for t, _, _ in places]


def write(bucket: Pairs, path: str | Path, *, aliases: bool = True) -> None:
    """Write ``bucket`` to a new safetensors file at ``path``."""
    header, places = layout(bucket, aliases=aliases)
    with open(path, "wb", opener=owner_only) as f:
        f.write(header)
        for tensor, _, _ in places:
            f.write(_raw(tensor).numpy().data)


def _header(buffer: Any) -> tuple[int, dict[str, Any], dict[str, list[str]]]:
    """A safetensors file's header length, its tensors' entries (in file order) and aliases."""
    length = int.from_bytes(bytes(buffer[:8]), "little")
    header = json.loads(bytes(buffer[8 : 8 + length]))
    others = json.loads(header.pop("__metadata__", {}).get(ALIASES_KEY, "{}"))
    return length, header, others


def _viewed(
    entries: Iterable[tuple[str, dict[str, Any], torch.Tensor]], others: dict[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, entry, raw in entries:
        tensor = raw.view(DTYPES[entry["dtype"]]).view(entry["shape"])
        yield name, tensor
        for other in others.get(name, []):
            yield other, tensor


def views(buffer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file held in ``buffer`` (writable: a mapping, a received
    payload), as views into it (no copy), each also under its aliases."""
    length, header, others = _header(buffer)
    data = torch.frombuffer(buffer, dtype=torch.uint8)[8 + length :]
    slices = ((n, e, data[e["data_offsets"][0] : e["data_offsets"][1]]) for n, e in header.items())
    return _viewed(slices, others)


def pieces_views(parts: Sequence[np.ndarray]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the safetensors file that ``parts`` make (`pieces`), each a view into its
    own piece (no copy), each also under its aliases; one piece is a whole file (`views`).

    Raises:
        ValueError: the pieces do not split the file where `pieces` does (the header alone,
            then one piece per tensor, in file order), before any tensor is yielded: read
            otherwise, the same bytes could be other tensors than the file's.
    """
    if len(parts) == 1:
        return views(parts[0])
    length, header, others = _header(parts[0])
    if parts[0].nbytes != 8 + length or len(parts) != len(header) + 1:
        raise ValueError(
            f"{len(parts)} pieces (a header of {parts[0].nbytes} bytes) for a file of "
            f"{len(header)} tensors and a header of {8 + length} bytes"
        )
    end = 0
    for (name, entry), part in zip(header.items(), parts[1:], strict=True):
        start, stop = entry["data_offsets"]
        if start != end or part.nbytes != stop - start:
            raise ValueError(
                f"{name}: its piece holds {part.nbytes} bytes at offset {end}, the header "
                f"places it at [{start}, {stop})"
            )
        end = stop
    return _viewed(
        ((n, e, _bytes(p)) for (n, e), p in zip(header.items(), parts[1:], strict=True)), others
    )


def _bytes(part: np.ndarray) -> torch.Tensor:
    """``part`` as a uint8 tensor sharing its memory (torch cannot view an empty buffer)."""
    return (
        torch.frombuffer(part, dtype=torch.uint8)
        if part.nbytes
        else torch.empty(0, dtype=torch.uint8)
    )


def read(
    files: Iterable[str | Path], twins: Mapping[str, list[str]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files``, in file order, each also under its aliases (files this module
    wrote) and under ``twins[name]`` (a checkpoint that stores a tied tensor once)."""
    from safetensors import safe_open

    twins = twins or {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            others = json.loads((h.metadata() or {}).get(ALIASES_KEY, "{}"))
            for key in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                tensor = h.get_tensor(key)
                yield key, tensor
                for other in [*others.get(key, []), *twins.get(key, [])]:
                    yield other, tensor


def shapes(files: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in ``files`` (headers only)."""
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for key in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                out[key] = tuple(h.get_slice(key).get_shape())
    return out


def heads(files: Iterable[str], names: list[str]) -> dict[str, torch.Tensor]:
    """The first row (the first elements of a 1-D tensor) of each named tensor in ``files``."""
    from safetensors import safe_open

    wanted, out = set(names), {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for key in wanted.intersection(h.keys()):
                piece = h.get_slice(key)
                out[key] = piece[0] if len(piece.get_shape()) > 1 else piece[:]
    return out


def write_adapter(folder: Path, tensors: Pairs, config: Mapping[str, Any]) -> None:
    """A LoRA adapter folder as PEFT saves it (``adapter_model.safetensors`` and
    ``adapter_config.json``) at ``folder``, replacing one there: written beside it, then renamed,
    so a reader never sees half an adapter."""
    staging = folder.with_name(folder.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(mode=0o700, parents=True)
    write(tensors, staging / "adapter_model.safetensors", aliases=False)  # PEFT knows no aliases
    with open(staging / "adapter_config.json", "w", opener=owner_only) as f:
        f.write(json.dumps(config, default=str))
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
