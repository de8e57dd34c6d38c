"""sparkchat's GPT as a Hugging Face transformers NanoChat model, both ways.

transformers (5.x) has nanochat's architecture built in (`NanoChatForCausalLM`), and sparkchat's GPT
(model/gpt.py) is the same network, so a model directory converts by renaming weights:

    sparkchat (model/gpt.py)             transformers (modeling_nanochat.py)
    wte                                  model.embed_tokens
    blocks.i.attn.c_qkv  (q; k; v rows)  model.layers.i.self_attn.{q,k,v}_proj  (split by GPTConfig.qkv_rows)
    blocks.i.attn.c_proj                 model.layers.i.self_attn.o_proj
    blocks.i.mlp.c_fc / c_proj           model.layers.i.mlp.fc1 / fc2            (hidden_act relu2, 4x width)
    lm_head (untied)                     lm_head                                 (tie_word_embeddings false)
    rope_base                            rope_parameters.rope_theta (default RoPE, same half-split rotation)
    logit_softcap                        final_logit_softcapping
    parameter-free RMSNorm (F.rms_norm)  NanoChatRMSNorm (no weight), also on the embeddings, RoPE then QK-norm

F.rms_norm's epsilon is the input dtype's (float32: 1.19e-7); the export writes that as `rms_norm_eps`, so in
float32 the two forwards agree to rounding (tests/test_hf.py). A NanoChat directory from elsewhere (1e-6 is
transformers' default) loads with sparkchat's epsilon: a relative difference of about 1e-6 in each norm.

An exported directory holds what transformers reads (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json), a README.md model card when the
caller passes one, and checksums.json, written last, so sparkchat verifies it as it does its own
directories (model/model_dir.py). `load_hf_dir` reads a NanoChat directory (exported, or published) back
into sparkchat's GPT, tokenizer and generation defaults; `load_model_dir` calls it for such directories,
so the server, the terminal chat and evaluation take either kind.

The chat template renders exactly what model/chat.py's `render` does (tests/test_hf.py compares ids). One
difference stays in the tokenizer: sparkchat encodes text as text (SparkTokenizer sets
encode_special_tokens), while a transformers tokenizer matches control-token text such as
"<|assistant_end|>" inside a string as the control token, which apply_chat_template relies on. For
untrusted text call the tokenizer with `split_special_tokens=True`; message content that contains
control-token text renders differently through apply_chat_template than through sparkchat. And
transformers' `generate` does not run the calculator tool that sparkchat's engine runs.

nanochat's own tokenizer (in a published NanoChat checkpoint) has no system tokens: model/chat.py then
puts a system prompt before the first user message, as nanochat does, and so does the template.

transformers is imported inside the functions that need it, so loading a sparkchat directory never pays
for it.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .chat import STOP_TOKENS
from .gpt import GPT, GPTConfig
from .model_info import DEFAULT_GENERATION
from .model_dir import (CHECKSUMS, WEIGHTS, WEIGHTS_INDEX, ModelDirError, build_model,
                        file_record, portable_state_dict, write_atomic)
from .tokenizer import SYSTEM_TOKENS, TOOL_TOKENS, SparkTokenizer

log = logging.getLogger(__name__)

MODEL_TYPE = "nanochat"
ARCHITECTURE = "NanoChatForCausalLM"
GENERATION_CONFIG = "generation_config.json"
CARD = "README.md"
# F.rms_norm without eps uses the input dtype's epsilon; the weights are float32
NORM_EPS = torch.finfo(torch.float32).eps
BOS, EOS = "<|bos|>", "<|assistant_end|>"
# padding with <|bos|> (never a training target) leaves <|assistant_end|> in the labels of HF fine-tuning
# collators, which mask the pad id
PAD = BOS


# ---- weights ----

def to_hf_state_dict(sd: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """sparkchat's weight names -> NanoChatForCausalLM's (the fused q/k/v projection split in three)."""
    out = {"model.embed_tokens.weight": sd["wte.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i in range(config.n_layer):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = sd[src + "attn.c_qkv.weight"].split(config.qkv_rows)
        out |= {dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v, dst + "self_attn.o_proj.weight": sd[src + "attn.c_proj.weight"],
                dst + "mlp.fc1.weight": sd[src + "mlp.c_fc.weight"],
                dst + "mlp.fc2.weight": sd[src + "mlp.c_proj.weight"]}
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: GPTConfig, tied: bool = False) -> dict[str, torch.Tensor]:
    """NanoChatForCausalLM's weight names -> sparkchat's. A missing weight is a ModelDirError naming it;
    with `tied`, the head is the embedding (tie_word_embeddings)."""
    def take(name):
        if name not in sd:
            raise ModelDirError(f"the weights lack {name}")
        return sd.pop(name)

    out = {"wte.weight": take("model.embed_tokens.weight")}
    out["lm_head.weight"] = out["wte.weight"] if tied else take("lm_head.weight")
    for i in range(config.n_layer):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        out[dst + "attn.c_qkv.weight"] = torch.cat([take(src + f"self_attn.{n}_proj.weight") for n in "qkv"])
        out[dst + "attn.c_proj.weight"] = take(src + "self_attn.o_proj.weight")
        out[dst + "mlp.c_fc.weight"] = take(src + "mlp.fc1.weight")
        out[dst + "mlp.c_proj.weight"] = take(src + "mlp.fc2.weight")
    if sd:
        raise ModelDirError(f"the weights hold {len(sd)} tensors sparkchat's GPT has no place for, "
                            f"e.g. {next(iter(sd))}")
    return out


# ---- config ----

def hf_config(config: GPTConfig, tok: SparkTokenizer):
    """The transformers NanoChatConfig of a sparkchat GPT."""
    from transformers import NanoChatConfig
    cfg = NanoChatConfig(
        vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=4 * config.n_embd,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
        max_position_embeddings=config.seq_len, hidden_act="relu2", rms_norm_eps=NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_base)},
        final_logit_softcapping=float(config.logit_softcap), attention_bias=False, tie_word_embeddings=False,
        bos_token_id=tok.special[BOS], eos_token_id=tok.special[EOS], pad_token_id=tok.special[PAD])
    cfg.architectures = [ARCHITECTURE]
    cfg.dtype = torch.float32
    return cfg


def gpt_config(cfg) -> GPTConfig:
    """A NanoChatConfig -> GPTConfig, refusing (ModelDirError naming the key) what sparkchat's GPT cannot run."""
    def need(ok: bool, key: str, why: str):
        if not ok:
            raise ModelDirError(f"config.json: {key}={getattr(cfg, key, None)!r}, but {why}")

    need(cfg.hidden_act == "relu2", "hidden_act", "sparkchat's MLP is relu^2")
    need(cfg.intermediate_size == 4 * cfg.hidden_size, "intermediate_size", "sparkchat's MLP is 4x the width")
    need(not cfg.attention_bias, "attention_bias", "sparkchat's projections have no bias")
    need(cfg.final_logit_softcapping is not None, "final_logit_softcapping", "sparkchat caps the logits")
    rope = cfg.rope_parameters or {}
    need(rope.get("rope_type", "default") == "default", "rope_parameters", "sparkchat has the default RoPE only")
    head_dim = getattr(cfg, "head_dim", None)
    need(head_dim in (None, cfg.hidden_size // cfg.num_attention_heads), "head_dim",
         "sparkchat's head dimension is hidden_size / num_attention_heads")
    if abs(cfg.rms_norm_eps - NORM_EPS) > 1e-12:
        log.info("config.json: rms_norm_eps=%g; sparkchat's norm uses float32's epsilon (%g), as nanochat does",
                 cfg.rms_norm_eps, NORM_EPS)
    try:
        return GPTConfig(vocab_size=cfg.vocab_size, n_layer=cfg.num_hidden_layers, n_embd=cfg.hidden_size,
                         n_head=cfg.num_attention_heads, n_kv_head=cfg.num_key_value_heads,
                         seq_len=cfg.max_position_embeddings, rope_base=float(rope["rope_theta"]),
                         logit_softcap=float(cfg.final_logit_softcapping))
    except (ValueError, KeyError) as e:
        raise ModelDirError(f"config.json: {e}") from None


# ---- generation defaults ----

def generate_stops(gen: dict) -> tuple[str, ...]:
    """The tokens transformers' `generate` stops at: the end of the reply, and with the calculator
    (`tool_use`) the end of a call too. generate runs no tool, so it hands the call back: the caller
    evaluates it, appends <|output_start|>result<|output_end|> and generates on (sparkchat's engine does so itself)."""
    return STOP_TOKENS + (("<|python_end|>",) if gen.get("tool_use") else ())


def generation_config(gen: dict, tok: SparkTokenizer):
    """transformers' GenerationConfig holding sparkchat's sampling defaults (generation.json) and stop tokens
    (generate_stops). `tool_use` rides along for sparkchat's server: transformers ignores it."""
    from transformers import GenerationConfig
    greedy = float(gen["temperature"]) == 0.0
    sampling = {} if greedy else {"temperature": float(gen["temperature"]), "top_k": int(gen["top_k"] or 0),
                                  "top_p": float(gen["top_p"])}
    return GenerationConfig(do_sample=not greedy, **sampling, max_new_tokens=int(gen["max_tokens"]),
                            bos_token_id=tok.special[BOS], pad_token_id=tok.special[PAD],
                            eos_token_id=[tok.special[t] for t in generate_stops(gen)], tool_use=bool(gen.get("tool_use")))


def generation_defaults(path: Path, tok: SparkTokenizer) -> dict:
    """sparkchat's generation defaults from a directory's generation_config.json: the keys it sets override
    DEFAULT_GENERATION. Without `tool_use`, the calculator runs when the tokenizer has its tokens (nanochat's
    models are trained to call it)."""
    gen = dict(DEFAULT_GENERATION, tool_use=all(t in tok.special for t in ("<|python_start|>", "<|python_end|>",
                                                                           "<|output_start|>", "<|output_end|>")))
    f = path / GENERATION_CONFIG
    if not f.is_file():
        return gen
    try:
        g = json.loads(f.read_text())
        if g.get("do_sample") is False:
            gen["temperature"] = 0.0
        elif "temperature" in g:
            gen["temperature"] = float(g["temperature"])
        for ours, theirs in (("top_k", "top_k"), ("top_p", "top_p"), ("max_tokens", "max_new_tokens"),
                             ("tool_use", "tool_use")):
            if g.get(theirs) is not None:
                gen[ours] = type(DEFAULT_GENERATION[ours])(g[theirs])
    except (ValueError, TypeError, AttributeError) as e:
        raise ModelDirError(f"model directory {path}: {GENERATION_CONFIG} cannot be read ({e})") from None
    return gen


# ---- chat template ----

def chat_template(tok: SparkTokenizer) -> str:
    """A Jinja chat template rendering what model.chat.render renders: <|bos|>, each turn between its
    tokens, assistant text, calculator calls (python parts) and their outputs (python_output parts),
    and <|assistant_start|> for add_generation_prompt. Without system tokens (nanochat's tokenizer) a
    system prompt goes before the first user message, as render does. Bad conversations raise, as render does.

    Function calling as model/tools.py renders it: `tools` (transformers' {"type": "function", "function":
    {...}} entries, or {"name", "parameters"}) as compact signatures after the system prompt; an assistant
    message's `tool_calls` (or "call" parts) as compact JSON calls; `tool` messages as results. A call's
    `arguments` as a dict renders as render does; as a string (OpenAI's wire form), as given."""
    flag = "true" if all(t in tok.special for t in SYSTEM_TOKENS) else "false"
    tool_flag = "true" if all(t in tok.special for t in TOOL_TOKENS) else "false"
    return ("{%- set system_tokens = " + flag + " -%}{%- set tool_tokens = " + tool_flag + " -%}" + r"""
{%- if messages | length == 0 -%}{{ raise_exception('messages must be a non-empty list') }}{%- endif -%}
{%- macro text_of(content) -%}
  {%- if content is string -%}{{ content }}
  {%- else -%}{%- for part in content -%}
    {%- if part['type'] not in ['text', 'python', 'python_output', 'call'] -%}{{ raise_exception('unsupported content part: ' ~ part['type']) }}{%- endif -%}
    {%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}
  {%- endfor -%}{%- endif -%}
{%- endmacro -%}
{#- model/tools.py's signature: name(arg:type,optional?:type), enum values as JSON, list[items] -#}
{%- macro type_of(schema) -%}
  {%- set names = {'string': 'str', 'integer': 'int', 'number': 'num', 'boolean': 'bool', 'array': 'list', 'object': 'obj', 'null': 'null'} -%}
  {%- if schema is not mapping -%}any
  {%- elif 'enum' in schema -%}{%- for v in schema['enum'] -%}{{ '|' if not loop.first }}{{ v | tojson(ensure_ascii=True, separators=(',', ':')) }}{%- endfor -%}
  {%- else -%}
    {%- set t = schema.get('type', 'any') -%}
    {%- if t is not string and t is iterable -%}{%- for x in t -%}{{ '|' if not loop.first }}{{ names.get(x, x | string) }}{%- endfor -%}
    {%- elif t == 'array' and schema.get('items') is mapping -%}list[{{ type_of(schema['items']) }}]
    {%- else -%}{{ names.get(t, t | string) }}
    {%- endif -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro tools_block() -%}
  {{- '<|tools_start|>' -}}
  {%- for tool in tools -%}
    {%- set f = tool['function'] if 'function' in tool else tool -%}
    {%- set params = f.get('parameters') or {} -%}
    {%- set required = params.get('required') or [] -%}
    {{- ';' if not loop.first }}{{ f['name'] }}(
    {%- for k, v in (params.get('properties') or {}).items() -%}
      {{- ',' if not loop.first }}{{ k }}{{ '' if k in required else '?' }}:{{ type_of(v) }}
    {%- endfor -%})
  {%- endfor -%}
  {{- '<|tools_end|>' -}}
{%- endmacro -%}
{%- macro call_of(name, arguments) -%}
  {%- if arguments is string -%}{{ '{"name":' ~ (name | tojson(ensure_ascii=False)) ~ ',"arguments":' ~ arguments ~ '}' }}
  {%- else -%}{{ {'name': name, 'arguments': arguments} | tojson(ensure_ascii=False, separators=(',', ':')) }}
  {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(prefix='', uses_tools=(tools is defined and tools is not none and tools | length > 0)) -%}
{%- set has_tools = ns.uses_tools -%}
{%- for message in messages -%}
  {%- if message['role'] == 'tool' or message.get('tool_calls') -%}{%- set ns.uses_tools = true -%}{%- endif -%}
  {%- if message['content'] is not string and message['content'] is iterable -%}{%- for part in message['content'] -%}
    {%- if message['role'] == 'assistant' and part['type'] == 'call' -%}{%- set ns.uses_tools = true -%}{%- endif -%}
  {%- endfor -%}{%- endif -%}
{%- endfor -%}
{%- if ns.uses_tools and not tool_tokens -%}{{ raise_exception('this model was not trained for function calling (its tokenizer has no tool tokens)') }}{%- endif -%}
{%- set turns = messages -%}
{%- if not system_tokens and messages[0]['role'] == 'system' -%}
  {%- if messages | length < 2 or messages[1]['role'] != 'user' -%}{{ raise_exception('this model has no system tokens: a system message must be followed by a user message') }}{%- endif -%}
  {%- set ns.prefix = text_of(messages[0]['content']) ~ '\n\n' -%}
  {%- set turns = messages[1:] -%}
{%- endif -%}
{{- bos_token -}}
{%- if has_tools and turns[0]['role'] != 'system' -%}{{- tools_block() -}}{%- endif -%}
{%- for message in turns -%}
  {%- set role = message['role'] -%}
  {%- if role not in ['system', 'user', 'assistant', 'tool'] -%}{{ raise_exception('role must be one of system, user, assistant, tool') }}{%- endif -%}
  {%- if role == 'system' and not loop.first -%}{{ raise_exception('a system message may only come first') }}{%- endif -%}
  {%- if role == 'assistant' -%}
    {{- '<|assistant_start|>' -}}
    {%- if message['content'] is string -%}{{- message['content'] -}}
    {%- elif message['content'] is not none -%}{%- for part in message['content'] -%}
      {%- if part['type'] == 'text' -%}{{- part['text'] -}}
      {%- elif part['type'] == 'python' -%}{{- '<|python_start|>' ~ part['text'] ~ '<|python_end|>' -}}
      {%- elif part['type'] == 'python_output' -%}{{- '<|output_start|>' ~ part['text'] ~ '<|output_end|>' -}}
      {%- elif part['type'] == 'call' -%}{{- '<|call_start|>' ~ part['text'] ~ '<|call_end|>' -}}
      {%- else -%}{{ raise_exception('unsupported content part: ' ~ part['type']) }}
      {%- endif -%}
    {%- endfor -%}{%- endif -%}
    {%- for c in message.get('tool_calls') or [] -%}
      {%- set f = c['function'] if 'function' in c else c -%}
      {{- '<|call_start|>' ~ call_of(f['name'], f['arguments']) ~ '<|call_end|>' -}}
    {%- endfor -%}
    {{- '<|assistant_end|>' -}}
  {%- elif role == 'tool' -%}
    {{- '<|result_start|>' ~ text_of(message['content']) ~ '<|result_end|>' -}}
  {%- else -%}
    {{- '<|' ~ role ~ '_start|>' -}}
    {%- if role == 'user' -%}{{- ns.prefix -}}{%- set ns.prefix = '' -%}{%- endif -%}
    {{- text_of(message['content']) -}}
    {{- '<|' ~ role ~ '_end|>' -}}
    {%- if role == 'system' and has_tools -%}{{- tools_block() -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {%- if messages[-1]['role'] not in ['user', 'tool'] -%}{{ raise_exception("the last message must come from the user (or be a tool's result)") }}{%- endif -%}
  {{- '<|assistant_start|>' -}}
{%- endif -%}
""")


def hf_tokenizer(tok: SparkTokenizer, max_len: int):
    """sparkchat's tokenizer as a transformers tokenizer, with the chat template and the special tokens' roles."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer.from_str(tok.to_str())  # a copy: the HF wrapper sets its own encode options
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=chat_template(tok), model_max_length=max_len,
                                   clean_up_tokenization_spaces=False)


# ---- directories ----

def save_hf_dir(path: str | Path, model: GPT, tok: SparkTokenizer, gen: dict, card: str | None = None) -> None:
    """Writes a transformers NanoChat directory for `model` (float32 weights). Each file is written atomically
    and checksums.json comes last, as in model_dir.save_model_dir."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # beside it: one filesystem to run out of room on
        # transformers' own writers make the JSON files (its field names, its version stamp); they are
        # then moved into place one by one like the weights
        hf_config(config, tok).save_pretrained(tmp)
        generation_config(gen, tok).save_pretrained(tmp)
        # save_jinja_files=False: the template goes in tokenizer_config.json, where every version reads it
        hf_tokenizer(tok, config.seq_len).save_pretrained(tmp, save_jinja_files=False)
        writers = {p.name: (lambda dst, src=p: shutil.copyfile(src, dst)) for p in sorted(Path(tmp).iterdir())}
        sd = to_hf_state_dict(portable_state_dict(model), config)
        writers[WEIGHTS] = lambda dst: save_file(sd, str(dst), metadata={"format": "pt"})
        if card is not None:
            writers[CARD] = lambda dst: dst.write_text(card)
        for name, write in writers.items():
            write_atomic(path / name, write)
    write_atomic(path / CHECKSUMS, lambda dst: dst.write_text(
        json.dumps({name: file_record(path / name) for name in writers}, indent=2) + "\n"))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a directory: model.safetensors, or the shards its index names."""
    index = path / WEIGHTS_INDEX
    if (path / WEIGHTS).is_file() or not index.is_file():
        return [path / WEIGHTS]
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelDirError(f"model directory {path}: {WEIGHTS_INDEX} cannot be read ({e})") from None
    return [path / s for s in shards]


def read_hf_config(path: Path):
    """config.json of a transformers directory as a NanoChatConfig; ModelDirError for another model type."""
    from transformers import NanoChatConfig
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type != MODEL_TYPE:
        raise ModelDirError(f"{path}: config.json has model_type {model_type!r}; sparkchat loads its own model "
                            f"directories and transformers NanoChat ones (model_type {MODEL_TYPE!r})")
    try:
        return NanoChatConfig.from_pretrained(path)
    except Exception as e:  # transformers' validation names the field
        raise ModelDirError(f"model directory {path}: config.json cannot be loaded ({type(e).__name__}: {e})") from e


def load_hf_dir(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """A transformers NanoChat directory as (sparkchat GPT in eval mode, SparkTokenizer, generation defaults).
    Raises ModelDirError naming what does not map (another architecture, a config sparkchat cannot run,
    missing weights). The caller has verified the files (model_dir.verify_model_dir)."""
    path = Path(path)
    cfg = read_hf_config(path)
    try:
        config = gpt_config(cfg)
        sd = {}
        for f in weight_files(path):
            sd |= load_file(str(f), device=str(device))
        sd = from_hf_state_dict(sd, config, tied=bool(cfg.tie_word_embeddings))
    except ModelDirError as e:
        raise ModelDirError(f"model directory {path}: {e}") from None
    try:
        model = build_model(config, sd, device, dtype)
    except RuntimeError as e:  # shapes that disagree with config.json
        raise ModelDirError(f"model directory {path}: the weights do not fit config.json ({e})") from None
    try:
        tok = SparkTokenizer.load(path / "tokenizer.json")
    except Exception as e:
        raise ModelDirError(f"model directory {path}: tokenizer.json cannot be loaded ({e})") from None
    return model, tok, generation_defaults(path, tok)
