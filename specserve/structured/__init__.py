"""Structured outputs through xgrammar: constraints (`StructuredOutputsParams` in `sampling_params.py`), their compilation
(`grammar.py`), per-request matcher state under speculation (`matcher.py`) and the step's
masks over the target logits (`bitmask.py`)."""
