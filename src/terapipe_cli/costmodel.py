"""The cost model as a library (documented API, stable): `CostModel.from_profile` reads a profile (measured or
analytic) and prices a tile of a stage (docs/design.md §3), `read_profile` validates a profile file; they live in
`plan.costmodel`. `terapipe_cli.planner` searches over these prices."""

from terapipe_cli.plan.costmodel import CostModel, Profile, read_profile

__all__ = ["CostModel", "Profile", "read_profile"]
