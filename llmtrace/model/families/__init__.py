"""The families llmtrace runs, each a small file of what it changes from Llama (model/transformer.py).

A family file defines `FAMILY = Family(...)`: the model class it runs (Llama's modules, or subclasses that change a
step), the HF `model_type`s and GGUF architectures it reads, the config fields it adds, and the short account of
what it changes that the run header and `explain` print. Adding a family is adding a file here: this package finds
them itself.
"""
