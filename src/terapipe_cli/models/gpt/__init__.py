"""The GPT family: ``gpt`` (nanoGPT's decoder, priced as Megatron's GPT-3 layer) and ``gpt2`` (GPT-2 exactly).

spec.py    their settings and arch specs (torch-free): splits, parameter counts, the analytic layer, `transformers` keys
module.py  their torch module: `GPT` (the stage layout every family's module shares) and `GPT2`
"""
