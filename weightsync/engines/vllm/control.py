"""Control planes: the calls a weightsync engine makes into a vLLM engine besides moving bytes.

Pause and resume, prefix-cache reset, adapter load and unload by name, generation and prompt
logprobs (for verification), sleep and wake, and ``collective_rpc`` into the worker extension,
whose ledger `attestation` reads.
`HTTPControl` makes them on a ``vllm serve`` server, `LLMControl` on a multiprocess
``vllm.LLM``; `greedy_generate` and `score_prompts` are the generation calls both the in-process
and the multiprocess engine use, made on vLLM's ``LLMEngine``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from ... import errors
from ...errors import (
    AdapterError,
    AuthError,
    EngineBusyError,
    EngineFencedError,
    EngineUnavailableError,
    PauseExpiredError,
)
from ...wire.protocol import LoraLimits, Outcome, raise_failures
from ..base import Attestation
from .server_auth import BUSY_HEADER, COMMIT_PATH, FENCED_HEADER, FINISHED_HEADER, LEASE_HEADER
from .server_auth import HEADER as TOKEN_HEADER

logger = logging.getLogger(__name__)

#: What to pass as ``--worker-extension-cls`` / ``LLM(worker_extension_cls=...)``.
WORKER_EXTENSION = "weightsync.engines.vllm.worker.WeightsyncWorker"

#: What to pass as ``vllm serve --middleware`` for weightsync's token guard (``server_auth.py``).
TOKEN_MIDDLEWARE = "weightsync.engines.vllm.server_auth.RequireToken"

#: What to pass as ``vllm serve --middleware`` so that a pause nobody completes ends by itself
#: (``server_lease.py``).
LEASE_MIDDLEWARE = "weightsync.engines.vllm.server_lease.PauseLease"


def run_requests(
    engine: Any, prompts: list[list[int]], params: Any, lora_request: Any
) -> list[Any]:
    """Run ``prompts`` (token ids) to completion on a vLLM ``LLMEngine`` (or a ``vllm.LLM``'s)
    through its public ``add_request`` / ``step`` (what ``vllm.LLM.generate`` does inside);
    their ``RequestOutput`` in prompt order.

    Driving the ``LLMEngine`` rather than a ``vllm.LLM`` serves every engine a framework holds
    (ms-swift keeps an ``LLMEngine``, TRL an ``LLM``). ``step`` returns the outputs of every
    request in the engine, so a request someone else has in flight would lose its outputs to
    this call: that is refused. A failure aborts the requests added here, or the next ``step``
    of an in-process engine would spin on them forever.

    Raises:
        RuntimeError: the engine has requests of someone else in flight.
    """
    from vllm.inputs import TokensPrompt

    llm_engine = getattr(engine, "llm_engine", engine)
    if llm_engine.has_unfinished_requests():
        raise RuntimeError(
            "the vLLM engine has requests in flight (a rollout running in another thread?); "
            "weightsync generates on it only when it is idle, or their outputs would be lost"
        )
    tag = f"weightsync-{uuid.uuid4().hex[:8]}"
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    done: dict[str, Any] = {}
    try:
        for request_id, prompt in zip(ids, prompts, strict=True):
            llm_engine.add_request(
                request_id,
                TokensPrompt(prompt_token_ids=list(prompt)),
                params,
                lora_request=lora_request,
            )
        while len(done) < len(ids):
            done.update({out.request_id: out for out in llm_engine.step() if out.finished})
    except BaseException:
        llm_engine.abort_request([i for i in ids if i not in done])
        raise
    return [done[i] for i in ids]


def greedy_generate(
    engine: Any, prompts: list[list[int]], max_tokens: int, lora_request: Any
) -> list[tuple[list[int], list[float]]]:
    """Greedy-decode ``max_tokens`` for each prompt on a vLLM ``LLMEngine`` or ``LLM`` (in or
    out of process), in one batch; the tokens and their logprobs."""
    return [
        greedy_result(out)
        for out in run_requests(engine, prompts, greedy_params(max_tokens), lora_request)
    ]


def greedy_params(max_tokens: int) -> Any:
    """The ``SamplingParams`` of a verification run: greedy, ``max_tokens`` exactly, the
    chosen tokens' logprobs."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True
    )


def greedy_result(out: Any) -> tuple[list[int], list[float]]:
    """A finished ``RequestOutput`` of `greedy_params`: its tokens and their logprobs."""
    tokens = list(out.outputs[0].token_ids)
    logprobs = [
        step[tok].logprob for tok, step in zip(tokens, out.outputs[0].logprobs, strict=True)
    ]
    return tokens, logprobs


def score_prompts(
    engine: Any, prompts: list[list[int]], top_k: int, lora_request: Any
) -> list[list[dict[int, float]]]:
    """For each prompt, each position after the first: the logprobs a vLLM ``LLMEngine`` (or ``LLM``) gives
    the prompt's token and its ``top_k`` most likely tokens (``prompt_logprobs``)."""
    # With LoRA enabled, vLLM 0.32's CPU LoRA logits path indexes adapters per request, not per
    # prompt position: two prompts in one batch with prompt_logprobs fail ("einsum(): subscript b
    # has size 2 ... 63"). One prompt per call is exact.
    lora_enabled = getattr(engine, "llm_engine", engine).vllm_config.lora_config is not None
    groups = [[p] for p in prompts] if lora_enabled else [prompts]
    params = score_params(top_k)
    return [
        score_result(out)
        for group in groups
        for out in run_requests(engine, group, params, lora_request)
    ]


def score_params(top_k: int) -> Any:
    """The ``SamplingParams`` of a prompt-logprobs run (`score_prompts`)."""
    from vllm import SamplingParams

    # prompt_logprobs makes vLLM skip reading the prefix cache, so every position is computed
    # under the weights served now. One token is generated because vLLM must.
    return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top_k, detokenize=False)


def score_result(out: Any) -> list[dict[int, float]]:
    """A finished ``RequestOutput`` of `score_params`: token id -> logprob at each position
    after the first."""
    return [{tok: lp.logprob for tok, lp in pos.items()} for pos in out.prompt_logprobs[1:]]


def attestation(reports: list[dict[str, Any]]) -> Attestation:
    """The engine's attestation from its workers' ledger reports (one per rank, see
    ``in_engine/ledger.py``): its epoch is every rank's (boot, epoch), its harm the worst."""
    return Attestation(
        epoch=tuple((r["boot"], int(r["epoch"])) for r in reports),
        asleep=frozenset(tag for r in reports for tag in r["asleep"]),
        harm=max(int(r["harm"]) for r in reports),
        adapters=sum(int(r.get("adapters", 0)) for r in reports),
    )


def version_label(
    epoch: Hashable | None, adapter_ids: Iterable[int] = (), adapter_writes: int = 0
) -> str | None:
    """A compact string of an attested vLLM epoch (one ``(boot, epoch)`` per worker rank), the
    adapter ids the workers hold and the adapter writes they counted:
    ``"<boot[:12]>:<epoch>[,...][+lora<id>[.<id>...]][/a<writes>]"``; None without an epoch
    (an engine that cannot attest one). The writes make an adapter replaced under the id it
    had (in place, by anyone) a new version."""
    if epoch is None:
        return None
    label = ",".join(f"{boot[:12]}:{n}" for boot, n in cast("tuple", epoch))
    ids = sorted(set(adapter_ids))
    if ids:
        label += f"+lora{'.'.join(map(str, ids))}"
    return f"{label}/a{adapter_writes}" if adapter_writes else label


def base_label(version: str) -> str:
    """The base part of a `version_label` (its attested epoch, without the adapters): what
    vLLM's engine-wide weight-version label may say, since every request in a batch runs on
    the same base but each on its own adapter (see `weights_spans`)."""
    return version.split("+", 1)[0].split("/", 1)[0]


#: vLLM's weight-version label of tokens generated after a write that failed part-way (a mix
#: of old and new layers), until the next completed base write.
UNKNOWN_BASE = "unknown"


@dataclass(frozen=True)
class WeightsSpan:
    """The weights that produced output tokens ``start`` to ``end`` (exclusive) of a request.

    Attributes:
        base: the base weights' version, vLLM's label of those tokens (`base_label` of the
            engine's version after the write that put them there; ``"default"``: nothing
            labelled them, the engine's weights since it started; `UNKNOWN_BASE`: after a
            failed write).
        adapter: the version of the engine's adapter the request ran with (the key of
            ``adapter_requests`` / ``resident_adapters``; None: no adapter). vLLM keeps a
            request on the adapter it was admitted with to its end, so it is the same for
            every span of a request.
    """

    base: str
    adapter: int | None
    start: int
    end: int


_ADAPTER_VERSION = re.compile(r"(?:adapter-v|/v)(\d+)$")


def weights_spans(output: Any, index: int = 0) -> list[WeightsSpan] | None:
    """The weights that produced each token of a finished vLLM ``RequestOutput`` (its
    ``index``-th completion): vLLM's weight-version spans (the base) with the request's adapter
    version, read from its ``LoRARequest``'s path (every adapter version weightsync loads has a
    path of its own ending in it). None where vLLM recorded no spans (an unfinished output).

    Raises:
        ValueError: the request ran with an adapter weightsync did not load.
    """
    spans = output.outputs[index].weight_versions
    if spans is None:
        return None
    adapter = None
    if output.lora_request is not None:
        found = _ADAPTER_VERSION.search(output.lora_request.lora_path or "")
        if found is None:
            raise ValueError(
                f"request {output.request_id} ran with adapter "
                f"{output.lora_request.lora_name!r} at {output.lora_request.lora_path!r}, "
                "which weightsync did not load: its version is not weightsync's to name"
            )
        adapter = int(found.group(1))
    return [WeightsSpan(s.version, adapter, s.start, s.end) for s in spans]


def adapter_ids(answers: list[Any]) -> set[int]:
    """The adapter ids in the workers' answers to vLLM's ``list_loras`` (one per rank): a set
    in process, a list after msgpack, and a string (``"{3}"``, ``"set()"``) through a server's
    ``/collective_rpc``, which stringifies any answer that is not a dict or a list."""
    ids: set[int] = set()
    for answer in answers:
        if isinstance(answer, str):
            ids.update(int(n) for n in re.findall(r"\d+", answer))
        else:
            ids.update(int(n) for n in answer)
    return ids


def adapter_window(versions: int, lora: LoraLimits | None) -> int:
    """Check ``versions``, the number of adapter versions an engine keeps loaded (the newest
    and the ones before it that rollouts still in flight were admitted under), against the
    engine's LoRA limits; returns it.

    One version (the default) is replaced in place: no limit applies beyond today's. More
    need ``max_loras >= versions`` (requests of every kept version in one batch; with fewer
    slots vLLM queues them instead) and ``max_cpu_loras >= versions + 1``: the next version is
    loaded before the oldest is unloaded, so that a failed load leaves every kept version,
    and vLLM evicts an adapter silently when its cache is full (TRL's AsyncGRPO asks for the
    same ``max_staleness + 2``).

    Raises:
        ValueError: ``versions`` is below 1, or the engine cannot keep that many.
    """
    if versions < 1:
        raise ValueError(f"adapter_versions must be 1 or more, got {versions!r}")
    if versions == 1 or lora is None:  # an engine without LoRA refuses adapters at the sync
        return versions
    if lora.max_loras < versions or lora.max_cpu_loras < versions + 1:
        raise ValueError(
            f"adapter_versions={versions} keeps {versions} adapter versions loaded (and "
            f"{versions + 1} while the next one loads), but this engine has "
            f"max_loras={lora.max_loras}, max_cpu_loras={lora.max_cpu_loras}: create it with "
            f"max_loras={max(versions, lora.max_loras)} and "
            f"max_cpu_loras={versions + 1} or more (vllm serve: --max-loras, --max-cpu-loras), "
            "or keep fewer versions"
        )
    return versions


def since_arg(epoch: Hashable | None) -> list[list[Any]] | None:
    """An attested vLLM epoch as the workers' ``since`` argument (JSON: lists)."""
    return None if epoch is None else [list(rank) for rank in cast("tuple", epoch)]


def _token_id(key: str) -> int:
    """A logprobs key of a server without a tokenizer: ``"123"`` or ``"token_id:123"``."""
    return int(key.rsplit(":", 1)[-1])


@dataclass(frozen=True)
class Commit:
    """One write's commit as data, so that the engine's side can run all of it alone, inside
    one pause (`run_commit`), wherever the caller is.

    Attributes:
        what: the write's name, for its errors.
        steps: what the pause holds, in order: ``("rpc", method, kwargs)``, a call on every
            worker (failed outcomes fail the step); ``("load_lora", name, path)``;
            ``("unload_lora", name)``.
        base: the steps write base weights: a failure part-way loses the base (labelled
            `UNKNOWN_BASE` before the engine resumes).
        lora: the engine serves LoRA: the version read at the end holds the adapter ids its
            workers list.
        attest: the workers keep weightsync's ledger (`version_label` at the end); False: a
            stock server, no version.
        restore: the workers restore the layers a failed write left unfinished
            (``weightsync_abandon``); False (a stock server): a failed base write leaves the
            engine paused, never resumed on a mix it cannot fence.
        attest_before: also read the version once paused, before the steps
            (`Committed.before`): a base commit after another of the same write, whose caller
            must see whether anyone wrote between the two (its own steps move the epoch, so
            the version after them cannot tell).
    """

    what: str
    steps: tuple[tuple[Any, ...], ...]
    base: bool = True
    lora: bool = False
    attest: bool = True
    restore: bool = True
    attest_before: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "steps": [list(step) for step in self.steps],
            "base": self.base,
            "lora": self.lora,
            "attest": self.attest,
            "restore": self.restore,
            "attest_before": self.attest_before,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Commit:
        """Read back `to_json`'s dict.

        Raises:
            ValueError: a step of an unknown kind, or not a commit at all.
        """
        try:
            steps = tuple(tuple(step) for step in data["steps"])
            made = cls(
                str(data["what"]),
                steps,
                bool(data["base"]),
                bool(data["lora"]),
                bool(data["attest"]),
                bool(data["restore"]),
                bool(data.get("attest_before", False)),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a weightsync commit: {e!r}") from e
        unknown = [s[0] for s in steps if not s or s[0] not in _STEPS]
        if unknown:
            raise ValueError(f"a weightsync commit with steps of unknown kinds: {unknown}")
        return made


#: The kinds of a `Commit`'s steps and how many arguments each takes.
_STEPS = {"rpc": 2, "load_lora": 2, "unload_lora": 1}


@dataclass
class Committed:
    """What `run_commit` did.

    Attributes:
        done: how many of the commit's steps completed.
        results: the workers' answers of each completed step (None: not an ``rpc`` step).
        version: the engine's version, attested while still paused (None: not committed, or
            an engine that attests none).
        before: the version read once paused, before the steps (`Commit.attest_before`; else
            None).
        pause_s: how long the engine generated nothing for others, measured where it ran.
        error: why the commit failed (None: committed).
        recovery: why the recovery after ``error`` failed (None: recovered and resumed);
            `EngineUnavailableError`: the engine is gone; anything else: it is left paused.
    """

    done: int = 0
    results: list[Any] = field(default_factory=list)
    version: str | None = None
    pause_s: float = 0.0
    error: BaseException | None = None
    recovery: BaseException | None = None
    before: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "done": self.done,
            "results": self.results,
            "version": self.version,
            "pause_s": self.pause_s,
            "error": _error_json(self.error),
            "recovery": _error_json(self.recovery),
            "before": self.before,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Committed:
        return cls(
            int(data["done"]),
            list(data["results"]),
            data["version"],
            float(data["pause_s"]),
            _error_from(data["error"]),
            _error_from(data["recovery"]),
            data.get("before"),
        )


def _error_json(error: BaseException | None) -> dict[str, str] | None:
    return None if error is None else {"type": type(error).__name__, "message": str(error)}


def _error_from(data: dict[str, str] | None) -> BaseException | None:
    """An error from `_error_json`: the ``weightsync.errors`` class it named (a
    `BytesRejectedError` stays one), else a ``RuntimeError`` naming the type."""
    if data is None:
        return None
    kind = getattr(errors, data["type"], None)
    if isinstance(kind, type) and issubclass(kind, errors.WeightSyncError):
        return kind(data["message"])
    return RuntimeError(f"{data['type']}: {data['message']}")


Rpc = Callable[[str, dict[str, Any]], list[Any]]


def run_commit(
    control: Control,
    commit: Commit,
    write: Callable[[], Any] | None = None,
    rpc: Rpc | None = None,
) -> Committed:
    """Run ``commit`` through ``control``: pause (requests in flight kept), its steps, then
    ``write()`` if given (a write only the caller can make: a stream it sends), the version
    read and labelled (`base_label`), the prefix-cache reset, resume. The one composition of
    a commit, on whichever side runs it (the trainer's, a server's pause lease, a Ray actor).

    A pause the server's lease ended before this side finished it (`PauseExpiredError`) is not
    recovered here but counted done where the lease finished the commit's write whole
    (`_after_expiry`). Any other failure after the pause is not raised but returned
    (`Committed.error`), after the recovery: the workers restore the layers the write left unfinished (``weightsync_abandon``;
    the layers it finished keep their new weights, a mix a server's middleware fences), the
    prefix cache is reset, a base write labels `UNKNOWN_BASE`, and the engine resumes; if that
    recovery fails the engine is left paused -- never resume a broken engine -- and
    `Committed.recovery` says why. A failing pause is raised: nothing was run.

    Args:
        rpc: how a step's worker call is made (default ``control.rpc``; a Ray actor answers
            some names itself).
    """
    call = rpc or control.rpc
    control.pause()
    start = time.perf_counter()
    done = Committed()
    try:
        if commit.attest_before:
            done.before = _version_here(control, call, commit.lora)
        for kind, *args in commit.steps:
            if kind == "rpc":
                answers = call(args[0], args[1])
                raise_failures(args[0], [Outcome.from_json(a) for a in answers])
                done.results.append(answers)
            elif kind == "load_lora":
                control.load_lora(args[0], args[1])
                done.results.append(None)
            else:
                control.unload_lora(args[0])
                done.results.append(None)
            done.done += 1
        if write is not None:
            write()
        if commit.attest:
            done.version = _version_here(control, call, commit.lora)
            if done.version is not None:
                control.label(base_label(done.version))
        control.reset_prefix_cache()
    except PauseExpiredError as error:
        done.version, done.error = _after_expiry(control, call, commit, error)
        done.pause_s = time.perf_counter() - start
        return done
    except BaseException as error:  # noqa: BLE001 (returned, after the recovery)
        done.version, done.error = None, error
        done.recovery = _recover(control, call, commit)
        done.pause_s = time.perf_counter() - start
        return done
    control.resume()
    done.pause_s = time.perf_counter() - start
    return done


def _version_here(control: Control, call: Rpc, lora: bool) -> str | None:
    """The engine's version now (what ``RemoteVLLMEngine.weights_version`` reads): its workers'
    ledger epoch and adapter writes, and the adapter ids vLLM's ``list_loras`` lists."""
    answers = call("weightsync_attest", {"since": None, "asleep": control.is_sleeping()})
    outcomes = [Outcome.from_json(a) for a in answers]
    raise_failures("weightsync_attest", outcomes)
    now = attestation([o.value for o in outcomes])
    ids = adapter_ids(call("list_loras", {})) if lora else set()
    return version_label(now.epoch, ids, now.adapters)


def _after_expiry(
    control: Control, call: Rpc, commit: Commit, error: PauseExpiredError
) -> tuple[str | None, BaseException | None]:
    """A commit whose pause the server's lease ended before this side finished it: the lease
    settled what the pause left and resumed, so nothing is recovered here (a call made now
    could abandon or resume another trainer's pause). Where the lease finished this commit's
    update (``error.finished``, the label it gave those weights) and the workers still attest
    that label, the commit is done: ``(version, None)``; else ``(None, error)``, the error
    saying when another write came since."""
    if error.finished is None or not commit.attest:
        return None, error
    try:
        version = _version_here(control, call, commit.lora)
    except Exception:  # noqa: BLE001 (unknown: the lease's error stands)
        return None, error
    if version is not None and base_label(version) == error.finished:
        return version, None
    return None, PauseExpiredError(
        f"{error} The workers attest {version} now, not that label: another write came "
        "since, so the engine does not serve this sync's weights."
    )


def _recover(control: Control, call: Rpc, commit: Commit) -> BaseException | None:
    """After a failed step of `run_commit`: restore, reset, label, resume (None), or the
    error that stopped it, the engine left paused (see `run_commit`)."""
    try:
        if commit.restore:
            answers = call("weightsync_abandon", {})
            raise_failures("weightsync_abandon", [Outcome.from_json(a) for a in answers])
        elif commit.base:
            return RuntimeError("the engine cannot restore the layers its failed write left")
        control.reset_prefix_cache()
        if commit.base:  # a mix of old and new layers: tokens from now on say so
            with contextlib.suppress(Exception):  # a label is no reason to stay paused
                control.label(UNKNOWN_BASE)
        control.resume()
    except Exception as recovery:  # noqa: BLE001 (returned: the engine is left paused)
        return recovery
    return None


class Control(ABC):
    """The calls a remote engine needs, whatever carries them."""

    @abstractmethod
    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a worker(-extension) method on every worker; their results in rank order."""

    @abstractmethod
    def pause(self) -> None: ...

    @abstractmethod
    def resume(self) -> None: ...

    @abstractmethod
    def reset_prefix_cache(self) -> None: ...

    @abstractmethod
    def load_lora(self, name: str, path: str) -> None: ...

    @abstractmethod
    def unload_lora(self, name: str) -> None: ...

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], max_tokens: int, lora: str | None
    ) -> list[tuple[list[int], list[float]]]:
        """Greedy-decode each prompt (with the adapter loaded under ``lora``, if given)."""

    @abstractmethod
    def score(
        self, prompts: list[list[int]], top_k: int, lora: str | None
    ) -> list[list[dict[int, float]]]:
        """Prompt logprobs (see `Engine.score_batch`), with the adapter under ``lora``."""

    @abstractmethod
    def is_sleeping(self) -> bool: ...

    @abstractmethod
    def sleep(self, level: int) -> None: ...

    @abstractmethod
    def wake_up(self, tags: list[str] | None) -> None: ...

    def label(self, version: str) -> None:
        """Give vLLM ``version`` as its weight-version label of the tokens generated next
        (the spans of every output, `weights_spans`); an engine without one ignores it."""

    def commit(self, commit: Commit) -> Committed:
        """Run ``commit`` -- pause, its steps, the version read, the prefix-cache reset,
        resume, or the recovery after a failed step -- where it costs the fewest round trips:
        here (`run_commit`: the engine is in this process, or its control calls are cheap), or
        on the engine's own side in one call (`HTTPControl` with the pause lease's commit
        route, `RayControl`), which finishes and resumes by itself whatever becomes of the
        caller."""
        return run_commit(self, commit)


class HTTPControl(Control):
    """A ``vllm serve`` server started with ``VLLM_SERVER_DEV_MODE=1`` (the ``/collective_rpc``,
    ``/pause``, ``/sleep`` routes), ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` if it serves LoRA,
    and ``--worker-extension-cls weightsync.engines.vllm.worker.WeightsyncWorker``.

    It is also a ``VLLMWeightSyncClient`` (vLLM's weight-transfer routes), one that sends the
    token, for `WeightTransferTransport`.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        token: weightsync's token (``server_auth.py``), sent on every call; None: none.
        timeout_s: how long one call may take.

    Raises:
        AuthError: the server refuses the token (or wants one and got none).
    """

    def __init__(
        self, base_url: str, *, token: str | None = None, timeout_s: float = 600.0
    ) -> None:
        import requests

        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._requests = requests
        self._token = token
        #: The lease id of the pause this client holds (``server_lease.py``), sent with every
        #: call until it resumes; None: no pause, or a server without the lease.
        self.lease: str | None = None
        #: Whether the server runs a commit in one call (its pause lease's `COMMIT_PATH`);
        #: None: not asked yet (the first commit tries it).
        self.commits: bool | None = None
        self._session = self._new_session()
        self.model = self._call("GET", "/v1/models")["data"][0]["id"]

    def _new_session(self) -> Any:
        session = self._requests.Session()
        if self._token:
            session.headers[TOKEN_HEADER] = self._token
        return session

    def guarded(self) -> bool:
        """Whether the server turns away a weight-changing call without the token: asks
        ``/is_sleeping`` (dev mode, changes nothing) with no token at all."""
        try:
            r = self._requests.get(self.base_url + "/is_sleeping", timeout=self.timeout_s)
        except (self._requests.ConnectionError, self._requests.Timeout) as err:
            raise EngineUnavailableError(
                f"the vLLM server at {self.base_url} does not answer: {err}"
            ) from err
        return r.status_code == 401

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One HTTP call; its JSON (or text) answer.

        Raises:
            PauseExpiredError: the server's pause lease ran out before this call of the pause
                came (``server_lease.py``); the call was not run.
            EngineBusyError: another caller holds the server's pause or runs a commit on it;
                the call was not run (``server_lease.py``).
            EngineFencedError: the server refuses to generate: a weightsync write failed
                part-way and left a mix of old and new layers (``server_lease.py``).
            EngineUnavailableError: the server refuses the connection, resets it twice, or does
                not answer within ``timeout_s`` (a server that is gone, restarting, or hung).
            RuntimeError: the server answered with an HTTP error.
        """
        return self._answer(self._response(method, path, **kwargs))

    def _response(self, method: str, path: str, **kwargs: Any) -> Any:
        """One HTTP call's response, its errors raised (see `_call`)."""
        if self.lease is not None:
            kwargs["headers"] = {**kwargs.get("headers", {}), LEASE_HEADER: self.lease}
        try:
            try:
                r = self._session.request(
                    method, self.base_url + path, timeout=self.timeout_s, **kwargs
                )
            except self._requests.ConnectionError:
                # A keep-alive connection the server reset after an error: retry once, fresh.
                self._session = self._new_session()
                r = self._session.request(
                    method, self.base_url + path, timeout=self.timeout_s, **kwargs
                )
        except (self._requests.ConnectionError, self._requests.Timeout) as err:
            self._session = self._new_session()
            timed_out = isinstance(err, self._requests.Timeout)
            state = (
                f"no answer within {self.timeout_s:g} s; the server is hung or overloaded"
                if timed_out
                else "connection refused; the server is gone or restarting"
            )
            raise EngineUnavailableError(
                f"the vLLM server at {self.base_url} does not answer ({method} {path}): {state}. "
                f"Nothing more was sent to it. ({type(err).__name__}: {err})"
            ) from err
        if r.status_code == 401:
            self._session = self._new_session()
            given = "a token it does not accept" if self._token else "no token"
            raise AuthError(
                f"the vLLM server at {self.base_url} refused {method} {path}: it checks "
                f"weightsync's token and this trainer sent {given}. Pass the server's "
                f"WEIGHTSYNC_TOKEN as token= (or set it in this process's environment). "
                f"({r.text[:500]})"
            )
        if r.status_code == 409 and "pause lease" in r.text:
            self.lease = None  # the server resumed without us
            raise PauseExpiredError(
                f"the vLLM server at {self.base_url} did not run {method} {path}: "
                f"{r.json().get('error', r.text[:500])}",
                finished=r.headers.get(FINISHED_HEADER),
            )
        if r.status_code == 409 and r.headers.get(BUSY_HEADER):
            raise EngineBusyError(
                f"the vLLM server at {self.base_url} did not run {method} {path}: "
                f"{r.json().get('error', r.text[:500])}"
            )
        if r.status_code == 503 and r.headers.get(FENCED_HEADER):
            raise EngineFencedError(
                f"the vLLM server at {self.base_url} refused {method} {path}: "
                f"{r.json().get('error', r.text[:2000])}"
            )
        if r.status_code >= 400:
            self._session = self._new_session()
            raise RuntimeError(
                f"{method} {self.base_url}{path} -> HTTP {r.status_code}: {r.text[:2000]}"
            )
        return r

    @staticmethod
    def _answer(r: Any) -> Any:
        """A response's JSON, or its text (the LoRA routes answer in plain text)."""
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            return r.text  # the LoRA routes answer in plain text

    def server_info(self) -> dict[str, Any]:
        """The server's ``VllmConfig`` as JSON (dev mode)."""
        return self._call("GET", "/server_info", params={"config_format": "json"})["vllm_config"]

    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        body = {"method": method, "kwargs": kwargs or {}}
        return (self._call("POST", "/collective_rpc", json=body) or {}).get("results", [])

    def commit(self, commit: Commit) -> Committed:
        """One call, ``POST`` `COMMIT_PATH`, to a server with weightsync's pause lease: the
        server pauses, runs the steps, reads the version, resets and resumes by itself
        (``server_lease.py``), so a trainer killed during the call does not leave it paused.
        A server without that route (404: no middleware, a stock server) gets the steps one
        call each (`run_commit` here), and a warning once: nothing resumes it if this process
        dies inside them (docs/fail-closed.md)."""
        if self.commits is not False:
            r = self._session_post(COMMIT_PATH, commit.to_json())
            if r is not None:
                self.commits, self.lease = True, None  # resumed: a pause held here ended too
                return Committed.from_json(r)
            self.commits = False
            logger.warning(
                "weightsync: %s has no pause lease, so each sync's commit pauses it from here, "
                "one call a step, and a trainer killed inside those calls leaves it paused. "
                "Start it with --middleware %s.",
                self.base_url,
                LEASE_MIDDLEWARE,
            )
        return run_commit(self, commit)

    def _session_post(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """``POST path`` with ``body``; its JSON answer, or None when the server has no such
        route (HTTP 404: nothing was run)."""
        try:
            return cast("dict[str, Any]", self._call("POST", path, json=body))
        except RuntimeError as error:
            if f"{path} -> HTTP 404" in str(error):
                return None
            raise

    def pause(self) -> None:
        self.lease = None
        r = self._response("POST", "/pause", params={"mode": "keep"})
        self.lease = r.headers.get(LEASE_HEADER)

    def resume(self) -> None:
        try:
            self._call("POST", "/resume")
        finally:
            self.lease = None

    def reset_prefix_cache(self) -> None:
        # vLLM answers {"success": false}, and keeps the cache, while running requests hold
        # blocks; reset_running_requests recomputes those requests' KV instead. (The pause
        # before a write clears the cache too; this reset must not rely on it.)
        answer = self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": True})
        if isinstance(answer, dict) and not answer.get("success", True):
            raise RuntimeError(
                f"the vLLM server at {self.base_url} did not reset its prefix cache: prompts "
                "could be answered from KV computed with the previous weights"
            )

    def load_lora(self, name: str, path: str) -> None:
        # Never load_inplace over HTTP: the server then re-reads the adapter from disk on every
        # decode step, and deleting its folder kills the server (measured, vLLM 0.32).
        body = {"lora_name": name, "lora_path": path}
        try:
            self._call("POST", "/v1/load_lora_adapter", json=body)
        except RuntimeError as error:
            if "has already been loaded" not in str(error):
                raise
            # An earlier client of this server (a trainer restarted, another engine) left an
            # adapter under this name: not the version this engine means by it. Replace it.
            self.unload_lora(name)
            self._call("POST", "/v1/load_lora_adapter", json=body)

    def unload_lora(self, name: str) -> None:
        loaded = [m["id"] for m in self._call("GET", "/v1/models")["data"]]
        if name in loaded:  # loaded by us, or by an earlier client of this server
            self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def generate(
        self, prompts: list[list[int]], max_tokens: int, lora: str | None
    ) -> list[tuple[list[int], list[float]]]:
        body = {
            "model": lora or self.model,
            "prompt": [list(p) for p in prompts],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        choices = sorted(
            self._call("POST", "/v1/completions", json=body)["choices"], key=lambda c: c["index"]
        )
        return [(list(c["token_ids"]), list(c["logprobs"]["token_logprobs"])) for c in choices]

    def score(
        self, prompts: list[list[int]], top_k: int, lora: str | None
    ) -> list[list[dict[int, float]]]:
        body = {
            "model": lora or self.model,
            "prompt": [list(p) for p in prompts],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": top_k,
            "return_tokens_as_token_ids": True,
        }
        choices = sorted(
            self._call("POST", "/v1/completions", json=body)["choices"], key=lambda c: c["index"]
        )
        return [
            [
                {_token_id(k): v["logprob"] for k, v in pos.items()}
                for pos in c["prompt_logprobs"][1:]
            ]
            for c in choices
        ]

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/is_sleeping")["is_sleeping"])

    def sleep(self, level: int) -> None:
        self._call("POST", "/sleep", params={"level": level, "mode": "keep"})

    def wake_up(self, tags: list[str] | None) -> None:
        self._call("POST", "/wake_up", params=[("tags", t) for t in tags or []])

    def label(self, version: str) -> None:
        # Dev mode's RL route; the spans come back from the token-in-token-out API.
        self._call("POST", "/update_weight_version", json={"new_version": version})

    # --- vLLM's weight-transfer routes (the ``VLLMWeightSyncClient`` protocol) ---------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._call("POST", "/finish_weight_update", json=body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("POST", "/shutdown_weight_transfer_engine")


def held_lora(loras: dict[str, Any], name: str | None) -> Any:
    """The ``LoRARequest`` loaded under ``name`` (None for no adapter).

    Raises:
        AdapterError: no adapter of that name is loaded: another client's write unloaded it
            (two engine objects over one ``LLM`` sharing a ``lora_name``). Generating without
            it would answer from the base alone, silently.
    """
    if not name:
        return None
    if name not in loras:
        raise AdapterError(
            f"the engine holds no adapter named {name!r} (another client's write unloaded it; "
            "engines sharing one vLLM need lora_names of their own): sync again to load it"
        )
    return loras[name]


class LoraIds:
    """A fresh adapter id for each adapter version an ``LLM`` or ``AsyncLLM`` loads, never one
    another adapter of the engine holds: vLLM's ``add_lora`` keeps an adapter already loaded
    under an id (the new version would be ignored), and loading under an id the user's own
    adapter holds would replace it (vLLM's usual example id is 1)."""

    def __init__(self) -> None:
        self._next = 1

    def request(self, name: str, path: str, loaded: Iterable[int]) -> Any:
        """A ``LoRARequest`` for ``name`` at ``path`` under an id none of ``loaded`` (the ids
        the engine lists now) is."""
        from vllm.lora.request import LoRARequest

        held = set(loaded)
        while self._next in held:
            self._next += 1
        self._next += 1
        return LoRARequest(name, self._next - 1, path)


class LLMControl(Control):
    """A ``vllm.LLM`` with its default multiprocess engine core (any tensor parallel size),
    created with ``worker_extension_cls=WORKER_EXTENSION``. Its ``generate`` is synchronous, so
    no request is in flight while the trainer (the same thread) writes: pausing is not needed.

    Every call raises `EngineUnavailableError` once the engine core died (vLLM's
    ``EngineDeadError``): a dead core never comes back, the ``LLM`` must be created again."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._loras: dict[str, Any] = {}
        self._ids = LoraIds()

    @contextlib.contextmanager
    def _answering(self) -> Iterator[None]:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            yield
        except EngineDeadError as err:
            model = self.llm.llm_engine.vllm_config.model_config.model
            raise EngineUnavailableError(
                f"the multiprocess vLLM LLM on {model} does not answer: its engine core died "
                f"({err}); create a new LLM (and a new engine adapter for it)"
            ) from err

    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        with self._answering():
            return self.llm.collective_rpc(method, kwargs=kwargs or {})

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        with self._answering():
            self.llm.reset_prefix_cache()

    def lora_request(self, name: str | None) -> Any:
        """The ``LoRARequest`` of the adapter loaded under ``name`` (None: none)."""
        return held_lora(self._loras, name)

    def load_lora(self, name: str, path: str) -> None:
        with self._answering():
            request = self._ids.request(name, path, self.llm.llm_engine.list_loras())
            self.llm.llm_engine.add_lora(request)
        self._loras[name] = request

    def unload_lora(self, name: str) -> None:
        request = self._loras.pop(name, None)
        if request is not None:
            with self._answering():
                self.llm.llm_engine.remove_lora(request.lora_int_id)

    def generate(
        self, prompts: list[list[int]], max_tokens: int, lora: str | None
    ) -> list[tuple[list[int], list[float]]]:
        with self._answering():
            return greedy_generate(self.llm, prompts, max_tokens, held_lora(self._loras, lora))

    def score(
        self, prompts: list[list[int]], top_k: int, lora: str | None
    ) -> list[list[dict[int, float]]]:
        with self._answering():
            return score_prompts(self.llm, prompts, top_k, held_lora(self._loras, lora))

    def is_sleeping(self) -> bool:
        with self._answering():
            return bool(self.llm.llm_engine.is_sleeping())

    def sleep(self, level: int) -> None:
        with self._answering():
            self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None) -> None:
        with self._answering():
            self.llm.wake_up(tags=tags)

    def label(self, version: str) -> None:
        with self._answering():
            self.llm.llm_engine.set_weight_version(version)
