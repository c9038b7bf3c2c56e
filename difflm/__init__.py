"""Ground floor: the typed config, the embedded demo corpus, MLflow tracking and plots.

Imports no other package of the project (`cli.py` excepted, lazily: see its docstring).
"""
