"""The measuring tools: what the engine and the training command cost, and why.

They may import the engine and the training command; neither imports them.

- `benchmark`: the engine's pipelines and the plain JAX step timed in rounds in one
  process (medians and ranges), the memory each device holds, the host's cost per call;
  `benchmark_across`: the same with a process per stage; `benchmark_command`: the
  training command beside the engine.
- `timeline`: when each stage function ran on each device (Gantt chart, Perfetto trace).
- `timing`: a timing model of the timetables (step time and bubble from each call's cost).
- `balance`: block profiling and the balanced split it gives.
- `stress`: many short multi-process runs under deadlines, and who froze.
"""
