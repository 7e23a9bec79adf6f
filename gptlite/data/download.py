"""Downloads, each to a local file, atomically, kept for the next run: a URL (a corpus, HellaSwag's file) and
ready-made GPT-2 token shards of FineWeb (llm.c's format) from the Hugging Face Hub. Offline, each says how to pass a
local copy instead."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from gptlite.data.shards import MANIFEST, file_sha256, read_shard
from gptlite.extras import need
from gptlite.files import write_json
from gptlite.tokenizer import TOKENIZER_FILE, get_tokenizer


def download(url: str, dest: Path) -> Path:
    """Download url to dest (atomically) unless it is already there. A failure leaves nothing behind: neither a
    partial file nor the folders made for it."""
    import urllib.request  # here, not at the top: every spawned worker imports this module

    if dest.is_file():
        return dest
    created = [folder for folder in (dest.parent, *dest.parent.parents) if not folder.exists()]  # deepest first
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        with urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        for folder in created:  # a failed download leaves no empty folder behind
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise ConnectionError(
            f"could not download {url} ({e}); download it elsewhere and pass the local file instead"
        ) from None
    os.replace(tmp, dest)
    return dest


TOKEN_SHARDS = {  # name -> (Hugging Face dataset repository, file prefix, train shards of 100M tokens)
    "fineweb10B": ("kjj0/fineweb10B-gpt2", "fineweb", 103),
    "finewebedu10B": ("kjj0/finewebedu10B-gpt2", "finewebedu", 99),
}


def download_token_shards(
    name: str,
    out_dir: str | Path,
    train_shards: int,
    tokenizer_spec: str = "gpt2",
    revision: str | None = None,
    log=print,
) -> dict:
    """Download the val shard and the first `train_shards` train shards of a TOKEN_SHARDS dataset into out_dir
    (files already there are kept, so an interrupted download continues), check their headers, and write
    tokenizer.json and manifest.json as `prepare` does; return the manifest."""
    if name not in TOKEN_SHARDS:
        raise ValueError(f"unknown token-shard dataset '{name}'; choose one of {', '.join(TOKEN_SHARDS)}")
    repo, prefix, available = TOKEN_SHARDS[name]
    if not 1 <= train_shards <= available:
        raise ValueError(f"train_shards={train_shards} must be between 1 and {available} for {name} (100M tokens each)")
    hub = need("huggingface_hub", "data", "Downloading token shards")
    tokenizer = get_tokenizer(tokenizer_spec)  # before gigabytes of download: fails fast offline
    out_dir = Path(out_dir)
    files = [f"{prefix}_val_000000.bin"] + [f"{prefix}_train_{i:06d}.bin" for i in range(1, train_shards + 1)]
    for file in files:
        if (out_dir / file).is_file():
            continue
        log(f"downloading {file} from huggingface.co/datasets/{repo}")
        try:  # huggingface_hub writes to a temporary file and renames it when complete
            hub.hf_hub_download(repo_id=repo, filename=file, repo_type="dataset", revision=revision, local_dir=out_dir)
        except OSError as e:  # huggingface_hub's HTTP, offline and not-found errors are OSErrors
            raise ConnectionError(
                f"could not download {file} from huggingface.co/datasets/{repo} ({type(e).__name__}); check the "
                "network (or HF_ENDPOINT) and run again: the files already downloaded are kept"
            ) from None
    tokens = {file: read_shard(out_dir / file) for file in files}  # checks each header; maps, reads nothing
    shards = [{"file": file, "tokens": len(t)} for file, t in tokens.items()]
    tokenizer.save(out_dir / TOKENIZER_FILE)
    manifest = {
        "sources": [{"format": "hf_hub", "repo": repo, "revision": revision}],
        "tokenizer": tokenizer_spec,
        "vocab_size": tokenizer.vocab_size,
        "token_dtype": tokens[files[0]].dtype.name,
        "eot_id": tokenizer.eot_id,
        "shards": shards,
        "sha256": {file: file_sha256(out_dir / file) for file in files},
        "train_tokens": sum(s["tokens"] for s in shards[1:]),
        "val_tokens": shards[0]["tokens"],
    }
    write_json(out_dir / MANIFEST, manifest)
    log(
        f"{out_dir}: {manifest['train_tokens']:,} train and {manifest['val_tokens']:,} val tokens of {name}, "
        "ready to train"
    )
    return manifest
