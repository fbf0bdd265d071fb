"""weightsync's benchmark suite: every sync strategy head-to-head against a real in-process vLLM.

Run ``bash .ci/env python -m benchmarks`` (see docs/benchmarks.md). Modules, in reading order:

- :mod:`benchmarks.models`   -- the model shapes, built locally once and cached.
- :mod:`benchmarks.measure`  -- timing and peak-resident-memory sampling.
- :mod:`benchmarks.anchors`  -- the approaches weightsync is compared against (benchmarks only).
- :mod:`benchmarks.suite`    -- the rows, the correctness checks, drift and the memory check.
- :mod:`benchmarks.report`   -- JSON, markdown table, PNG plot, targets.
"""
