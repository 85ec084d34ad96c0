"""The report (docs/design.md §8, stage 4): compare a training run with its GPipe baseline and draw the pipeline
(or, with ``--no-baseline``, describe the run alone).

    runs.py      load and validate a run directory (config, plan, metrics.jsonl, timelines, summary)
    compare.py   latencies, speed-up, predicted vs measured, busy/idle per stage, bubble, memory, losses
    figures.py   timeline.png (one row per stage, F/B boxes per tile) and loss.png (matplotlib, Agg)
    trace.py     trace.json in Chrome trace format (one process per rank) for Perfetto
    text.py      the tables and sentences, shared by the terminal and report.md
    build.py     everything above into report.json, report.md, the pictures and the trace
    preview.py   a plan before training (`terapipe plan --show`): its simulated step and memory beside GPipe's

Measured timelines (from the workers) and predicted ones (from `terapipe_cli.plan.simulate`) are the same
`timeline.Event` form, so every picture and number treats them alike.
"""
