"""Checkpoints and the run folders that hold them, in four modules:
    file.py            the checkpoint file: what it holds (its schema, and run_checkpoint that builds it), atomic,
                       checksummed saves and safe loading (`weights_only=True`)
    run_folder.py      a run's folder: the newest few step files plus the best, claimed and locked by one run at a
                       time, and loading its newest intact checkpoint past a damaged one
    inference.py       a model rebuilt from a checkpoint (a LoRA run's on its checked base weights), or pretrained,
                       with its tokenizer: what sample.py, the server, evaluation and export load
    training_state.py  what a checkpoint holds beside the weights, gathered from every rank and put back on a resume
This file holds only the names the rest of gptlite and its tests import from gptlite.checkpoint.
"""

from gptlite.checkpoint.file import (
    CHECKSUM_SUFFIX,
    git_commit,
    load_file,
    nonfinite,
    run_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from gptlite.checkpoint.file import _HashingWriter as _HashingWriter  # the writer the tests fault (a full disk)
from gptlite.checkpoint.inference import (
    check_lora_base,
    is_run,
    load_model,
    load_source,
    lora_model,
    model_from_checkpoint,
    source_config,
    source_fingerprint,
    source_tokenizer,
)
from gptlite.checkpoint.run_folder import (
    BEST_NAME,
    CHECKPOINT_NAME,
    RUN_FILE,
    STEP_FILE,
    STEP_FILE_RE,
    began_run,
    claim_run_folder,
    copy_tokenizer,
    discard_damaged,
    holds_run,
    load_checkpoint,
    record_run,
    recorded_config,
    remove_leftovers,
    run_files,
    save_run_checkpoint,
    step_files,
)
from gptlite.checkpoint.training_state import (
    check_same_data,
    gather_training_state,
    load_training_state,
    rng_state,
    set_rng_state,
)

__all__ = [
    "is_run",
    "load_source",
    "source_config",
    "source_fingerprint",
    "source_tokenizer",
    "check_same_data",
    "BEST_NAME",
    "CHECKPOINT_NAME",
    "CHECKSUM_SUFFIX",
    "RUN_FILE",
    "STEP_FILE",
    "STEP_FILE_RE",
    "began_run",
    "check_lora_base",
    "claim_run_folder",
    "copy_tokenizer",
    "discard_damaged",
    "gather_training_state",
    "git_commit",
    "holds_run",
    "load_checkpoint",
    "record_run",
    "recorded_config",
    "load_file",
    "load_model",
    "load_training_state",
    "lora_model",
    "model_from_checkpoint",
    "nonfinite",
    "remove_leftovers",
    "rng_state",
    "run_checkpoint",
    "run_files",
    "save_checkpoint",
    "save_run_checkpoint",
    "set_rng_state",
    "step_files",
    "verify_checkpoint",
]
