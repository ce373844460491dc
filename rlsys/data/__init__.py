"""Prompt data: datasets from JSONL/Parquet, a resumable epoch sampler, and the built-in synthetic task."""

from rlsys.data.dataset import Prompt, PromptDataset, load_records
from rlsys.data.sampler import EpochSampler
from rlsys.data.synthetic import SyntheticTask, SyntheticTokenizer, synthetic_reward

__all__ = [
    "EpochSampler",
    "Prompt",
    "PromptDataset",
    "SyntheticTask",
    "SyntheticTokenizer",
    "load_records",
    "synthetic_reward",
]
