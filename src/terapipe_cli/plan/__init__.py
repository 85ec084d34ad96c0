"""Stage 2, planning: from a profile to a plan file (docs/design.md §3–§5, §10). Pure numpy, no torch, no I/O
beyond the files it reads and writes.

costmodel.py  the profile file (its reader) and the cost model t(b, i, j) built from it
domain.py     where a profile's times hold (the batch slices it prices) and where they come from (provenance)
fit_quality.py how far to trust a profile's fits: a warning line for each that is off
configs.py    the choice among partitions, virtual stages and orders (`plan_configured`, what `terapipe plan` calls)
search.py     the exact slicing search: token DP per batch-slice size, batch knapsack, t_max branch and bound
memory.py     the memory estimate: what each stage keeps, walked along its schedule, its closed forms, the limit
groupings.py  batch groupings under a memory limit, as a state machine for the search
simulate.py   the schedule replayed with the cost model: a predicted timeline
request.py    what to plan: a profile and a training shape, checked against each other; bounds on the work
choice.py     the plan chosen for a request: the search, its baselines, re-ranking, the memory limit
baseline.py   the GPipe baseline of a plan, as a plan of its own
file.py       the plan file (terapipe.plan/1): its reader, writer and short form
"""
