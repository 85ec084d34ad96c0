"""The Llama family (``llama``): RMSNorm, rotary positions (Llama 3.1's scaling), SwiGLU, grouped-query attention.

spec.py    its settings and arch spec (torch-free): splits, parameter counts, the analytic layer, `transformers` keys
module.py  its torch module, `Llama`
"""
