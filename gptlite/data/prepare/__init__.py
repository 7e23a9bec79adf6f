"""Dataset preparation: documents from text, JSONL, Parquet or Hugging Face inputs, tokenized in parallel into
train/val token shards that survive interruption (`prepare`; data/prepare.py is its command).

The modules: pipeline.py (the orchestrator, and what a preparation guarantees), sources.py (the inputs and how they
are cut and parsed), workers.py (tokenizing processes, the val split), progress.py (resume and the manifest),
preference.py (pairs of a chosen and a rejected answer, --preference). Nothing here imports torch.
"""

from gptlite.data.prepare.pipeline import SHARD_TOKENS, prepare

__all__ = ["SHARD_TOKENS", "prepare"]
