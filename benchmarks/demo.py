"""``python -m benchmarks.demo``: the bug this library exists for, and its fix, on a real vLLM
engine.

It builds a tiny random model, starts vLLM on it, trains (perturbs) a LoRA adapter, simulates a
level-2 sleep (the engine's weights become garbage: vLLM's sleep is a no-op on CPU), shows the
gibberish, then lets ``Syncer`` choose and sync and shows the engine matching the trainer again,
through several RL-style steps with different sleep levels. Then the same for full training.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from .console import quiet_vllm


def demo(arch: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from peft import LoraConfig, get_peft_model

    from weightsync import AdapterSync, Syncer
    from weightsync import testing as T
    from weightsync.engines import VLLMEngine
    from weightsync.errors import BaseDiscardedError

    prompt = T.PROMPTS[0]

    def show(label: str, model, engine) -> None:
        r = T.compare(model, engine, prompts=[prompt])
        same = "MATCH" if r["engine"] == r["trainer"] else "DIFFERENT"
        print(f"  {label:<34} engine {r['engine'][0]}  trainer {r['trainer'][0]}  {same}")

    with tempfile.TemporaryDirectory() as tmp:
        print(f"building a tiny {arch} model and starting vLLM on it (CPU)...")
        checkpoint = T.save_checkpoint(T.tiny_model(arch), os.path.join(tmp, "ck"))
        engine = VLLMEngine(T.make_llm(checkpoint, enable_lora=True))

        print("\n== LoRA training, the engine serves the adapter ==")
        model = get_peft_model(
            T.tiny_model(arch), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
        )
        syncer = Syncer(engine, train_type="lora", verify=True)
        for step, level in enumerate([0, 1, 2, 0]):
            T.perturb(model, seed=step, scale=0.3)  # an optimizer step on the adapter
            print(f"step {step}: sleep level {level}")
            if level:
                engine.sleep(level)
                if level == 2:
                    T.discard_weights(engine)
                engine.wake_up()
            show("before sync", model, engine)
            if level == 2:
                try:  # what an adapter-only sync after a level-2 wake would do: refused
                    AdapterSync().sync(model, engine)
                except BaseDiscardedError as err:
                    print(f"  an adapter-only sync is refused: {str(err)[:90]}...")
            report = syncer.sync(model)
            print(f"  chose {report.strategy}: {report.reason}")
            print(
                f"  sent {report.tensors} tensors, {report.bytes / 1e6:.2f} MB in {report.seconds * 1e3:.1f} ms; "
                f"canary logprob diff {report.verified_logprob_diff:.2e}"
            )
            show("after sync", model, engine)

        print("\n== full training ==")
        dense = T.tiny_model(arch)
        syncer = Syncer(engine, train_type="full", verify=True)
        for step, level in enumerate([2, 1]):
            T.perturb(dense, seed=100 + step)
            print(f"step {step}: sleep level {level}")
            engine.sleep(level)
            if level == 2:
                T.discard_weights(engine)
            engine.wake_up()
            show("before sync", dense, engine)
            report = syncer.sync(dense)
            print(f"  chose {report.strategy}: {report.reason}")
            show("after sync", dense, engine)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.demo",
        description="a level-2 wake's gibberish on a real vLLM engine, and weightsync's recovery",
    )
    parser.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    args = parser.parse_args(argv)
    quiet_vllm()
    demo(args.arch)


if __name__ == "__main__":
    main()
