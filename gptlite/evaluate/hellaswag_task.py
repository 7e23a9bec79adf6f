"""Zero-shot HellaSwag (Zellers et al., 2019; 10,042 validation examples), scored as build-nanogpt and llm.c do.

For each of an example's 4 endings, the context's tokens are followed by those of " " + ending (nothing before, no
end-of-text token) and the cross-entropy of the ending's tokens alone is summed: `acc` picks the ending with the
lowest sum, `acc_norm` the lowest mean per ending token. (lm-eval's acc_norm divides by the ending's bytes instead,
so its figures differ.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from gptlite.model.network import Transformer
from gptlite.tokenizer import Tokenizer

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_FILE = Path("data/hellaswag/hellaswag_val.jsonl")  # where the command keeps its download


def no_hellaswag_file(path: Path) -> FileNotFoundError:
    return FileNotFoundError(f"HellaSwag file {path} does not exist; download {HELLASWAG_URL} and pass its path")


def hellaswag_file(given: str) -> Path:
    """The HellaSwag file to score: the one given, or HELLASWAG_FILE, downloaded from HELLASWAG_URL once. Offline, the
    download's error says how to pass a copy."""
    from gptlite.data.download import download

    path = Path(given)
    if path.is_file():
        return path
    if path != HELLASWAG_FILE:
        raise no_hellaswag_file(path)
    try:
        return download(HELLASWAG_URL, path)
    except ConnectionError as e:
        raise ConnectionError(f"{e} with --hellaswag_file=PATH") from None


def read_hellaswag(path: str | Path, limit: int | None = None) -> list[dict]:
    """The examples of a HellaSwag JSONL file (ctx, 4 endings, label), the first `limit` of them if given; a bad
    line is a ValueError naming the file, the line and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise no_hellaswag_file(path)
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path} line {n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where} is not UTF-8 text; HellaSwag files are UTF-8 JSON lines") from None
            if not line.strip():
                continue
            rows.append(hellaswag_row(line, where))
            if limit is not None and len(rows) == limit:
                break
    if not rows:
        raise ValueError(f"{path} holds no HellaSwag examples")
    return rows


def hellaswag_row(line: str, where: str) -> dict:
    """One line of a HellaSwag file, checked: {"ctx", "endings", "label"}; errors name `where` and the field."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON ({e.msg}); HellaSwag files hold one JSON object per line") from None
    missing = [k for k in ("ctx", "endings", "label") if not isinstance(row, dict) or k not in row]
    if missing:
        raise ValueError(f"{where} has no field '{missing[0]}'; a HellaSwag row holds ctx, endings and label")
    endings = row["endings"]
    label = row["label"]
    ctx = row["ctx"]
    if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
        raise ValueError(f"{where}: endings must be a list of 4 strings, got {str(endings)[:80]}")
    if not isinstance(ctx, str) or not ctx:
        raise ValueError(f"{where}: ctx must be a non-empty string (the context the endings continue), got {ctx!r:.80}")
    if isinstance(label, bool) or str(label) not in ("0", "1", "2", "3"):
        raise ValueError(f"{where}: label must be one of 0, 1, 2, 3 (got {label!r})")
    return {"ctx": ctx, "endings": endings, "label": int(label)}


def ending_rows(tokenizer: Tokenizer, example: dict, block_size: int) -> list[tuple[list[int], int]]:
    """For each ending: (context tokens + tokens of " " + ending, cropped on the left to block_size + 1; the
    number of ending tokens at its end)."""
    ctx = tokenizer.encode(example["ctx"])
    rows = []
    for ending in example["endings"]:
        end = tokenizer.encode(" " + ending)
        rows.append(((ctx + end)[-(block_size + 1) :], min(len(end), block_size)))
    return rows


@torch.no_grad()
def ending_losses(model: Transformer, tokenizer: Tokenizer, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (sum, mean per token) cross-entropy of each example's 4 endings, each (B, 4), from one forward pass
    over the 4 x B rows, right-padded (causal attention: padding after a row changes nothing before it)."""
    rows = [row for example in examples for row in ending_rows(tokenizer, example, model.config.block_size)]
    width = max(len(tokens) for tokens, _ in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)  # (4B, L)
    ending = torch.zeros(len(rows), width, dtype=torch.bool)  # (4B, L) True on the ending's tokens
    for i, (row, n_end) in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
        ending[i, len(row) - n_end : len(row)] = True
    device = model.tok_emb.weight.device
    tokens, target = tokens.to(device), ending[:, 1:].to(device)
    hidden = model.hidden(tokens[:, :-1])[target]  # (N, C): the positions that predict an ending's token
    ce = F.cross_entropy(model.head(hidden).float(), tokens[:, 1:][target], reduction="none")  # (N,), the head
    total = torch.zeros(len(rows), device=device).index_add_(0, target.nonzero()[:, 0], ce)  # only where scored
    return total.view(-1, 4), (total / target.sum(1)).view(-1, 4)


def hellaswag(
    model: Transformer,
    tokenizer: Tokenizer,
    path: str | Path,
    limit: int | None = None,
    batch_size: int = 8,
    progress: bool = True,
) -> dict:
    """Zero-shot HellaSwag (see the module docstring) on the model's device: {"acc", "acc_norm", "n"}, fractions
    of the examples whose lowest total (acc) or per-token (acc_norm) loss is the right ending. `batch_size`
    examples go through the model at once."""
    from tqdm import tqdm

    examples = read_hellaswag(path, limit)
    # batches of examples of similar lengths pad less; the scores do not depend on the order
    examples = sorted(examples, key=lambda e: len(e["ctx"]) + max(len(x) for x in e["endings"]))
    model.eval()
    correct = correct_norm = 0
    with tqdm(total=len(examples), desc="hellaswag", unit="ex", disable=not progress, file=sys.stderr) as bar:
        for first in range(0, len(examples), batch_size):
            batch = examples[first : first + batch_size]
            total, mean = ending_losses(model, tokenizer, batch)
            labels = torch.tensor([e["label"] for e in batch], device=total.device)
            correct += int((total.argmin(1) == labels).sum())
            correct_norm += int((mean.argmin(1) == labels).sum())
            bar.update(len(batch))
    return {"acc": correct / len(examples), "acc_norm": correct_norm / len(examples), "n": len(examples)}
