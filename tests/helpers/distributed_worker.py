"""Run by tests/train/test_distributed.py under torchrun: each rank reads batches through the loaders train.py uses
(gptlite.data.loader.make_loaders, in gptlite.train.distributed's process group) and writes the token rows it read, per
step, to OUT/windows_rank{RANK}.json.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/helpers/distributed_worker.py DATA_DIR OUT STEPS
"""

import json
import sys
from pathlib import Path

from gptlite.config import build_config
from gptlite.data.loader import make_loaders
from gptlite.train.distributed import processes


def main(data_dir: str, out: str, steps: int) -> None:
    cfg = build_config({"data_dir": data_dir, "vocab_size": 50_000, "block_size": 8, "batch_size": 3})
    with processes() as (rank, _, world_size):
        loader, _ = make_loaders(cfg, rank, world_size)
        batches = []
        for _ in range(steps):
            epoch = loader.epoch
            x, _ = loader.next_batch()
            batches.append({"epochs": [epoch, loader.epoch], "rows": x.tolist()})
        Path(out, f"windows_rank{rank}.json").write_text(json.dumps({"world_size": world_size, "batches": batches}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
