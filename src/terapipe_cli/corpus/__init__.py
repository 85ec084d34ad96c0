"""Training corpora: the token files `terapipe train --data` reads, and `terapipe data tokenize` that writes them.

formats.py   every format read, each told apart by its own header (numpy only, memory-mapped, no torch); the
             Megatron-LM indexed dataset writer
tokenize.py  text, JSON Lines and Parquet through a Hugging Face `tokenizers` tokenizer into a Megatron corpus
             (needs the optional `tokenizers` package; Parquet needs `pyarrow`)
"""
