"""Metrics that score a model: bits per byte over token windows, and zero-shot HellaSwag accuracy.

    python -m gptlite.evaluate --out_dir=RUN [--task=val,hellaswag] [--data_dir=DIR | --text=FILE] [--json=FILE]
    python -m gptlite.evaluate --init_from=gpt2 --task=hellaswag [--hellaswag_file=PATH] [--limit=N]

Bits per byte: bpb = (sum of the target tokens' cross-entropy, in nats) / (ln 2 x the UTF-8 bytes those
tokens decode to). It does not depend on the tokenizer, so a char model and a BPE model compare. Targets that
stand for no text (the end-of-text token, and padded ids) count in neither sum, as in nanochat. Each window
of block_size tokens is scored on its own, so its first tokens see little context: bpb (and val loss) over
windows read higher than a full-context evaluation would.

HellaSwag (Zellers et al., 2019; 10,042 validation examples): zero-shot, scored as build-nanogpt and llm.c do.
For each of an example's 4 endings, the context's tokens are followed by those of " " + ending (nothing
before, no end-of-text token) and the cross-entropy of the ending's tokens alone is summed: `acc` picks the
ending with the lowest sum, `acc_norm` the lowest mean per ending token. (lm-eval's acc_norm divides by the
ending's bytes instead, so its figures differ.)
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gptlite.cli import parse, run_command
from gptlite.config import DTYPE_CHOICES, option
from gptlite.data import Loader
from gptlite.device import pick_device, pick_dtype
from gptlite.files import fault
from gptlite.model import GPT
from gptlite.tokenizer import Tokenizer

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_FILE = Path("data/hellaswag/hellaswag_val.jsonl")  # where the command keeps its download


# ---------------------------------------------------------------------------------------------
# Bits per byte


def byte_lengths(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) the UTF-8 bytes of each id's text, built once: 0 for the end-of-text token and for ids past
    the tokenizer's vocabulary (a padded model vocabulary)."""
    lengths = torch.zeros(vocab_size, dtype=torch.long)
    n = min(vocab_size, tokenizer.vocab_size)
    lengths[:n] = torch.tensor([len(tokenizer.token_bytes([i])) for i in range(n)])
    if tokenizer.eot_id is not None and tokenizer.eot_id < vocab_size:
        lengths[tokenizer.eot_id] = 0
    return lengths


def loss_sums(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Sums over a batch, x and y (B, T): (cross-entropy of every target in nats, targets, cross-entropy of the
    targets that decode to bytes, those bytes); the last two are 0 without `lengths` (see byte_lengths). Targets of
    -1 (a conversation's non-assistant tokens, padding) count nowhere."""
    logits, _ = model(x)  # (B, T, V)
    y = y.flatten()  # (B*T,)
    ce = F.cross_entropy(logits.float().flatten(0, 1), y, ignore_index=-1, reduction="none")  # (B*T,), 0 where -1
    sums = torch.stack([ce.sum(), (y >= 0).sum().float()])
    if lengths is None:
        return torch.cat([sums, torch.zeros(2, device=ce.device)])
    nbytes = torch.where(y >= 0, lengths[y.clamp_min(0)], 0)  # (B*T,)
    text = torch.where(nbytes > 0, ce, torch.zeros_like(ce)).sum()
    return torch.cat([sums, torch.stack([text, nbytes.sum().float()])])


def loss_and_bpb(sums: torch.Tensor) -> tuple[float, float | None]:
    """(mean loss per target, bits per byte or None) from accumulated `loss_sums`."""
    loss, n, text, nbytes = sums.tolist()
    return loss / n, (text / (math.log(2) * nbytes) if nbytes else None)


@torch.no_grad()
def evaluate_loader(
    model: torch.nn.Module,
    loader: Loader,
    iters: int,
    device: str,
    autocast: contextlib.AbstractContextManager,
    lengths: torch.Tensor | None,
) -> tuple[float, float | None]:
    """Mean loss per target token and bits per byte (None without the tokens' byte `lengths`, see byte_lengths) of
    a loader's split, as training reports its val loss: over the first `iters` global batches (the same batches at
    every evaluation), or over every window of the split when iters=0. Under torchrun each rank scores its slice
    and the sums are all-reduced, so every rank gets the same figures."""
    import torch.distributed as dist

    model.eval()
    loader.restore({"epoch": 0, "shard": 0, "index": 0})
    batches = loader.every_window() if iters == 0 else (loader.next_batch() for _ in range(iters))
    sums = torch.zeros(4, device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # (B, T) each
        with autocast:
            sums += loss_sums(model, x, y, lengths)
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    return loss_and_bpb(sums)


@torch.no_grad()
def evaluate_windows(
    model: GPT,
    streams: list[torch.Tensor],
    batch_size: int = 8,
    lengths: torch.Tensor | None = None,
    progress: bool = False,
) -> tuple[float, float | None, int]:
    """(loss, bpb, targets scored) over every non-overlapping window of block_size + 1 tokens of each 1-D token
    stream (a val shard, a text), its last and shorter window included; windows never cross streams."""
    from tqdm import tqdm

    T = model.config.block_size
    device = model.tok_emb.weight.device
    windows = [tokens[s : s + T + 1] for tokens in streams for s in range(0, len(tokens) - 1, T)]
    sums = torch.zeros(4, device=device)
    lengths = None if lengths is None else lengths.to(device)
    model.eval()
    for first in tqdm(range(0, len(windows), batch_size), desc="windows", disable=not progress, file=sys.stderr):
        batch = windows[first : first + batch_size]
        for size in {len(w) for w in batch}:  # a stream's last window may be shorter: a forward of its own
            x = torch.stack([w for w in batch if len(w) == size]).to(device)  # (B, size)
            sums += loss_sums(model, x[:, :-1], x[:, 1:], lengths)
    loss, bpb = loss_and_bpb(sums)
    return loss, bpb, int(sums[1].item())


# ---------------------------------------------------------------------------------------------
# HellaSwag


def no_hellaswag_file(path: Path) -> FileNotFoundError:
    return FileNotFoundError(f"HellaSwag file {path} does not exist; download {HELLASWAG_URL} and pass its path")


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
def ending_losses(model: GPT, tokenizer: Tokenizer, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
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
    ce = F.cross_entropy(model.lm_head(hidden).float(), tokens[:, 1:][target], reduction="none")  # (N,), the head
    total = torch.zeros(len(rows), device=device).index_add_(0, target.nonzero()[:, 0], ce)  # only where scored
    return total.view(-1, 4), (total / target.sum(1)).view(-1, 4)


def hellaswag(
    model: GPT,
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


# ---------------------------------------------------------------------------------------------
# The command


@dataclass
class EvaluateOptions:
    out_dir: str = option("", "a training run (its newest checkpoint and tokenizer)")
    init_from: str = option("", "pretrained weights instead: gpt2[-medium|-large|-xl] or a Hugging Face directory")
    tokenizer: str = option(
        "", "a tokenizer.json, .tiktoken file or tiktoken name (default: the run's; GPT-2's BPE for GPT-2)"
    )
    task: str = option("val", "comma-separated: val, hellaswag")
    data_dir: str = option("", "val: the shards whose val split to score (default: the run's)")
    text: str = option("", "val: score this text file instead of val shards")
    hellaswag_file: str = option(
        str(HELLASWAG_FILE), f"hellaswag_val.jsonl (downloaded from {HELLASWAG_URL} when missing)"
    )
    limit: int | None = option(None, "hellaswag: the first N examples only")
    batch_size: int = option(8, "windows (val) or examples (hellaswag) per forward")
    device: str = option("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    dtype: str = option(
        "auto",
        "weights' precision; auto = bfloat16 on CUDA, float32 elsewhere",
        choices=DTYPE_CHOICES,
    )
    json: str = option("", "also write the results to this JSON file")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        args = parse(EvaluateOptions, argv, "python -m gptlite.evaluate", __doc__)
        results = run(args)
        if args.json:
            tmp = Path(f"{args.json}.tmp")
            try:
                tmp.write_text(json.dumps(results, indent=1) + "\n")
                tmp.replace(args.json)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise fault(e, f"could not write {args.json}") from None
        return 0

    return run_command("gptlite.evaluate", body, "nothing was written")


def check(args: EvaluateOptions) -> list[str]:
    """Every argument, checked before the model loads: the tasks."""
    tasks = args.task.split(",")
    problems = [f"--task: unknown {t!r} (val, hellaswag)" for t in tasks if t not in ("val", "hellaswag")]
    if bool(args.out_dir) == bool(args.init_from):
        problems.append("give one of --out_dir=RUN or --init_from=NAME_OR_DIR")
    if (args.limit is not None and args.limit < 1) or args.batch_size < 1:
        problems.append(f"--limit={args.limit} and --batch_size={args.batch_size} must be >= 1")
    if "val" in tasks and args.init_from and not (args.data_dir or args.text):
        problems.append("--task=val with --init_from needs --data_dir=DIR or --text=FILE")
    if args.text and not Path(args.text).is_file():
        problems.append(f"text file {args.text} does not exist")
    folder = Path(args.json).parent if args.json else None
    if folder is not None and not folder.is_dir():
        problems.append(f"--json={args.json}: folder {folder} does not exist; create it or write the results elsewhere")
    elif args.json and Path(args.json).exists() and not earlier_results(Path(args.json)):
        problems.append(
            f"--json={args.json} exists and is not an earlier result of this command (an input, a "
            "checkpoint?); write the results to another file"
        )
    if problems:
        raise ValueError("; ".join(problems))
    return tasks


def earlier_results(path: Path) -> bool:
    """True if path holds what --json writes (a JSON object naming the model, device and dtype): only such a file
    is replaced, never an input or a checkpoint given there by mistake."""
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(results, dict) and {"model", "device", "dtype"} <= results.keys()


def run(args: EvaluateOptions) -> dict:
    """The command's work: check every argument, load the model once, run each task, print one line per task."""
    from gptlite.checkpoint import load_model

    tasks = check(args)
    if "hellaswag" in tasks:  # its file, downloaded if need be, before any task spends minutes
        hellaswag_path = hellaswag_file(args.hellaswag_file)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    model, tokenizer = load_model(args.out_dir, args.init_from, args.tokenizer)
    model = model.to(device, getattr(torch, dtype)).eval()
    results = {"model": args.out_dir or args.init_from, "device": device, "dtype": dtype}
    for task in tasks:
        start = time.perf_counter()
        if task == "val":
            loss, bpb, n, what = score_val(args, model, tokenizer)
            seconds = time.perf_counter() - start
            results["val"] = {"loss": loss, "bpb": bpb, "tokens": n, "on": what, "seconds": seconds}
            print(
                f"val: loss {loss:.4f} | bpb {'n/a' if bpb is None else f'{bpb:.4f}'} | {n:,} tokens of {what} | "
                f"{seconds:.1f} s"
            )
        else:
            scores = hellaswag(model, tokenizer, hellaswag_path, args.limit, args.batch_size)
            seconds = time.perf_counter() - start
            results["hellaswag"] = {**scores, "seconds": seconds}
            print(
                f"hellaswag: acc {scores['acc']:.4f} | acc_norm {scores['acc_norm']:.4f} | {scores['n']:,} examples "
                f"| {seconds:.1f} s ({1000 * seconds / scores['n']:.0f} s per 1,000)"
            )
    return results


def hellaswag_file(given: str) -> Path:
    """The HellaSwag file to score: the one given, or HELLASWAG_FILE, downloaded from HELLASWAG_URL once. Offline, the
    download's error says how to pass a copy."""
    from gptlite.download import download

    path = Path(given)
    if path.is_file():
        return path
    if path != HELLASWAG_FILE:
        raise no_hellaswag_file(path)
    try:
        return download(HELLASWAG_URL, path)
    except ConnectionError as e:
        raise ConnectionError(f"{e} with --hellaswag_file=PATH") from None


def score_val(args: EvaluateOptions, model: GPT, tokenizer: Tokenizer) -> tuple[float, float | None, int, str]:
    """(loss, bpb, tokens scored, what was scored) of --text or of the val split of --data_dir (default: the run's)."""
    if args.text:
        ids = tokenizer.encode(Path(args.text).read_text(encoding="utf-8", errors="replace"))
        if len(ids) < 2:
            raise ValueError(
                f"text file {args.text} gives {len(ids)} token(s); scoring needs at least 2 (one to predict "
                "from, one to predict)"
            )
        streams, what = [torch.tensor(ids)], args.text
    else:
        from gptlite.checkpoint import load_checkpoint
        from gptlite.data import check_vocab, find_shards, read_shard

        data_dir = args.data_dir or load_checkpoint(args.out_dir)["config"]["data_dir"]
        files = find_shards(data_dir, "val")
        check_vocab(files, model.config.vocab_size, fix="score data prepared with the model's own tokenizer")
        streams = [torch.from_numpy(read_shard(p).astype("int64")) for p in files]
        what = f"{data_dir} val split"
    lengths = byte_lengths(tokenizer, model.config.vocab_size)
    loss, bpb, n = evaluate_windows(model, streams, args.batch_size, lengths, progress=True)
    return loss, bpb, n, what


if __name__ == "__main__":
    sys.exit(main())
