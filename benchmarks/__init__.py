"""weightsync's benchmark suite: every sync strategy head-to-head against a real in-process vLLM.

Run ``bash .ci/env python -m benchmarks`` (see docs/benchmarks.md). Modules, in reading order:

- `benchmarks.models`       -- the model shapes, built locally once and cached.
- `benchmarks.rows`         -- the rows: what each syncs, into which engine, checked against what.
- `benchmarks.trainers`     -- the trainer models the rows sync from, and what they compute.
- `benchmarks.inprocess`    -- the in-process vLLM engines.
- `benchmarks.servers`      -- the ``vllm serve`` processes and the out-of-process rows' engines.
- `benchmarks.measure`      -- timing and peak-resident-memory sampling.
- `benchmarks.phases`       -- where one sync's seconds go, from weightsync's timing spans.
- `benchmarks.anchors`      -- the approaches weightsync is compared against (benchmarks only).
- `benchmarks.correctness`  -- after each row: does the engine compute what the trainer does?
- `benchmarks.suite`        -- one run: each row timed, then checked.
- `benchmarks.profiling`    -- where FullSync's, vLLM's reload's and AdapterSync's seconds go.
- `benchmarks.drift`        -- the trainer's weights after many merged-LoRA syncs.
- `benchmarks.memory`       -- FullSync's peak extra memory against its bound, at a second size.
- `benchmarks.report`       -- JSON, markdown table, PNG plot, targets.
- `benchmarks.verification` -- checks of weightsync's verification itself (run on its own).
- `benchmarks.quantized`    -- FullSync into quantized engines, and their oracle checkpoint.
- `benchmarks.demo`         -- a level-2 wake's gibberish and weightsync's recovery, in 20 s.

Shared with the tests and docs/recipes: `benchmarks.processes` (the real processes they start
and stop: ``vllm serve``, a multiprocess ``LLM``, a Ray cluster on loopback) and
`benchmarks.console` (vLLM's log kept quiet). None of this is part of the installed package.
"""
