"""Settings shared by the benchmarks."""

MODEL_20M = [
    "models.tiny.hidden_size=512",
    "models.tiny.intermediate_size=1536",
    "models.tiny.num_layers=6",
    "models.tiny.num_heads=8",
    "models.tiny.num_kv_heads=4",
]
"""Overrides that make the `tiny` model of the shipped configs a ~19M-parameter model."""
