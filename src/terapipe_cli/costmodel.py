"""The cost model's public face, kept where users first imported it: `CostModel.from_profile` lives in
`plan.costmodel`."""

from terapipe_cli.plan.costmodel import CostModel, Profile, read_profile

__all__ = ["CostModel", "Profile", "read_profile"]
