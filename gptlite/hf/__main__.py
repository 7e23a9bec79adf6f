"""python -m gptlite.hf export: a training run's newest checkpoint (and its tokenizer) in Hugging Face's layout, or
any model gptlite loads as one GGUF file for llama.cpp, Ollama and LM Studio.

    python -m gptlite.hf export --model=RUN --out=DIR [--overwrite]
    python -m gptlite.hf export --model=LORA_RUN --out=DIR --adapter   # a PEFT adapter of a LoRA run
    python -m gptlite.hf export --format=gguf --model=RUN_OR_DIR --out=FILE.gguf [--type=q8_0]

--model names the model to read: for --format=hf a training run's folder; for --format=gguf anything gptlite loads (a
run's folder, a Hugging Face directory or a hub name such as gpt2). --out names what is written. The old spellings
still work: --out_dir and --init_from for --model, --hf_dir for --out.

DIR then holds exactly config.json, model.safetensors and, with the run's tokenizer, its files (a Hugging Face
tokenizer's own, GPT-2's BPE as vocab.json and merges.txt, a byte or char tokenizer as a tokenizer.json) and
generation_config.json (the ids generate() stops at), which transformers' AutoModelForCausalLM / AutoTokenizer load.
An export over a folder that holds anything needs --overwrite, and the earlier folder moves aside whole to
DIR-previous-TIME; an interrupted export leaves the earlier folder as it was. A LoRA run exports as its merged model,
or with --adapter as a PEFT adapter (adapter_config.json, adapter_model.safetensors) for its base model.

--format=gguf writes FILE.gguf (see gptlite.hf.gguf: the weights as f32, f16, bf16, q8_0 or q4_0, the tokenizer, the
chat template) and, when the model has a chat template, an Ollama Modelfile beside it (FILE.Modelfile for FILE.gguf, so
that files of several types share a folder; then `ollama create NAME -f FILE.Modelfile`). An existing file is
replaced only with --overwrite, and only by a whole one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from gptlite.checkpoint import is_run, load_checkpoint, load_model, lora_model, model_from_checkpoint
from gptlite.cli import MODEL_KINDS, model_to_read, parse, renamed_option, run_command
from gptlite.config import option
from gptlite.device import cpu_extensions
from gptlite.extras import need
from gptlite.files import write_text
from gptlite.hf import check_model_name, export_hf, family_of, gpt2_tokenizer_problem
from gptlite.hf.adapter import export_adapter
from gptlite.hf.gguf import GGUF_TYPES, check_out, export_gguf, matrix_types, modelfile_path, ollama_modelfile
from gptlite.tokenizer import TOKENIZER_FILE, load_tokenizer


@dataclass
class ExportOptions:
    command: list[str] = option(default_factory=list, help="export", positional=True)
    format: str = option(
        "hf", "hf: a Hugging Face folder; gguf: one file for llama.cpp (both written to --out)", choices=("hf", "gguf")
    )
    model: str = option(
        "", f"the model to export: a training run's folder (--format=hf: its newest checkpoint), or {MODEL_KINDS}"
    )
    out_dir: str = option("", "the old spelling of --model=RUN (still works)")
    init_from: str = option("", "the old spelling of --model=NAME_OR_DIR (still works)")
    tokenizer: str = option("", "--format=gguf: the tokenizer, when not the run's or the directory's own")
    out: str = option(
        "", "where the export goes: the folder for config.json, model.safetensors and the tokenizer files, or FILE.gguf"
    )
    hf_dir: str = option("", "the old spelling of --out=DIR for --format=hf (still works)")
    type: str = option("f32", "--format=gguf: how the weight matrices are stored", choices=GGUF_TYPES)
    overwrite: bool = option(
        False,
        "replace what --out (and a GGUF file's Modelfile) holds (an earlier folder moves aside to OUT-previous-TIME)",
    )
    adapter: bool = option(False, "a LoRA run: write its adapters as a PEFT adapter instead of the merged model")


def export(options: ExportOptions) -> int:
    if options.command != ["export"]:
        raise ValueError(
            f"unknown command {' '.join(options.command) or '(none)'}; use: python -m gptlite.hf export "
            "--model=RUN --out=DIR"
        )
    if options.format == "gguf" and options.hf_dir:
        raise ValueError("--hf_dir is --format=hf's old spelling of --out; a GGUF file goes to --out=FILE.gguf")
    model = model_to_read(options, "gptlite.hf")
    out = renamed_option(options, "out", ("hf_dir",), "gptlite.hf", "where the export goes")
    if not out:
        raise ValueError(f"--out is required: --out={'FILE.gguf' if options.format == 'gguf' else 'DIR'}")
    check_model_name(model)
    if options.format == "gguf":
        return export_gguf_file(options, model, Path(out))
    if not is_run(model):
        raise ValueError(
            f"{model} is not a gptlite run folder (no ckpt_NNNNNN.pt or ckpt.pt in it): --format=hf exports a run's "
            "checkpoint; a Hugging Face directory or hub name is in that layout already (--format=gguf takes any)"
        )
    run = Path(model)
    hf_dir = Path(out)
    if (
        os.path.realpath(hf_dir) == os.path.realpath(run)
        or Path(os.path.realpath(hf_dir)) in Path(os.path.realpath(run)).parents
    ):
        raise ValueError(
            f"--out={hf_dir} holds the run {run} itself; export to a folder that does not hold the run (e.g. "
            f"--out={run}/hf)"
        )
    ckpt = load_checkpoint(run)
    if options.adapter:
        if "lora" not in ckpt:
            raise ValueError(f"{run} is not a LoRA run (trained without --lora_rank); export it without --adapter")
        written = export_adapter(lora_model(ckpt, merge=False), hf_dir, ckpt["lora"]["base"], options.overwrite, print)
        print(f"wrote {', '.join(p.name for p in written)} to {hf_dir} (a PEFT adapter for {ckpt['lora']['base']})")
        return 0
    model = model_from_checkpoint(ckpt)
    tokenizer_file = run / TOKENIZER_FILE
    tokenizer = load_tokenizer(tokenizer_file) if tokenizer_file.is_file() else None
    problem = gpt2_tokenizer_problem(tokenizer) if tokenizer else f"no {tokenizer_file}"
    if problem:
        print(f"note: no tokenizer files are written: {problem}")
        tokenizer = None
    written = export_hf(
        model,
        hf_dir,
        tokenizer,
        overwrite=options.overwrite,
        log=print,
        architecture=ckpt.get("meta", {}).get("hf_architecture"),
    )
    family = family_of(model.config, ckpt.get("meta", {}).get("hf_architecture"))
    print(f"wrote {', '.join(p.name for p in written)} to {hf_dir} ({family.architecture})")
    return 0


def export_gguf_file(options: ExportOptions, where: str, out: Path) -> int:
    """--format=gguf: the model `where` names (--model) as the GGUF file `out`, and its Ollama Modelfile."""
    if options.adapter:
        raise ValueError("--adapter is for --format=hf; a GGUF file holds the merged model (--out=FILE.gguf)")
    need("gguf", "gguf", "GGUF export")  # before the model loads
    check_out(out, options.overwrite, f"{Path(where).name or 'model'}-{options.type}")
    template_file = modelfile_path(out)
    model, tokenizer = load_model(init_from=where, tokenizer=options.tokenizer)
    modelfile = ollama_modelfile(out, tokenizer, where) if tokenizer is not None and tokenizer.chat_template else None
    if modelfile and template_file.exists() and not options.overwrite:
        raise FileExistsError(f"{template_file} exists; choose another --out folder, or pass --overwrite to replace it")
    export_gguf(model, out, tokenizer, options.type, options.overwrite, where=where)  # Mistral is llama.cpp's llama
    print(f"wrote {out} ({out.stat().st_size / 2**20:,.1f} MiB): {matrix_types(out, options.type)}")
    if options.type == "q8_0" and "AMX" in cpu_extensions():
        print(
            "note: on this CPU (AMX), llama.cpp's AMX path crashes on q8_0 files (ggml-org/llama.cpp#20824): run "
            "llama.cpp with --no-repack (or LLAMA_ARG_REPACK=0), or export --type=f16; see docs/hf.md"
        )
    if modelfile:
        write_text(template_file, modelfile)
        print(f"wrote {template_file}: ollama create NAME -f {template_file}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command(
        "gptlite.hf",
        lambda: export(parse(ExportOptions, argv, "python -m gptlite.hf", __doc__)),
        "the export folder is as it was; run it again",
    )


if __name__ == "__main__":
    sys.exit(main())
