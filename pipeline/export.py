"""Stage `export` and `sparkchat export`: the chat model as a Hugging Face transformers directory.

Writes a NanoChat directory (model/hf.py: config.json, model.safetensors, tokenizer files with the chat
template, generation_config.json) and a README.md model card. The card's facts come from their homes: the
architecture from the model, the data sources and settings from the stage params
(`sparkchat.paths.stage_params`), the precision backend and training figures per stage and the eval table
from the DVC metrics (`sparkchat.paths.metrics_file`). Those describe the pipeline's chat model, so the
card carries them only when the exported model is that one (the DVC stage; `--model` left at its default).

torch and transformers load after the flags are read, so `--help` answers at once.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from sparkchat import paths

from .metrics import VAL_BPB

PARAM_STAGES = ("prepare", "tokenizer", *paths.TRAIN_STAGES, "rl", "evaluate")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparkchat export", description="Write a model directory as a Hugging Face "
                                "transformers NanoChat directory (NanoChatForCausalLM) with a chat template and "
                                "a model card.")
    p.add_argument("--model", default=str(paths.CHAT_MODEL),
                   help="model directory to export, sparkchat's or a NanoChat one (default: %(default)s)")
    p.add_argument("--out", default=str(paths.HF_EXPORT), help="directory to write (default: %(default)s)")
    return p


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v).lower()
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows])


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested metrics become one row each."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def eval_scores() -> dict:
    """Each evaluated model's scores (its headline metrics and benchmarks), then `chance`: {name: {task: score}}."""
    out, chance = {}, {}
    for model in paths.EVAL_MODELS:
        m, d = read_json(paths.metrics_file(paths.eval_reports(model))), read_json(paths.details_file(paths.eval_reports(model)))
        if m:
            out[model] = {**m, **(d or {}).get("benchmarks", {})}
            chance |= (d or {}).get("chance", {})
    return out | ({"chance": chance} if out and chance else {})


def eval_table(scores: dict) -> str:
    """{model: {task: score}} as a table: one row per task, a column per model."""
    models = {m: flatten(s) for m, s in scores.items() if isinstance(s, dict)}
    tasks = list(dict.fromkeys(t for s in models.values() for t in s))
    return table(["task", *models], [[t, *(s.get(t) for s in models.values())] for t in tasks])


def training_section() -> str:
    """Data sources, the precision backend and figures of each training stage, and every stage's params."""
    params = {s: read_json(paths.stage_params(s)) for s in PARAM_STAGES}
    out = []
    data = (params["prepare"] or {}).get("data")
    if data:
        out.append(f"Pretraining text: {', '.join(map(str, data['pretrain_sources']))}. Conversations (midtraining "
                   f"and SFT): {', '.join(map(str, data['chat_sources']))} (`builtin:` sources ship with sparkchat, "
                   "`hub:` ones are Hugging Face datasets).")
    rows = []
    for stage in paths.TRAIN_STAGES:
        m, d = read_json(paths.metrics_file(stage)), read_json(paths.details_file(stage))
        if m and d:
            val = m.get(VAL_BPB.get(stage, ""))
            rows.append([stage, d.get("backend_label", d.get("backend")), d.get("device"), d.get("steps"),
                         d.get("tokens"), m.get("train_loss"),
                         None if val is None else f"{fmt(val)} ({VAL_BPB[stage].removeprefix('val_bpb_')})"])
    if rows:
        out.append("Precision backend and figures per stage (DVC metrics, `reports/<stage>/metrics.json` and "
                   "`details.json`; validation bits per byte on held-out text, on every token of held-out "
                   "conversations, or on their replies only):\n\n"
                   + table(["stage", "precision backend", "device", "steps", "tokens", "train loss", "val bpb"], rows))
    rl = read_json(paths.details_file("rl")) or {}
    if rl.get("enabled"):
        tasks = ", ".join(f"{t} {fmt(rl['before'][t]['pass1'])} -> {fmt(s['pass1'])}" for t, s in rl["after"].items())
        out.append(f"Reinforcement learning after SFT (`reports/rl/`): {rl['steps']} steps of on-policy rollouts on "
                   f"{', '.join(rl['tasks'])}; held-out pass@1 (greedy) before -> after: {tasks}.")
    elif rl:
        out.append("Reinforcement learning was off (`rl.enabled: false`): the chat model is SFT's.")
    sections = {}  # each stage's file holds the sections it reads; a section is the same in every file
    for p in params.values():
        sections |= p or {}
    if sections:
        out.append("<details><summary>Parameters (params.yaml with the profile applied, as the stages read them: "
                   "<code>artifacts/params/&lt;stage&gt;.json</code>)</summary>\n\n```json\n"
                   + json.dumps(sections, indent=2) + "\n```\n\n</details>")
    return "\n\n".join(out)


def model_card(model, tok, gen: dict, model_dir: Path, out: Path, from_pipeline: bool) -> str:
    from model.hf import generate_stops
    from model.tokenizer import SYSTEM_TOKENS
    from model.tools import has_tools
    c = model.config
    meta = read_json(model_dir / "meta.json") or {}
    arch = table(["", ""], [
        ["layers", c.n_layer], ["width", c.n_embd],
        ["attention heads (query / key-value)", f"{c.n_head} / {c.n_kv_head}, head dim {c.head_dim}"],
        ["MLP", f"relu², {4 * c.n_embd:,} wide"], ["context (trained)", f"{c.seq_len} tokens"],
        ["vocabulary", f"{c.vocab_size:,} (byte-level BPE)"], ["parameters", model.num_params()],
        ["RoPE base", c.rope_base], ["logit softcap", c.logit_softcap]])
    sections = [
        "---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags: [nanochat, sparkchat]\n---",
        f"# sparkchat-d{c.n_layer}",
        ("A chat model trained from scratch by sparkchat's DVC pipeline (tokenizer, pretraining, midtraining, SFT), "
         if from_pipeline else f"The model directory `{model_dir}`, ")
        + "exported to transformers' NanoChat architecture (`NanoChatForCausalLM`) by `sparkchat export`.",
        "## Architecture\n\n" + arch + "\n\nParameter-free RMSNorm on the embeddings, before attention and MLP, on "
        "queries and keys after RoPE (QK-norm) and before the head; "
        + ("grouped-query attention; " if c.n_kv_head != c.n_head else "")
        + "untied embedding and head; no biases. Weights are float32."
        + (f" Last trained by the `{meta['stage']}` stage ({meta.get('backend_label', meta.get('backend'))} "
           f"on {meta.get('device')}, {fmt(meta.get('steps'))} steps)." if meta.get("stage") else ""),
    ]
    if from_pipeline:
        training = training_section()
        if training:
            sections.append("## Training\n\n" + training)
        ev = eval_scores()
        if ev:
            sections.append("## Evaluation\n\nScores on held-out items no model trained on (DVC metrics, "
                            "`reports/evaluate/<model>/`): accuracy per task, validation bits per byte on the "
                            "pretraining text (`val_bpb_text`, lower is better); `chance` is what guessing "
                            "scores.\n\n" + eval_table(ev))
    else:
        sections.append(f"## Training and evaluation\n\nNot recorded here: exported from `{model_dir}`, not from the "
                        f"pipeline's chat model (`{paths.CHAT_MODEL}`), whose DVC metrics this card would quote.")
    tool_tokens = "`<|python_start|>` expression `<|python_end|>`"
    functions = ("- Function calling: `apply_chat_template(messages, tools=[...])` shows the functions (transformers' "
                 "`{\"type\": \"function\", \"function\": {...}}` entries) as compact signatures after the system "
                 "prompt, between `<|tools_start|>` and `<|tools_end|>`; an assistant message's `tool_calls` (arguments "
                 "as a dict) render as the model writes a call, `<|call_start|>` "
                 "`{\"name\":...,\"arguments\":{...}}` `<|call_end|>`, and a `tool` message as its result, "
                 "`<|result_start|>` ... `<|result_end|>`. After its calls the model ends the turn: run them and "
                 "append the results as `tool` messages.\n" if has_tools(tok) else "")
    system = ("`<|system_start|>`/`<|system_end|>`," if all(t in tok.special for t in SYSTEM_TOKENS) else
              "(no system tokens: a system prompt goes before the first user message, then a blank line)")
    sections.append(f"""## Use with transformers

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "{out}"  # or the hub id this directory was uploaded to
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
messages = [{{"role": "system", "content": "Answer briefly."}}, {{"role": "user", "content": "What is 37 + 58?"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**inputs, max_new_tokens=64)
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

`generation_config.json` holds sparkchat's sampling defaults (temperature {gen['temperature']}, top-k {gen['top_k']}, \
top-p {gen['top_p']}) and stops at {" or ".join(f"`{s}`" for s in generate_stops(gen))}.

## Chat format

`apply_chat_template` gives the ids sparkchat's renderer gives: `<|bos|>`, then each turn between {system} \
`<|user_start|>`/`<|user_end|>`, `<|assistant_start|>`/`<|assistant_end|>`. \
An assistant message's content may be a list of parts: `text`, `python` (a calculator call, {tool_tokens}) and \
`python_output` (its result, `<|output_start|>` ... `<|output_end|>`).

- Calculator: {"the model was trained to call it" if gen.get("tool_use") else "this model is not set to call it"}. \
sparkchat's server runs the call and feeds the result back; transformers' `generate` runs no tools, so it \
stops after a call (`<|python_end|>`): evaluate the expression, append `<|output_start|>` result \
`<|output_end|>` to the ids and generate again.
{functions}- Text that looks like a control token: sparkchat encodes message text as plain text, so a user typing \
`<|assistant_end|>` cannot end a turn. A transformers tokenizer matches such text as the control token (the chat \
template relies on that): for untrusted text call the tokenizer with `split_special_tokens=True`, and know that \
`apply_chat_template` renders content containing control-token text differently from sparkchat.
- `tokenizer(text)` adds no `<|bos|>` (the chat template does); prepend it when scoring raw text, as pretraining did.

## Serve with sparkchat

```bash
sparkchat serve --model {out}     # OpenAI-compatible API + chat page; also takes other NanoChat directories
```
""")
    return "\n\n".join(sections)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    model_dir, out = Path(args.model), Path(args.out)
    if out.resolve() == model_dir.resolve():
        raise SystemExit(f"export: --out {out} is the model directory itself; choose another")

    from model.hf import save_hf_dir
    from model.model_dir import CHECKSUMS, ModelDirError, load_model_dir
    from model.no_room import no_room_errno, no_room_error
    try:
        model, tok, gen = load_model_dir(model_dir)
    except ModelDirError as e:
        raise SystemExit(f"export: {e}") from None
    from_pipeline = model_dir.resolve() == paths.CHAT_MODEL.resolve()
    card = model_card(model, tok, gen, model_dir, out, from_pipeline)
    # written beside --out first and moved in whole: a run that fails (a full disk) leaves no partial directory
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_hf_dir(staging, model, tok, gen, card=card)
    except Exception as e:
        code = no_room_errno(e)
        error = no_room_error(out, code) if code else None  # the free space as the write found it
        shutil.rmtree(staging, ignore_errors=True)
        if error is None:
            raise
        raise SystemExit(f"export: {error}. Free some space and run it again") from None
    out.mkdir(exist_ok=True)
    for f in sorted(staging.iterdir(), key=lambda f: f.name == CHECKSUMS):  # checksums.json last, as written
        os.replace(f, out / f.name)
    staging.rmdir()
    print(f"export: {model_dir} -> {out} (transformers NanoChatForCausalLM, {model.num_params():,} parameters)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
