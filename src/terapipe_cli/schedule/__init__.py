"""The schedule the workers execute (docs/design.md §6, §11, §11a, §11b): what each device runs, in what order,
on which layers. The planner builds and prices it, the engine walks it, the report draws it. Pure Python and numpy:
imports no torch and nothing of the planner.

actions.py    the tiles and actions (``0F3.2``: a `Phase` F, B, I or W of one tile on one chunk), their legality
              and the walk of every device's row
orders/       the built-in orders, one module each (GPipe, 1F1B, ZB-H1, ZB-V), and their registry
partition.py  the layers of each chunk (stage, or virtual stage when a device runs several) and its device
schedule.py   the schedule object: per stage, its ordered actions; its grid and CSV form
timeline.py   measured and predicted timelines, one form, and busy/idle per stage
memo.py       work shared within one plan (the orders' walks, the planner's prices and tables)
"""
