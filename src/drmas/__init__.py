"""drmas: stable RL for cooperative multi-agent LLM systems (Dr. MAS), as pipelines.

Importing drmas is light: the heavy systems parts (Ray, Kubeflow, DeepSpeed, SGLang,
MLflow) are imported only by the modules and functions that use them.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("drmas")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"
