"""weightsync's benchmark suite: every sync strategy head-to-head against a real in-process vLLM.

Run ``bash .ci/env python -m benchmarks`` (see docs/benchmarks.md). Modules, in reading order:

- `benchmarks.models`   -- the model shapes, built locally once and cached.
- `benchmarks.measure`  -- timing and peak-resident-memory sampling.
- `benchmarks.anchors`  -- the approaches weightsync is compared against (benchmarks only).
- `benchmarks.suite`    -- the rows, the correctness checks, drift and the memory check.
- `benchmarks.report`   -- JSON, markdown table, PNG plot, targets.
"""
