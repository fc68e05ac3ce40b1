"""`specserve generate | serve | bench serve | bench compare | train-draft`.

Engine flags are generated from EngineConfig's fields, so CLI flags and `LLM(...)` arguments
match 1:1 (`--max-num-seqs` <-> `max_num_seqs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import typing
from typing import Any

from specserve.config import EngineConfig

_HELP = {
    "model": "local Hugging Face model directory",
    "speculative_config": 'JSON, e.g. \'{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}\'',
    "dtype": "auto | float32 | float16 | bfloat16 (auto: bf16 on CUDA, fp32 on CPU)",
    "decode_matmul": "cublas | triton | auto (CUDA decode matmuls; auto, the default: the "
    "faster, timed at start-up per weight shape)",
    "async_scheduling": "launch step N+1 while step N runs (default: on for CUDA, off on CPU)",
    "warmup": "run every batch size and step shape once at start-up, so nothing compiles "
    "while serving (default: on for CUDA, off on CPU)",
    "mxfp4_experts": "auto | mxfp4 | dequantize (MXFP4 checkpoints such as gpt-oss: auto keeps "
    "the experts 4-bit on CUDA and dequantizes them at load on CPU)",
    "fp8_weights": "auto | keep | dequantize (block-scaled fp8 checkpoints such as DeepSeek-V3: "
    "keep: the linear layers stay 8-bit (Triton block-scaled matmul); auto, for now: "
    "dequantize at load)",
}


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        hint = hints[f.name]
        # Plain types and `X | None`: the first non-None member decides the parser.
        members = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if members[0] is bool:
            p.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP.get(f.name)
            )
            continue
        typ: Any = members[0] if members[0] in (int, float) else str
        kw: dict[str, Any] = {"type": typ, "default": default, "help": _HELP.get(f.name)}
        if f.name == "model":
            kw["required"] = model_required
        p.add_argument(flag, **kw)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name != "extra" and hasattr(args, f.name):
            kw[f.name] = getattr(args, f.name)
    return kw


# The demo's question: a held-out instruction (data/instruct_prompts.jsonl), so the acceptance
# it prints is not on text the EAGLE-3 head was trained on.
DEMO_CHAT_PROMPT = (
    "Please write a Python function that checks whether a year is a leap year, and explain "
    "how it works."
)


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.entrypoints.llm import LLM
    from specserve.sampling_params import SamplingParams

    kw = engine_kwargs(args)
    default = kw.get("model") is None
    if default:  # the default model: SmolLM2-135M-Instruct (GGUF) with its EAGLE-3 head
        from specserve.data import default_model

        kw["model"], spec = default_model()
        kw["speculative_config"] = kw.get("speculative_config") or spec
    chat = args.chat if args.chat is not None else default
    llm = LLM(**kw)
    logging.getLogger("specserve").info(llm.config.describe())
    sp = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed_request,
        ignore_eos=args.ignore_eos,
    )
    if chat:
        for prompt in args.prompt or [DEMO_CHAT_PROMPT]:
            stream_chat(llm, prompt, sp)
    else:
        _complete(llm, args.prompt or [default_prompt()], sp)
    metrics = llm.get_metrics()
    if llm.config.spec is not None:
        print(llm.engine.stats.spec.log_line())
    if args.json:
        print(json.dumps(metrics))
    return 0


def stream_chat(llm: Any, prompt: str, sp: Any) -> None:
    """One user turn through the model's chat template, the reply printed as it is generated."""
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    print(f"--- user ---\n{prompt}\n--- assistant ---", flush=True)
    engine = llm.engine
    engine.add_request("chat", {"prompt_token_ids": list(ids)}, sp)
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            print(text[shown:], end="", flush=True)
            shown = len(text)
    print()


def _complete(llm: Any, prompts: list[str], sp: Any) -> None:
    outs = llm.generate(prompts, sp)
    for prompt, o in zip(prompts, outs):
        print(f"--- prompt ---\n{prompt}\n--- completion ---\n{o.outputs[0].text}")
        m = o.metrics
        if m is not None and m.num_drafts:
            print(f"[acceptance length {m.acceptance_length:.2f} over {m.num_drafts} drafts]")


def default_prompt() -> str:
    from specserve.data import default_prompt as dp

    return dp()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text offline")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send each prompt as a user turn through the chat template and stream the reply "
        "(default: on for the default model, off for --model)",
    )
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-request", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print the engine metrics as JSON")
    g.set_defaults(func=cmd_generate)
    try:
        from specserve.entrypoints.openai.cli import add_serve_parser

        add_serve_parser(sub)
    except ImportError:  # pragma: no cover - server extras missing
        pass
    try:
        from specserve.bench.cli import add_bench_parser

        add_bench_parser(sub)
    except ImportError:  # pragma: no cover
        pass
    try:
        from specserve.train.cli import add_train_parser

        add_train_parser(sub)
    except ImportError:  # pragma: no cover
        pass
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
